"""Seeded initial weights of many clients without building a model per client.

Personalized methods give every client its own random initial model, drawn from a seed of its own
(FedHe's and Felo's code). Building that model per client cost about 7 ms on the digits models under
cProfile, most of it resolving the builder; at 10,000 clients, where nearly every sampled client is new,
that was a third of a FedHe round. A built model's default initialisation is its modules'
``reset_parameters`` called in construction order: calling them again in place on one cached instance
per role, after the same seed, draws the same numbers from the same generator and gives the same
weights bit for bit, and leaves the generator in the same state.

Whether that holds depends on the builder (one that re-initialises layers after construction, loads
pretrained weights or draws its own tensors does not satisfy it), so it is checked, once per role,
against real builds; a role that fails the check keeps building a model per client.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..federation.seeding import seed_torch

CHECK_SEED_OFFSET = 0x9E3779B9  # a second seed for the check, unrelated to the first


class SeededInitializer:
    """Initial weights of a role's model from a seed, as a fresh build would give them.

    Args:
        build: builds the role's model (on the CPU, drawing from torch's global generator).
    """

    def __init__(self, build: Callable[[], nn.Module]):
        self.build = build
        self.template: _Template | None = None  # the cached instance, once the check has passed
        self.checked = False

    def weights(self, seed: int, device: torch.device | str = "cpu") -> dict[str, Tensor]:
        """The weights a build after seeding torch with ``seed`` gives (own tensors, on ``device``).

        Leaves torch's global generator where that build would leave it (a client's dropout draws
        continue from it).
        """
        seed_torch(seed)
        if self.template is not None:
            return {k: v.to(device, copy=True) for k, v in self.template.reinitialised().items()}
        built = self.build().state_dict()
        if not self.checked:
            self.checked = True
            after = torch.default_generator.get_state()
            self.template = self._checked_template(seed, built, after)
            seed_torch(seed)
            torch.default_generator.set_state(after)
        return {k: v.to(device) for k, v in built.items()}

    def _checked_template(self, seed: int, built: dict[str, Tensor], after: Tensor) -> _Template | None:
        """A cached instance if re-initialising it in place reproduces real builds at two seeds, else None."""
        try:
            template = _Template(self.build())
            second = (seed + CHECK_SEED_OFFSET) % 2**63
            seed_torch(second)
            built_second = self.build().state_dict()
            after_second = torch.default_generator.get_state()
            for check_seed, expected, expected_after in ((seed, built, after), (second, built_second, after_second)):
                seed_torch(check_seed)
                weights = template.reinitialised()
                same_generator = torch.equal(torch.default_generator.get_state(), expected_after)
                if not (same_generator and _identical(weights, expected)):
                    return None
        except Exception:  # noqa: BLE001 - e.g. lazy modules; building per client stays correct
            return None
        return template


class _Template:
    """One built model, re-initialised in place by calling every module's ``reset_parameters``.

    Children come before their parent: a module's ``__init__`` constructs its children (each
    initialising itself) before it can touch them, so this post-order is the order in which a build
    initialises; for leaf modules (every built-in layer) it is the order of :meth:`~torch.nn.Module.modules`.
    """

    def __init__(self, model: nn.Module):
        self.resets = _resets_children_first(model)
        self.state = model.state_dict()  # aliases of the tensors that the resets overwrite in place

    @torch.no_grad()
    def reinitialised(self) -> dict[str, Tensor]:
        for reset in self.resets:
            reset()
        return self.state


def _resets_children_first(module: nn.Module) -> list[Callable[[], None]]:
    resets = [reset for child in module.children() for reset in _resets_children_first(child)]
    reset = getattr(module, "reset_parameters", None)
    return [*resets, reset] if callable(reset) else resets


def _identical(got: dict[str, Tensor], expected: dict[str, Tensor]) -> bool:
    """Same keys, dtypes, shapes and bits (bits, not values: 0.0 and -0.0 differ)."""
    return got.keys() == expected.keys() and all(_same_bits(got[k], v) for k, v in expected.items())


def _same_bits(a: Tensor, b: Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.detach().reshape(-1).view(torch.uint8), b.detach().reshape(-1).view(torch.uint8))
