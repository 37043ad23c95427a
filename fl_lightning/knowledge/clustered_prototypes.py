"""FPL's clustered prototypes: the server's per-class clusters of the clients' prototypes (FINCH) and the clients'
two losses against them, the cluster-prototype contrastive loss and the unbiased-prototype consistency loss.

The losses keep fixed shapes and branch on no tensor: a row whose class has no prototype adds 0 but counts in
the batch mean (the official code divides by the whole batch), and the padded rows of a lockstep batch
(``federation.padding``) are left out of both the sum and the count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..federation.padding import class_index, real_rows
from .finch import cluster_means, finch

NOT_POSITIVE_LOGIT = -1e9  # a cluster of another class is out of the numerator's sum (finite: no inf - inf)
COSINE_EPS = 1e-8  # torch's cosine_similarity's, which the official code uses


def clustered_prototypes(prototypes: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """FPL's server step: per class, its uploaded prototypes (one per client holding it) clustered by FINCH's last
    partition (cosine distance), each cluster replaced by its members' mean; a class uploaded once keeps that one.

    Args:
        prototypes: ``[N, D]`` the round's uploaded class prototypes.
        labels: ``[N]`` their classes.
        num_classes: C.

    Returns:
        ``[M, D]`` the cluster prototypes (float32) and ``[M]`` their classes, class by class.
    """
    rows, classes = [], []
    for c in range(num_classes):
        members = prototypes[labels == c].detach().cpu()
        if not len(members):
            continue
        means = cluster_means(members, finch(members)[-1]) if len(members) > 1 else members.double()
        rows.append(means.float())
        classes.append(torch.full((len(means),), c, dtype=torch.long))
    if not rows:
        return torch.zeros(0, prototypes.shape[1]), torch.zeros(0, dtype=torch.long)
    return torch.cat(rows), torch.cat(classes)


def unbiased_prototypes(clusters: Tensor, cluster_labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """``[C, D]`` each class's unbiased prototype, the plain mean of its cluster prototypes, and ``[C]`` the
    classes that have one."""
    counts = torch.bincount(cluster_labels, minlength=num_classes).to(clusters.dtype)
    sums = torch.zeros(num_classes, clusters.shape[1], dtype=clusters.dtype, device=clusters.device)
    sums.index_add_(0, cluster_labels, clusters)
    return sums / counts.clamp(min=1)[:, None], counts > 0


def cluster_contrastive_loss(features: Tensor, classes: Tensor, clusters: Tensor, cluster_labels: Tensor, tau: float):
    """``[B]`` the cluster-prototype contrastive loss of each row: ``-log(sum_{m of class y} e^{cos(h, p_m)/tau} /
    sum_m e^{cos(h, p_m)/tau})`` over the M cluster prototypes of every class (``classes`` already safe to index
    with)."""
    unit = F.normalize(features, dim=1, eps=COSINE_EPS)
    logits = unit @ F.normalize(clusters, dim=1, eps=COSINE_EPS).T / tau  # [B, M]
    positive = cluster_labels[None, :] == classes[:, None]
    return torch.logsumexp(logits, dim=1) - torch.logsumexp(logits.masked_fill(~positive, NOT_POSITIVE_LOGIT), dim=1)


def fpl_loss(
    features: Tensor,
    labels: Tensor,
    clusters: Tensor,
    cluster_labels: Tensor,
    unbiased: Tensor,
    available: Tensor,
    tau: float,
    contrastive: float = 1.0,
    consistency: float = 1.0,
) -> Tensor:
    """FPL's prototype term of a batch: ``contrastive x`` the cluster-prototype contrastive loss plus
    ``consistency x`` the squared distance to the class's unbiased prototype (averaged over D, the official
    ``MSELoss``), summed over the rows whose class has prototypes and divided by the batch's size.

    Args:
        features: ``[B, D]`` representations.
        labels: ``[B]`` classes.
        clusters: ``[M, D]`` cluster prototypes; ``cluster_labels`` ``[M]`` their classes.
        unbiased: ``[C, D]`` unbiased prototypes; ``available`` ``[C]`` bool, the classes that have one.
        tau: the contrastive temperature.
    """
    classes, rows = class_index(labels), real_rows()
    per_row = contrastive * cluster_contrastive_loss(features, classes, clusters, cluster_labels, tau)
    per_row = per_row + consistency * (features - unbiased[classes]).pow(2).mean(dim=1)
    covered = available[classes]
    if rows is not None:
        covered = covered & rows
    total = torch.where(covered, per_row, torch.zeros_like(per_row)).sum()
    return total / (len(features) if rows is None else rows.sum())
