"""Small models for the bundled 8x8 digits set (and other tiny inputs) with width multipliers."""

from __future__ import annotations

from torch import nn

from ..errors import ConfigError
from .base import FeatureClassifier, scaled
from .registry import register_model


@register_model("digits_mlp")
def digits_mlp(
    num_classes: int = 10, in_features: int = 64, hidden: int = 128, width: float = 1.0, depth: int = 1
) -> FeatureClassifier:
    """An MLP on flattened inputs: ``depth`` hidden ReLU layers of ``hidden * width`` units."""
    if not isinstance(depth, int) or depth < 1:
        raise ConfigError(f"digits_mlp depth must be at least 1 (hidden layers), got {depth!r}.")
    dim = scaled(hidden, width)
    layers: list[nn.Module] = [nn.Flatten()]
    previous = in_features
    for _ in range(depth):
        layers += [nn.Linear(previous, dim), nn.ReLU()]
        previous = dim
    return FeatureClassifier(nn.Sequential(*layers), nn.Linear(dim, num_classes), dim, num_classes)


@register_model("digits_cnn")
def digits_cnn(
    num_classes: int = 10, in_channels: int = 1, channels: int = 32, hidden: int = 64, width: float = 1.0
) -> FeatureClassifier:
    """A two-conv CNN for 8x8 images: conv-relu-conv-relu-pool(2) then a dense feature layer.

    Args:
        channels: filters of the second conv at width 1 (the first has half).
        hidden: size of the feature vector at width 1.
        width: multiplier on every layer, for weak / strong tiers.
    """
    c1, c2, dim = scaled(channels // 2, width), scaled(channels, width), scaled(hidden, width)
    features = nn.Sequential(
        nn.Conv2d(in_channels, c1, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(c1, c2, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        nn.Linear(c2 * 16, dim),
        nn.ReLU(),
    )
    return FeatureClassifier(features, nn.Linear(dim, num_classes), dim, num_classes)
