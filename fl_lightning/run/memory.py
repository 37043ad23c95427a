"""The memory a run's models need, checked before the first of them is allocated.

Each role's model is built once more on PyTorch's meta device (shapes, no memory) and its parameters and buffers
counted. A run whose models' weights alone exceed what this process may still allocate (the free memory within the
cgroup's limit, or what its address-space limit leaves: ``ulimit -v``, a scheduler's RLIMIT_AS) is refused in one
sentence. The weights are a lower bound of what the run needs (gradients, optimizer moments, clients' own states
and activations come on top), so a refused run could never have run. Only the package's own builders are sized
this way: a user's builder runs once, when the run builds its model, and a pretrained one would read its weights.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from ..distributed.capacity import MB, memory_room
from ..federation.errors import ConfigError
from ..federation.user_code import is_ours
from ..models.registry import ModelSpec, resolve_builder


def check_model_memory(models: dict[str, ModelSpec], roles: list[str], context: dict[str, Any]) -> dict[str, int]:
    """Refuses (ConfigError) models whose weights this process cannot hold; returns each sized role's bytes."""
    sizes = {role: size for role in roles if (size := model_bytes(models[role], context)) is not None}
    needed, room = sum(sizes.values()), memory_room()
    if room is None or needed <= room[0]:
        return sizes
    largest = sorted(sizes, key=lambda role: -sizes[role])[:3]
    listed = "; ".join(f"role {role!r}, {models[role].builder}: {sizes[role] // MB:,} MB" for role in largest)
    raise ConfigError(
        f"the run's models need at least {needed // MB:,} MB for their weights alone ({listed}), but "
        f"{room[0] // MB:,} MB {room[1]}; use smaller models (models.<role>.args), or run where more memory is free."
    )


def model_bytes(spec: ModelSpec, context: dict[str, Any]) -> int | None:
    """Bytes of the parameters and buffers of ``spec``'s model, built on the meta device; None for a builder that is
    not the package's own, a pretrained one, or one that cannot be built there (the real build says why)."""
    if "." in spec.builder:  # a dotted path names a user's builder: its module is imported once, by the build
        return None
    try:
        fn = resolve_builder(spec.builder)
        if not is_ours(inspect.getsourcefile(fn) or "") or "fetch_weights" in inspect.signature(fn).parameters:
            return None
        with torch.device("meta"):
            model = spec.build(**context)
    except Exception:  # noqa: BLE001 - only an estimate: the real build reports what is wrong
        return None
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)
