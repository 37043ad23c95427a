"""The optimizers a CUDA graph may replay (SGD, Adam, AdamW), Adam's ``capturable`` mode for the whole run,
and an optimizer's state tensors kept where the graphs captured them."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class KeptState:
    """An optimizer's state tensors as the graphs captured them, one per (parameter, entry)."""

    params: list[Tensor]
    names: list[str]
    tensors: list[Tensor]
    owner: weakref.ref  # the optimizer: ids of freed objects are reused

    def install(self, state: dict) -> None:
        for p, name, tensor in zip(self.params, self.names, self.tensors):
            state[p][name] = tensor


REPLAYED_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)
CAPTURABLE = (torch.optim.Adam, torch.optim.AdamW)


def prepare_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Switches Adam and AdamW to ``capturable`` mode for the whole run (see the module's docstring)."""
    if isinstance(optimizer, CAPTURABLE):
        optimizer.defaults["capturable"] = True
        for group in optimizer.param_groups:
            group["capturable"] = True
        optimizer._warned_capturable_if_run_uncaptured = True  # eager steps are intended: no warning


ZERO_LR = (
    "the learning rate is 0: Adam's default step (its capturable mode divides by the learning rate, "
    "0 / 0 where a second moment is 0)"
)


def pause_capturable_at_zero_lr(optimizer: torch.optim.Optimizer) -> bool:
    """At a learning rate of 0 (the last round of a cosine schedule) capturable Adam computes 0 / 0 for
    every parameter whose second moment is 0 and writes NaN into it; the default step leaves the weights
    as they are. Such a fit runs eagerly with the default step; True when it does."""
    if not isinstance(optimizer, CAPTURABLE) or not any(group["lr"] == 0 for group in optimizer.param_groups):
        return False
    for group in optimizer.param_groups:
        group["capturable"] = False
    return True


def resume_capturable(optimizer: torch.optim.Optimizer) -> None:
    prepare_optimizer(optimizer)
    for p, state in optimizer.state.items():
        step = state.get("step")
        if isinstance(step, Tensor) and step.device != p.device:  # a fresh state the default step made
            state["step"] = step.to(p.device)  # where capturable mode keeps the count


def keeps_state(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, CAPTURABLE) or any(group.get("momentum") for group in optimizer.param_groups)


def fresh_state_is_zero(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a first step on zeroed state tensors computes what a first step on no state does."""
    if isinstance(optimizer, CAPTURABLE):
        return True  # Adam starts from zero moments and a zero step count
    # SGD: 0 * momentum + (1 - dampening) * gradient is the gradient it copies only without dampening
    return not any(group.get("dampening") for group in optimizer.param_groups)
