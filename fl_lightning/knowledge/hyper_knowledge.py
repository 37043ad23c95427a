"""FedHKD's hyper-knowledge: per-class means of representations and of soft predictions, and its two losses.

Chen and Vikalo, "The Best of Both Worlds: Accurate Global and Personalized Models through Federated Learning
with Data-Free Hyper-Knowledge Distillation", ICLR 2023 (Sec. 3). A client's hyper-knowledge of class j is the
mean representation ``h_j`` of its examples of j (with Gaussian noise for differential privacy) and the mean
soft prediction ``q_j = mean softmax(G(R(x)) / T)``; the server's is their mean over the clients weighted by
each client's count of j. Locally the head ``G`` must map every global mean representation ``H_j`` to the
global soft prediction ``Q_j``, and every representation must stay near its class's ``H_y``.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..federation.padding import class_index
from .distillation import masked_row_mean

Distance = Literal["paper", "official"]


def soft_predictions(logits: Tensor, temperature: float) -> Tensor:
    """``Q(z, T) = softmax(z / T)`` row by row (``T`` < 1 sharpens, as the paper's T = 0.5)."""
    return F.softmax(logits / temperature, dim=-1)


def _l2(difference: Tensor) -> Tensor:
    """Row norms, clamped before the square root: its gradient at 0 is infinite, and a representation equal
    to its class's mean (or a row the mask leaves out) would turn the whole step's gradient into NaN."""
    return difference.pow(2).sum(-1).clamp(min=1e-12).sqrt()


def soft_prediction_loss(head_soft: Tensor, global_soft: Tensor, available: Tensor, distance: Distance) -> Tensor:
    """The first distillation term: the head's soft predictions of the global mean representations against the
    global soft predictions, over the classes that have hyper-knowledge.

    ``paper``: ``mean_j ||Q(G(H_j), T) - Q_j||_2`` over the R available classes (the objective's second term).
    ``official``: the official code's ``nn.KLDivLoss()(log Q(G(H)), Q)``, its default element-wise mean,
    ``sum_j sum_c Q_jc (log Q_jc - log Q(G(H_j))_c) / (R C)``.

    Args:
        head_soft: ``[C, C]`` ``Q(G(H_j), T)`` for every class j (rows of absent classes are ignored).
        global_soft: ``[C, C]`` the global soft predictions ``Q_j``.
        available: ``[C]`` bool, classes with global hyper-knowledge.
    """
    count = available.sum().clamp(min=1)
    if distance == "paper":
        per_class = _l2(head_soft - global_soft)
    else:  # 0 log 0 = 0, as KLDivLoss computes it
        terms = torch.xlogy(global_soft, global_soft) - global_soft * head_soft.clamp(min=1e-30).log()
        per_class = terms.sum(-1) / head_soft.shape[-1]
    return torch.where(available, per_class, torch.zeros_like(per_class)).sum() / count


def representation_loss(features: Tensor, labels: Tensor, global_means: Tensor, available: Tensor, distance: Distance):
    """The second term: each representation's distance to its class's global mean representation ``H_y``.

    ``paper``: ``(1/B) sum_i ||R(x_i) - H_{y_i}||_2`` (the objective's third term); ``official``: the official code's
    ``MSELoss`` against a copy of the batch whose rows are ``H_y`` where the class has one, the sum of squares
    over ``B x D``. Rows whose class has no ``H`` count 0 but count in B either way; in a padded batch the padded
    rows are left out and B counts the real rows.

    Args:
        features: ``[B, D]`` representations; labels: ``[B]`` their classes.
        global_means: ``[C, D]`` the global mean representations ``H``.
        available: ``[C]`` bool, classes with global hyper-knowledge.
    """
    classes = class_index(labels)
    difference = features - global_means[classes]
    per_row = _l2(difference) if distance == "paper" else difference.pow(2).sum(-1) / features.shape[-1]
    return masked_row_mean(per_row, available[classes], over="batch")


def privacy_noise(means: Tensor, max_norms: Tensor, counts: Tensor, sigma: float, generator: torch.Generator) -> Tensor:
    """Gaussian noise for the mean representations (the paper's Gaussian mechanism): class j's mean
    over ``n_j`` representations of norm at most ``zeta_j`` changes by at most ``2 zeta_j / n_j`` when one
    example changes, so each of its entries gets ``N(0, (sigma 2 zeta_j / n_j)^2)``.

    Args:
        means: ``[S, D]`` the client's mean representations of its S classes.
        max_norms: ``[S]`` ``zeta_j``, the largest L2 norm among class j's representations.
        counts: ``[S]`` ``n_j``, its examples of class j.
        sigma: the noise multiplier (0: no noise).
        generator: the client's random stream (CPU); the noise is drawn there and moved to ``means``' device.

    Returns:
        ``[S, D]`` the noise to add.
    """
    draws = torch.randn(means.shape, generator=generator).to(means.device, means.dtype)
    scale = sigma * 2.0 * max_norms / counts.clamp(min=1)
    return draws * scale[:, None].to(means.dtype)


@torch.no_grad()
def local_hyper_knowledge(
    module, x: Tensor, y: Tensor, idx: Tensor, batch_size: int, num_classes: int, temperature: float
) -> dict[str, Tensor]:
    """A client's per-class statistics over the examples ``idx`` of the pool ``x``, ``y``, in passes of
    ``batch_size`` with ``module`` as it is (eval mode after training, as the official code computes them).

    Returns:
        ``representations`` ``[C, D]`` and ``soft_predictions`` ``[C, C]`` class means (zeros where absent),
        ``max_norms`` ``[C]`` (``zeta_j``) and ``counts`` ``[C]``.
    """
    sums: dict[str, Tensor] = {}
    max_norms = torch.zeros(num_classes, device=x.device)
    counts = torch.zeros(num_classes, dtype=torch.long, device=x.device)
    for start in range(0, len(idx), batch_size):
        chosen = idx[start : start + batch_size]
        labels = y[chosen]
        h = module.features(x[chosen])
        values = {"representations": h, "soft_predictions": soft_predictions(module.head(h), temperature)}
        for name, value in values.items():
            total = sums.setdefault(name, torch.zeros(num_classes, value.shape[1], device=x.device))
            total.index_add_(0, labels, value.float())
        max_norms.scatter_reduce_(0, labels, h.float().norm(dim=1), "amax")
        counts += torch.bincount(labels, minlength=num_classes)
    means = {name: total / counts.clamp(min=1)[:, None] for name, total in sums.items()}
    return {**means, "max_norms": max_norms, "counts": counts}
