"""Server-side codistillation between model pools (paper 002, Sec. 2 and Appendix F)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.module import ClientModule
from ..types import StateDict
from .distillation import kl_to_targets


@torch.no_grad()
def predict_logits(module: ClientModule, weights: StateDict, x: Tensor, batch_size: int = 512) -> Tensor:
    """Eval-mode logits ``[N, C]`` of ``weights`` on ``x`` (teachers are frozen, so this is done once)."""
    module.model.load_state_dict(weights)
    module.eval()
    return torch.cat([module(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])


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


def distill(
    module: ClientModule,
    start: StateDict,
    x: Tensor,
    targets: Tensor,
    steps: int,
    batch_size: int,
    lr: float,
    temperature: float,
    generator: torch.Generator,
) -> StateDict:
    """``steps`` Adam steps of KL(targets || softmax(student/T)) on random batches; returns the student."""
    module.model.load_state_dict(start)
    module.train()
    optimizer = torch.optim.Adam(module.parameters(), lr=lr)
    for _ in range(steps):
        idx = torch.randint(len(x), (min(batch_size, len(x)),), generator=generator).to(x.device)
        optimizer.zero_grad(set_to_none=True)
        kl_to_targets(module(x[idx]), targets[idx], temperature).backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in module.model.state_dict().items()}


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
        slots: dict,
        weights: dict[str, StateDict],
        roles: tuple[str, str],
        x: Tensor,
        progress: float,
        generator: torch.Generator,
    ) -> dict[str, StateDict]:
        """Students of both roles; ``progress`` in [0, 1] decays the learning rates."""
        logits = {r: predict_logits(slots[r].module, weights[r], x) for r in roles}
        students = {}
        for student, teacher in (roles, roles[::-1]):
            temperature = self._per_role(self.temperature, teacher)
            targets = codistillation_targets(logits[teacher], logits[student], temperature, self.student_reg)
            lr = self._per_role(self.lr, student) * (1.0 + (self.lr_final - 1.0) * progress)
            students[student] = distill(
                slots[student].module,
                weights[student],
                x,
                targets,
                self.steps,
                self.batch_size,
                lr,
                temperature,
                generator,
            )
        return students
