"""FedPCL's prototype-wise contrastive losses on unit-length projections ``z`` and sets of class prototypes.

A prototype set is ``[K, C, D]`` (K sets: the global one, or every client's) with its availability ``[K, C]``
(a class the set has a prototype of). A row whose class is unavailable in a set adds nothing to that set's term,
and neither do the padded rows of a lockstep batch (``federation.padding``), so both losses keep fixed shapes
and branch on no tensor (batched clients, CUDA graphs).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..federation.padding import class_index, real_rows

NO_PROTOTYPE_LOGIT = -1e9  # a class without a prototype takes no part in a softmax (finite: no inf - inf)


def fill_missing(prototypes: Tensor, available: Tensor, fill: Tensor, fill_available: Tensor) -> tuple[Tensor, Tensor]:
    """Each set's missing classes taken from ``fill`` (the global prototypes), as both FedPCL codes pad a
    client's set: ``[K, C, D]``, ``[K, C]`` from sets ``[K, C, D]`` / ``[K, C]`` and ``fill`` ``[C, D]`` /
    ``[C]``."""
    filled = torch.where(available[..., None], prototypes, fill[None])
    return filled, available | fill_available[None]


def prototype_ce_loss(z: Tensor, labels: Tensor, prototypes: Tensor, available: Tensor, tau: float) -> Tensor:
    """The cross-entropy of the similarities ``z P_k^T / tau`` against the labels, averaged over the sets:
    HtFLlib's ``L_g`` (one set, the global prototypes) or ``L_p`` (every client's set).

    Per set, the rows whose class the set has are averaged (a set without a row's class leaves that row out);
    a class the set lacks is left out of the softmax.

    Args:
        z: ``[B, D]`` unit-length projections.
        labels: ``[B]`` classes.
        prototypes: ``[K, C, D]`` prototype sets.
        available: ``[K, C]`` bool.
        tau: the temperature.
    """
    logits = torch.einsum("bd,kcd->kbc", z, prototypes) / tau  # [K, B, C]
    logits = logits.masked_fill(~available[:, None, :], NO_PROTOTYPE_LOGIT)
    classes = class_index(labels)
    per_row = F.cross_entropy(logits.flatten(0, 1), classes.repeat(len(prototypes)), reduction="none")
    keep = _kept_rows(available, classes)  # [K, B]
    per_row = torch.where(keep, per_row.view_as(keep), torch.zeros_like(keep, dtype=per_row.dtype))
    return (per_row.sum(1) / keep.sum(1).clamp(min=1)).mean()


def prototype_supcon_loss(z: Tensor, labels: Tensor, prototypes: Tensor, available: Tensor, tau: float) -> Tensor:
    """The official FedPCL code's supervised contrastive loss with prototypes as anchors, summed over the sets.

    For a row ``i`` of class ``y_i`` and set ``k`` the anchor is ``P_k[y_i]``; its logits are its similarities to
    the batch's projections, ``P_k[y_i] . z_j / tau``, and its loss is minus the mean log-softmax (over the
    batch) of the rows ``j`` of the same class::

        l_ik = -1/|pos(i)| sum_{j: y_j = y_i} log( exp(P_k[y_i] . z_j / tau) / sum_j' exp(P_k[y_i] . z_j' / tau) )

    averaged over the rows whose class set ``k`` has, then summed over the sets. (The official code contrasts
    two augmented views and leaves out the anchor row's own column, which SupCon's self-anchored form needs;
    here one view, in which every row of the class is a positive: ``docs/algorithms.md``, FedPCL.)

    Args: as :func:`prototype_ce_loss`.
    """
    classes, rows = class_index(labels), real_rows()
    anchors = prototypes[:, classes]  # [K, B, D]: row i's anchor is its class's prototype
    logits = anchors @ z.T / tau  # [K, B anchors, B contrasted]
    if rows is not None:  # padded rows are never contrasted
        logits = logits.masked_fill(~rows[None, None, :], NO_PROTOTYPE_LOGIT)
    log_prob = logits - torch.logsumexp(logits, dim=2, keepdim=True)
    positive = classes[:, None] == classes[None, :]
    if rows is not None:
        positive = positive & rows[None, :]
    positive = positive.to(z.dtype)
    per_row = -(log_prob * positive).sum(2) / positive.sum(1).clamp(min=1)  # [K, B]
    keep = _kept_rows(available, classes)
    per_row = torch.where(keep, per_row, torch.zeros_like(per_row))
    return (per_row.sum(1) / keep.sum(1).clamp(min=1)).sum()


def _kept_rows(available: Tensor, classes: Tensor) -> Tensor:
    """``[K, B]``: the rows each set scores (its class available there, and a real row of a padded batch)."""
    keep = available[:, classes]
    rows = real_rows()
    return keep if rows is None else keep & rows[None, :]
