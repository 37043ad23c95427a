"""What one local step is: a strategy's step function, the slot of a role's one model instance, the default
cross-entropy step, and the mark of a step that is a pure function of its inputs.

A step function takes ``(module, batch, i)`` and returns the loss (or ``(loss, record)``: what the step
observed, such as FedHe's logits). The sequential loop, the batched executor and CUDA-graph replays all call
the same step functions, so a strategy never knows how its clients' fits are run.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

import torch
from torch import Tensor

if TYPE_CHECKING:
    from .module import ClientModule

StepFn = Callable[["ClientModule", tuple, int], Tensor]


Module = TypeVar("Module", bound=torch.nn.Module)


@dataclass
class ModelSlot(Generic[Module]):
    """The single reusable instance of one role (a :class:`ClientModule`) or of a strategy's helper module (a
    plain ``torch.nn.Module``): module, optimizer and base learning rates."""

    module: Module
    optimizer: torch.optim.Optimizer
    base_lrs: list[float]


def training_step(module: ClientModule, batch: tuple, i: int) -> Tensor:
    return module.training_step(batch, i)


def vmappable(step_fn: Callable) -> Callable:
    """Marks a step function as pure: its loss depends only on its module, batch and closure values,
    it changes nothing outside (no collectors, no Python lists), draws no random numbers, and reaches the
    same trained tensors at every step and batch size (the batched executor checks the first step only: a
    tensor torch's optimizer would skip for want of a gradient in a later step would be moved by momentum
    or weight decay there). A mean over the batch leaves out the padded rows of a lockstep step
    (``federation.padding``: labels PAD, ``class_index``, ``real_labels``, ``padded_loss``); a group checks
    that at its first padded step and steps by shape where it does not hold."""
    step_fn.vmappable = True  # type: ignore[attr-defined]  # a mark the executors read with getattr
    return step_fn
