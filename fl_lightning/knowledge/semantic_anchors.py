"""FedSA's semantic anchors: their initialisation on the server, the margin between classes, and the clients'
anchor-based losses (regularisation, margin-enhanced contrastive learning, classifier calibration).

The losses keep fixed shapes and branch on no tensor; the padded rows of a lockstep batch
(``federation.padding``) are left out of every mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..federation.padding import class_index, padded_loss, real_labels

BN_EPS = 1e-5  # batch norm's default
DISTANCE_FLOOR = 1e-12  # under the square root: no NaN gradient where a representation sits on an anchor


def initial_anchors(num_classes: int, dim: int, seed: int) -> Tensor:
    """``[C, D]`` the semantic anchors before any round: C standard normal rows through the official code's
    projector ``Linear, BatchNorm, ReLU, Linear, BatchNorm, ReLU`` (D -> D, PyTorch's default initialisation,
    batch norm on the C rows' statistics with weight 1 and bias 0), drawn from ``seed``."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        rows = torch.randn(num_classes, dim)
        first, second = torch.nn.Linear(dim, dim), torch.nn.Linear(dim, dim)
    with torch.no_grad():
        hidden = F.relu(F.batch_norm(first(rows), None, None, training=True, eps=BN_EPS))
        return F.relu(F.batch_norm(second(hidden), None, None, training=True, eps=BN_EPS))


def mean_nearest_distance(vectors: Tensor) -> float:
    """The mean over rows of the L2 distance to the nearest other row (the official code's class margin);
    ``-inf`` for fewer than two rows."""
    if len(vectors) < 2:
        return float("-inf")
    distances = torch.cdist(vectors.double(), vectors.double())
    distances.fill_diagonal_(float("inf"))
    return float(distances.min(dim=1).values.mean())


def anchor_distances(features: Tensor, anchors: Tensor) -> Tensor:
    """``[B, C]`` the L2 distance of each representation to each anchor (the expanded square, as the official
    code computes it, floored before the root)."""
    squared = features.pow(2).sum(1, keepdim=True) - 2 * features @ anchors.T + anchors.pow(2).sum(1)[None, :]
    return squared.clamp(min=DISTANCE_FLOOR).sqrt()


def margin_contrastive_loss(features: Tensor, labels: Tensor, anchors: Tensor, gap: float) -> Tensor:
    """The anchor-based margin-enhanced contrastive loss: the cross-entropy of the negative distances to the
    anchors, the own class's distance lengthened by ``gap`` (the margin)."""
    distances = anchor_distances(features, anchors)
    # the own class's column by comparison (one_hot checks its input's values, which a vmapped step cannot)
    own = (torch.arange(len(anchors), device=labels.device)[None, :] == class_index(labels)[:, None]).to(
        distances.dtype
    )
    return F.cross_entropy(-(distances + gap * own), real_labels(labels))


def anchor_regularisation(features: Tensor, labels: Tensor, anchors: Tensor) -> Tensor:
    """The anchor-based regularisation: the mean squared difference of each representation from its class's anchor
    (the official ``MSELoss``, over every element of the real rows)."""
    return padded_loss(F.mse_loss, features, anchors[class_index(labels)])


def classifier_calibration(anchor_logits: Tensor) -> Tensor:
    """The anchor-based classifier calibration: the cross-entropy of the head's logits of the C anchors ``[C, C]``
    against their own classes."""
    return F.cross_entropy(anchor_logits, torch.arange(len(anchor_logits), device=anchor_logits.device))
