"""A client's local fit paused by the batched executor, and the client state it carries.

The batched executor (``batched.executor``) runs each client's ``client_update`` up to its fit, copies what the
fit needs (every role's tensors, the modules' modes, the optimizer state, torch's random state) into a
:class:`FitRequest`, and restores the client from it when the fit has run (``batched.BatchedFit``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ..loop import LocalLoop
    from ..steps import StepFn


@dataclass
class FitRequest:
    """A client's local fit, paused until the executor has run it (alone or batched with others).

    ``slots`` holds every role's parameters and buffers as the client left them when it asked for the fit
    (a teacher in another role is part of the client's state too); after the fit they are the trained ones.
    """

    role: str
    batches: Iterator[tuple]
    step_fn: StepFn
    on_record: Callable[[tuple], None] | None
    rnd: int
    slots: dict[str, dict[str, Tensor]]
    modes: tuple[tuple[bool, ...], ...]
    optimizer_state: dict[str, dict[str, Tensor]]
    rng_state: tuple
    result: dict[str, float] = field(default_factory=dict)


def step_key(request: FitRequest) -> tuple:
    """(role, step function's code): what the executor remembers about a step for the rest of the run (a first
    step that failed: sequential; a step that does not honour padded rows: by shape)."""
    return request.role, getattr(request.step_fn, "__func__", request.step_fn).__code__


def snapshot_slots(loop: LocalLoop) -> dict[str, dict[str, Tensor]]:
    """Copies of every role's parameters and buffers, as the instances hold them now."""
    return {
        role: {name: t.detach().clone() for name, t in [*slot.module.named_parameters(), *slot.module.named_buffers()]}
        for role, slot in loop.slots.items()
    }


def snapshot_optimizer(slot) -> dict[str, dict[str, Tensor]]:
    """The role's optimizer state by parameter name (tensors copied)."""
    names = {p: n for n, p in slot.module.named_parameters()}
    return {
        names[p]: {k: v.clone() if isinstance(v, Tensor) else torch.tensor(v) for k, v in s.items() if v is not None}
        for p, s in slot.optimizer.state.items()
    }


def training_modes(loop: LocalLoop) -> tuple[tuple[bool, ...], ...]:
    return tuple(tuple(m.training for m in slot.module.modules()) for slot in loop.slots.values())


def restore(loop: LocalLoop, request: FitRequest) -> None:
    """Puts the client's tensors, modes and the fitted role's optimizer state back into the shared instances."""
    with torch.no_grad():
        for role, slot in loop.slots.items():
            live = dict([*slot.module.named_parameters(), *slot.module.named_buffers()])
            saved = request.slots[role]
            torch._foreach_copy_([live[n] for n in saved], list(saved.values()))
    for slot, modes in zip(loop.slots.values(), request.modes):
        for module, training in zip(slot.module.modules(), modes):
            module.training = training
    restore_optimizer(loop, request)


def restore_optimizer(loop: LocalLoop, request: FitRequest) -> None:
    """Puts the fitted role's optimizer state (as the request holds it) into the role's optimizer."""
    slot = loop.slots[request.role]
    params = dict(slot.module.named_parameters())
    slot.optimizer.state.clear()
    for name, values in request.optimizer_state.items():
        slot.optimizer.state[params[name]] = {
            k: (v.to("cpu", torch.float32) if k == "step" else v.clone()) for k, v in values.items()
        }


def random_state() -> tuple[Tensor, Tensor | None]:
    """torch's global random state (CPU, and CUDA once in use): a paused client keeps its own."""
    return torch.default_generator.get_state(), torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None


def set_random_state(state: tuple[Tensor, Tensor | None]) -> None:
    torch.default_generator.set_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1])
