"""Server-side codistillation between model pools (paper 002, Sec. 2 and Appendix F)."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from ..schedules import linear_decay
from ..types import StateDict
from .distillation import kl_to_targets

if TYPE_CHECKING:  # strategies.base imports the knowledge package
    from ..strategies.base import ServerContext


def codistillation_targets(
    teacher_logits: Tensor, student_logits: Tensor, temperature: float, student_reg: float
) -> Tensor:
    """Soft labels: ``(1 - beta) softmax(teacher/T) + beta softmax(student_init/T)``.

    ``beta`` (student regularization) keeps the student near its parameters at the start of the
    distillation round by using its own initial predictions as a second teacher (Appendix F).
    """
    teacher = F.softmax(teacher_logits / temperature, dim=1)
    if student_reg == 0:
        return teacher
    return (1 - student_reg) * teacher + student_reg * F.softmax(student_logits / temperature, dim=1)


def random_batches(x: Tensor, targets: Tensor, batch_size: int, generator: torch.Generator) -> Iterator[tuple]:
    """Endless batches ``(x, targets)`` drawn with replacement (the server's distillation set is small)."""
    while True:
        idx = torch.randint(len(x), (min(batch_size, len(x)),), generator=generator).to(x.device)
        yield x[idx], targets[idx]


class Codistillation:
    """Settings and run of one bidirectional codistillation round between two model pools.

    Teachers are frozen copies of the current models; each student starts from its own current model
    and learns from the other pool's teacher (Algorithm 1 line 7 / Algorithm 2 line 6).

    Args:
        steps: s, distillation steps per codistillation round.
        batch_size: server examples per step (drawn with replacement from the server's unlabeled set).
        lr: Adam learning rate of each student (a number, or one per student role).
        lr_final: the rate in the last round as a fraction of ``lr`` (linear decay over rounds; 1: none).
        temperature: softmax temperature of each teacher (a number, or one per teacher role).
        student_reg: beta, weight of the student's own initial soft labels in its targets.
    """

    def __init__(
        self,
        steps: int = 50,
        batch_size: int = 64,
        lr: float | dict[str, float] = 1e-3,
        lr_final: float = 1.0,
        temperature: float | dict[str, float] = 1.0,
        student_reg: float = 0.0,
    ):
        self.steps, self.batch_size, self.lr, self.lr_final = steps, batch_size, lr, lr_final
        self.temperature, self.student_reg = temperature, student_reg

    @staticmethod
    def _per_role(value, role):
        return value[role] if isinstance(value, dict) else value

    def run(
        self,
        server: ServerContext,
        weights: dict[str, StateDict],
        roles: tuple[str, str],
        x: Tensor,
        progress: float,
        generator: torch.Generator,
    ) -> dict[str, StateDict]:
        """Students of both roles; ``progress`` in [0, 1] decays the learning rates."""
        logits = {r: server.predict(r, weights[r], x) for r in roles}
        students = {}
        for student, teacher in (roles, roles[::-1]):
            temperature = self._per_role(self.temperature, teacher)
            targets = codistillation_targets(logits[teacher], logits[student], temperature, self.student_reg)
            lr = self._per_role(self.lr, student) * linear_decay(progress, self.lr_final)
            batches = itertools.islice(random_batches(x, targets, self.batch_size, generator), self.steps)

            def step(module, batch, i, temperature=temperature):
                xb, tb = batch
                return kl_to_targets(module(xb), tb, temperature)

            students[student] = server.train(
                student, weights[student], batches, step, lambda params, lr=lr: torch.optim.Adam(params, lr=lr)
            )
        return students
