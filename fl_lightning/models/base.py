"""The model contract every strategy relies on: ``features`` then ``head``."""

from __future__ import annotations

from torch import Tensor, nn


class FeatureClassifier(nn.Module):
    """A classifier split into a feature extractor and a prediction head.

    ``forward(x) == head(features(x))``. Knowledge-transfer methods read the features (Felo, FedGH's
    representations) or swap the head (FedGH), so every registered model follows this contract.

    Args:
        features: maps a batch ``[B, ...]`` to representations ``[B, D]``.
        head: maps ``[B, D]`` to logits ``[B, C]``.
        feature_dim: D.
        num_classes: C.
    """

    def __init__(self, features: nn.Module, head: nn.Module, feature_dim: int, num_classes: int):
        super().__init__()
        self.features = features
        self.head = head
        self.feature_dim = feature_dim
        self.num_classes = num_classes

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def scaled(channels: int, width: float) -> int:
    """Channel count after a width multiplier, never below one."""
    return max(1, int(channels * width))
