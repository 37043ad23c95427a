"""Losses of mutual learning between two models of one client (FML, FedKD): the KL between their outputs and
FedKD's hidden-state loss. The training procedure that steps both models on one batch is
:func:`fl_lightning.client.joint.fit_jointly`."""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

KLReduction = Literal["batchmean", "mean"]  # the KL per example, or divided by B x C as nn.KLDivLoss()


def mutual_kl(
    student_logits: Tensor, teacher_logits: Tensor, reduction: KLReduction = "batchmean", detach: bool = True
) -> Tensor:
    """``KL(softmax(teacher) || softmax(student))`` between two models' logits ``[B, C]``.

    Args:
        reduction: ``batchmean``, summed over classes and averaged over the batch (the KL of the two
            distributions, as the papers write it); ``mean``, divided by ``B x C`` (``nn.KLDivLoss()``'s
            default, which the official FedKD code and HtFLlib's FML and FedKD use).
        detach: the teacher's logits are a constant target (no gradient flows into the teacher).
    """
    teacher = teacher_logits.detach() if detach else teacher_logits
    total = F.kl_div(F.log_softmax(student_logits, 1), F.softmax(teacher, 1), reduction="sum")
    # divided here rather than by kl_div's 'mean', which torch plans to turn into 'batchmean'
    return total / (student_logits.shape[0] if reduction == "batchmean" else student_logits.numel())


def hidden_map(student_dim: int, teacher_dim: int) -> nn.Linear:
    """FedKD's ``W_h``: a learnable linear map of the student's hidden states to the teacher's size."""
    return nn.Linear(student_dim, teacher_dim, bias=False)


def hidden_state_loss(teacher_hidden: Tensor, student_hidden: Tensor, mapping: nn.Module) -> Tensor:
    """``MSE(H_t, W_h H_s)``, the mean over every element (FedKD's hidden-state loss on representations)."""
    return F.mse_loss(mapping(student_hidden), teacher_hidden)
