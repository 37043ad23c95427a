"""LocalTraining: how a client trains, as a recipe states it (part of ``flrun fit``'s schema).

It lives apart from the loop so that the CLI builds its parser without importing Lightning (seconds of
start-up, docs/reference/measurements.md): jsonargparse reads the annotations of this module, not the loop's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from jsonargparse import lazy_instance

from ..federation.errors import ConfigError
from ..federation.schedules import ConstantLR, RoundSchedule

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

# jsonargparse's lazy_instance finds its caller's module with inspect.stack(), which reads the source of every frame
# on the stack: a third of a second under a test's or a notebook's deep stack, paid by every LocalTraining built
# (each parse of a recipe builds several). Its class is made once, here; a default is a new instance of it, as
# lazy_instance returns (its class is also what lazy_instance would reuse, from this module).
_LazyConstantLR: Any = type(lazy_instance(ConstantLR))


def _constant_lr() -> RoundSchedule:
    return _LazyConstantLR(ConstantLR, {})


@dataclass
class LocalTraining:
    """How a client trains a model role locally in one round.

    Attributes:
        optimizer: client optimizer as ``class_path`` / ``init_args`` (SGD, lr 0.05 when not given);
            its learning rate is the base rate that ``lr_schedule`` scales.
        local_epochs: passes over the local labeled data per round (used when ``local_steps`` is unset).
        local_steps: optimizer steps per round (paper 001's tau, FedHe's 3 batches); overrides epochs.
        batch_size: examples per local step.
        lr_schedule: multiplier of the base learning rate over rounds.
        optimizer_state: ``reset``: fresh optimizer state for each client and round (FedAvg);
            ``per_client``: each client keeps its own state across rounds (FedHe, Felo: persistent Adam);
            ``shared``: one state per role carried from client to client (paper 001's code);
            ``shared_per_phase``: one state per role; every client of a phase starts from the state the phase
            began with, and the last client's final state carries on. It is ``shared`` without the order
            between clients, so the clients of a phase can train at once (``runtime.executor: batched``).
        grad_clip_norm: clip the gradient norm to this value (FedGH uses 50); ``None`` to disable.
        eval_batch_size: batch size of evaluation passes.
        drop_last: drop each pass's last partial batch, as a PyTorch ``DataLoader(drop_last=True)`` (HtFLlib's
            loaders): an epoch takes ``n // batch_size`` full batches (one batch of all ``n`` when fewer), so no
            batch holds the single example that batch norm cannot normalise in training.
    """

    optimizer: Callable[[Iterable], torch.optim.Optimizer] | None = None
    local_epochs: int = 1
    local_steps: int | None = None
    batch_size: int = 32
    lr_schedule: RoundSchedule = field(default_factory=_constant_lr)
    optimizer_state: Literal["reset", "per_client", "shared", "shared_per_phase"] = "reset"
    grad_clip_norm: float | None = None
    eval_batch_size: int = 512
    drop_last: bool = False

    def __post_init__(self):
        if self.batch_size < 1:
            raise ConfigError(f"training.batch_size must be at least 1, got {self.batch_size}.")
        if self.local_steps is None and self.local_epochs < 1:
            raise ConfigError("training needs local_steps >= 1 or local_epochs >= 1.")
        if self.local_steps is not None and self.local_steps < 1:
            raise ConfigError(f"training.local_steps must be at least 1, got {self.local_steps}.")
        if self.eval_batch_size < 1:
            raise ConfigError(f"training.eval_batch_size must be at least 1, got {self.eval_batch_size}.")
        # a negative norm would flip every clipped gradient: training silently becomes gradient ascent
        if self.grad_clip_norm is not None and not self.grad_clip_norm > 0:
            raise ConfigError(
                f"training.grad_clip_norm must be positive, got {self.grad_clip_norm}; use null to disable clipping."
            )
        if self.optimizer is not None:
            self._check_optimizer(self.optimizer)

    @staticmethod
    def _check_optimizer(optimizer: Callable[[Iterable], torch.optim.Optimizer]) -> None:
        """Builds the optimizer once on a dummy parameter, so that a bad lr or momentum fails before training."""
        try:
            optimizer([torch.nn.Parameter(torch.zeros(1))])
        except (ValueError, TypeError) as err:
            raise ConfigError(
                f"training.optimizer cannot be built: {str(err).rstrip('.')}; fix its init_args in the recipe "
                "(e.g. lr > 0, momentum >= 0)."
            ) from None

    def optimizer_factory(self) -> OptimizerFactory:
        return self.optimizer or (lambda params: torch.optim.SGD(params, lr=0.05))
