"""The model contract every strategy relies on: ``features`` then ``head``."""

from __future__ import annotations

import sys

from torch import Tensor, nn

from ..federation.errors import ConfigError


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

    # what a builder records on the model it returns (None: a model without that option)
    projection_dim: int | None = None  # MOON's projection head (:func:`~.projection.with_projection_head`)
    width_rate: float | None = None  # HeteroFL's width, the model a slice (:func:`~.slicing.mark_sliceable`)

    def __init__(self, features: nn.Module, head: nn.Module, feature_dim: int, num_classes: int):
        super().__init__()
        self.features = features
        self.head = head
        self.feature_dim = feature_dim
        self.num_classes = num_classes

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))


def is_lightning_module(model: object) -> bool:
    """Whether ``model`` is a Lightning ``LightningModule``, told without importing Lightning (seconds of
    start-up): code that made one has imported it already."""
    for package in ("lightning.pytorch", "pytorch_lightning"):
        module = sys.modules.get(package)
        if module is not None and isinstance(model, getattr(module, "LightningModule", ())):
            return True
    return False


class SplitFeatureClassifier(FeatureClassifier):
    """A classifier with a split point for split learning: the first ``split`` modules of ``features``
    produce what crosses the network (FedGKT's feature maps), the rest and the head finish the prediction.

    ``forward(x) == classify(extract(x)) == head(features(x))``; the extra methods slice ``features``
    (no module is registered twice, so the state dict has each parameter once).

    Args:
        features: the whole feature extractor (an ``nn.Sequential``) up to the pooled vector ``[B, D]``.
        head: maps ``[B, D]`` to logits ``[B, C]``.
        feature_dim: D.
        num_classes: C.
        split: how many modules of ``features`` run before the split point.
    """

    features: nn.Sequential  # sliced at the split point

    def __init__(self, features: nn.Sequential, head: nn.Module, feature_dim: int, num_classes: int, split: int):
        super().__init__(features, head, feature_dim, num_classes)
        self.split = split

    def extract(self, x: Tensor) -> Tensor:
        """What the client side computes and sends: the activations at the split point."""
        return self.features[: self.split](x)

    def classify(self, maps: Tensor) -> Tensor:
        """Logits from the split point's activations: the rest of ``features``, then ``head``."""
        return self.head(self.features[self.split :](maps))


def scaled(channels: int, width: float) -> int:
    """Channel count after a width multiplier, never below one."""
    # max(1, ...) alone would turn width -1 or hidden 0 into a one-unit layer: a silently wrong model
    if not isinstance(width, (int, float)) or isinstance(width, bool) or not width > 0:
        raise ConfigError(f"model width must be a positive number, got {width!r}; e.g. width: 0.25 for a quarter.")
    if not isinstance(channels, int) or channels < 1:
        raise ConfigError(f"model layer sizes must be at least 1, got {channels!r}; raise the builder's size argument.")
    return max(1, int(channels * width))
