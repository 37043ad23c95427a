"""The math of server-side codistillation (paper 002, Sec. 2 and Appendix F): soft targets with student
regularisation, batches drawn with replacement, mixup. The round that trains the students on them is
:class:`fl_lightning.strategies.Codistillation`."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


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


def mixup(x: Tensor, generator: torch.Generator, concentration: float) -> tuple[Tensor, float, Tensor]:
    """Mixup (Zhang et al. 2017) of a batch with a shuffled copy of itself: ``lam x + (1 - lam) x[partner]``.

    One ``lam ~ Beta(concentration, concentration)`` per batch, as the mixup paper's code. Returns the
    mixed batch, ``lam`` and the partner indices ``[B]``.
    """
    partner = torch.randperm(len(x), generator=generator).to(x.device)
    # torch's Beta sampler cannot take a generator; numpy's, seeded from it, keeps the draw reproducible
    lam = float(
        np.random.default_rng(int(torch.randint(2**62, (), generator=generator))).beta(concentration, concentration)
    )
    return lam * x + (1 - lam) * x[partner], lam, partner


def __getattr__(name: str):
    if name == "Codistillation":  # a recipe written before the class moved
        raise AttributeError(
            "fl_lightning.knowledge.codistill.Codistillation moved to fl_lightning.strategies.Codistillation; "
            "change the recipe's distillation class_path to it."
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
