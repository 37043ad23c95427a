"""A projection head between a model's features and a new classifier (MOON's model, for any builder)."""

from __future__ import annotations

from torch import nn

from ..federation.errors import ConfigError
from .base import FeatureClassifier


def with_projection_head(model: FeatureClassifier, projection_dim: int) -> FeatureClassifier:
    """``model``'s feature extractor, then a projection head, then a new linear classifier on its output.

    The projection head is MOON's (Li et al. 2021, ``ModelFedCon`` of the official code):
    ``Linear(D, D), ReLU, Linear(D, projection_dim)``. Its output ``z`` is both what the classifier
    ``Linear(projection_dim, C)`` reads and the representation of the contrastive loss, so the
    result's ``features`` end with the projection and its ``feature_dim`` is ``projection_dim``.
    ``model``'s own head is dropped. The new layers draw their initial weights from torch's global
    generator right after the base model's, so a seeded build stays reproducible.

    Args:
        model: any :class:`FeatureClassifier`.
        projection_dim: the projection's output size (256 in MOON's code).

    Returns:
        A :class:`FeatureClassifier` whose ``projection_dim`` attribute records the head's size.
    """
    if not isinstance(projection_dim, int) or isinstance(projection_dim, bool) or projection_dim < 1:
        raise ConfigError(
            f"projection_dim must be a positive integer, got {projection_dim!r}; e.g. projection_dim: 256."
        )
    d = model.feature_dim
    features = nn.Sequential(model.features, nn.Linear(d, d), nn.ReLU(), nn.Linear(d, projection_dim))
    projected = FeatureClassifier(
        features, nn.Linear(projection_dim, model.num_classes), projection_dim, model.num_classes
    )
    projected.projection_dim = projection_dim
    return projected
