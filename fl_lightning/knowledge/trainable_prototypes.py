"""FedTGP's trainable global prototypes and their adaptive-margin contrastive loss.

Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced Contrastive Learning for
Data and Model Heterogeneity in Federated Learning", AAAI 2024 (layer layout, loss and margin
from the official code, which HtFLlib ships unchanged).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TrainablePrototypes(nn.Module):
    """``P_c = fc(ReLU(middle(embedding(c))))``: one trainable vector per class, mapped by a small network.

    ``Embedding(C, D) -> Linear(D, hidden) -> ReLU -> Linear(hidden, D)``; the official code's hidden width
    is the feature size D.
    """

    def __init__(self, num_classes: int, feature_dim: int, hidden_dim: int | None = None):
        super().__init__()
        hidden_dim = hidden_dim or feature_dim
        self.embedding = nn.Embedding(num_classes, feature_dim)
        self.middle = nn.Sequential(nn.Linear(feature_dim, hidden_dim), nn.ReLU())
        self.fc = nn.Linear(hidden_dim, feature_dim)
        self.num_classes = num_classes

    def forward(self, classes: Tensor | None = None) -> Tensor:
        """The prototypes ``[len(classes), D]`` of ``classes`` (every class, in order, when None)."""
        if classes is None:
            classes = torch.arange(self.num_classes, device=self.embedding.weight.device)
        return self.fc(self.middle(self.embedding(classes)))


def adaptive_margin(class_means: Tensor, present: Tensor, threshold: float) -> float:
    """``delta = min(max_c gap_c, tau)``: ``gap_c`` the L2 distance from class c's mean client prototype to the
    nearest other class's (over the classes ``present``), ``tau`` the ``threshold``.

    With fewer than two classes present there is no gap and the margin is ``tau`` (the code's 1e9 placeholder
    capped by ``tau``).

    Args:
        class_means: ``[C, D]`` per class, the mean of the clients' prototypes of that class.
        present: ``[C]`` bool, classes some client uploaded.
        threshold: tau (100 in the official code).
    """
    means = class_means[present].double()
    if len(means) < 2:
        return float(threshold)
    distances = torch.cdist(means, means)  # [P, P]
    distances.fill_diagonal_(float("inf"))
    return min(float(distances.min(1).values.max()), float(threshold))


def margin_contrastive_loss(client_prototypes: Tensor, labels: Tensor, prototypes: Tensor, margin: float) -> Tensor:
    """``CE(-(||p_i - P_c||_2 + delta 1[c = y_i]), y_i)``, mean over the rows.

    Each uploaded prototype is pulled to its class's global prototype, whose distance is enlarged by the
    margin, and pushed from the others.

    Args:
        client_prototypes: ``[B, D]`` uploaded class prototypes; labels: ``[B]`` their classes.
        prototypes: ``[C, D]`` the trainable global prototypes.
        margin: delta (:func:`adaptive_margin`).
    """
    squared = (client_prototypes[:, None, :] - prototypes[None]).pow(2).sum(2)  # [B, C]
    distances = squared.clamp(min=1e-12).sqrt()  # the gradient of sqrt at 0 is infinite
    return F.cross_entropy(-(distances + margin * F.one_hot(labels, len(prototypes))), labels)
