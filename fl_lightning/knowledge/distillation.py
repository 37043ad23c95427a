"""Distillation losses. Their means over the batch leave out a padded batch's padded rows
(``federation.padding``: the batched executor in lockstep); otherwise they are the plain computations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..federation.padding import class_index, padded_loss, real_rows


def kd_kl_loss(student_logits: Tensor, teacher_logits: Tensor, temperature: float = 1.0) -> Tensor:
    """Hinton et al.'s distillation loss ``T^2 * KL(softmax(t/T) || softmax(s/T))``.

    The KL is summed over classes and averaged over the batch (paper 001's code); the ``T^2`` keeps
    gradient magnitudes comparable across temperatures.

    Args:
        student_logits: ``[B, C]``.
        teacher_logits: ``[B, C]`` (no gradient flows into them).
        temperature: T.
    """
    targets = F.softmax(teacher_logits.detach().float() / temperature, dim=1)  # float32 under any precision
    return kl_to_targets(student_logits, targets, temperature)


def kl_to_targets(student_logits: Tensor, target_probs: Tensor, temperature: float = 1.0) -> Tensor:
    """``T^2 * KL(targets || softmax(s/T))`` summed over classes, mean over the batch (in float32: CPU
    autocast would otherwise run the log-softmax in bfloat16)."""
    log_student = F.log_softmax(student_logits.float() / temperature, dim=1)
    return padded_loss(F.kl_div, log_student, target_probs, reduction="batchmean") * temperature**2


def not_true_logits(logits: Tensor, labels: Tensor) -> Tensor:
    """Each row's logits without its label's column, the other ``C - 1`` in class order ``[B, C - 1]``.

    Column ``j`` of a row with label ``y`` is class ``j`` below ``y`` and ``j + 1`` from it on: a gather with
    fixed shapes (no boolean indexing), so a step using it can run batched; a padded row (label PAD) drops
    class 0 and is left out of the means by its caller.
    """
    others = torch.arange(logits.shape[1] - 1, device=logits.device)
    index = others + (others.unsqueeze(0) >= class_index(labels).unsqueeze(1)).long()
    return logits.gather(1, index)


def not_true_distillation_loss(
    student_logits: Tensor, teacher_logits: Tensor, labels: Tensor, temperature: float = 1.0
) -> Tensor:
    """FedNTD's not-true distillation ``T^2 * KL(softmax(t~/T) || softmax(s~/T))``, ``~`` the logits of the
    classes other than each row's label (:func:`not_true_logits`): the softmax is renormalised over the
    not-true classes, the KL summed over them and averaged over the batch, as the authors' code computes it."""
    return kd_kl_loss(not_true_logits(student_logits, labels), not_true_logits(teacher_logits, labels), temperature)


def logit_matching_loss(z: Tensor, target: Tensor, kind: str = "mse") -> Tensor:
    """Distance of logits ``z`` ``[B, C]`` to per-example target logits (FedHe, Felo).

    ``mse``: mean over batch x classes (the official FedHe / Felo code); ``kl``: KL(softmax(target) ||
    softmax(z)) averaged over the batch (Felo's paper).
    """
    if kind == "mse":
        return F.mse_loss(z, target)
    return F.kl_div(F.log_softmax(z, 1), F.softmax(target, 1), reduction="batchmean")


def logit_distance_rows(z: Tensor, target: Tensor, kind: str = "mse") -> Tensor:
    """Per-example ``[B]`` form of :func:`logit_matching_loss`: its mean over rows is that loss (float32)."""
    z, target = z.float(), target.float()
    if kind == "mse":
        return (z - target).pow(2).mean(1)
    return F.kl_div(F.log_softmax(z, 1), F.softmax(target, 1), reduction="none").sum(1)


def masked_row_mean(per_row: Tensor, covered: Tensor, over: str = "batch") -> Tensor:
    """The mean of ``per_row`` ``[B]`` over the ``covered`` rows, or their sum over the batch size.

    ``over='batch'``: sum over the covered rows / B (FedHe eq. 12-13, Felo eq. 1); ``available``: / the
    covered rows. 0 when no row is covered. Fixed shapes and no data-dependent branch (no boolean
    indexing, no ``if mask.any()``), so a step using it can run batched under ``torch.func.vmap``. In a
    padded batch, padded rows are not covered and B counts the real rows.
    """
    rows = real_rows()
    if rows is not None:
        covered = covered & rows
    total = torch.where(covered, per_row, torch.zeros_like(per_row)).sum()
    if over == "batch":
        return total / (per_row.shape[0] if rows is None else rows.sum())
    return total / covered.sum().clamp(min=1)


def ramp_up(rnd: int, weight: float, ramp_rounds: int) -> float:
    """Sigmoid-shaped ramp-up of a loss weight (Laine & Aila 2017), as in paper 001's code.

    ``weight * exp(-5 (1 - r / R)^2)`` for the 0-based round ``r < R``, then ``weight``.
    """
    if ramp_rounds <= 0 or rnd >= ramp_rounds:
        return weight
    import math

    return weight * math.exp(-5.0 * (1.0 - rnd / ramp_rounds) ** 2)
