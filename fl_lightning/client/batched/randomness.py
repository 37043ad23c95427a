"""Layers that draw random numbers in a fit, found before a group of clients is batched.

One vmapped call runs a step for every client of a group, so a random layer in it would need each client's own
random stream (the one the sequential loop seeds per client and round), which that call cannot draw: torch's
vmap refuses random operations in its ``randomness="error"`` mode. Fits whose modules hold such a layer are
therefore run by the sequential loop, decided from the modules before any batched attempt (no stacked state
built, no failed first step), with the same numbers as ``runtime.executor: sequential``.

A random operation called from a ``forward`` without a module (``F.dropout`` written out, ``torch.rand``) is not
seen here; the first batched step of such a model fails and its fits run sequentially from then on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from ..loop import LocalLoop


def draws_random_numbers(module: nn.Module) -> bool:
    """Whether ``module`` draws random numbers in training mode: dropout of every kind with p > 0, RReLU."""
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return isinstance(module, nn.RReLU)


def random_layers(loop: LocalLoop, role: str, modes: tuple[tuple[bool, ...], ...]) -> list[str]:
    """The layers that would draw random numbers in a fit of ``role``, as ``role: name (Type)``.

    The fitted role trains (every module of it in training mode, as the sequential loop sets it); the other roles
    keep the modes the client left them in (``modes``, one flag per module in ``modules()`` order): a teacher in
    evaluation mode draws nothing.
    """
    found = []
    for (name, slot), flags in zip(loop.slots.items(), modes):
        for (path, module), training in zip(slot.module.named_modules(), flags):
            if (name == role or training) and draws_random_numbers(module):
                # named as in the user's model, not under ClientModule's attribute that holds it
                found.append(f"{name}: {path.removeprefix('model.')} ({type(module).__name__})")
    return found
