"""Small models for the bundled 8x8 digits set (and other tiny inputs) with width multipliers."""

from __future__ import annotations

from torch import nn

from ..federation.errors import ConfigError
from .base import FeatureClassifier, scaled
from .registry import register_model
from .slicing import add_scaler, mark_sliceable, sliced_width


@register_model("digits_mlp")
def digits_mlp(
    num_classes: int = 10,
    in_features: int = 64,
    hidden: int = 128,
    width: float = 1.0,
    depth: int = 1,
    rate: float = 1.0,
) -> FeatureClassifier:
    """An MLP on flattened inputs: ``depth`` hidden ReLU layers of ``hidden * width`` units.

    Args:
        rate: HeteroFL's width rate: the first ``ceil(rate * units)`` units of every hidden layer of the
            rate-1 model, whose outputs are divided by ``rate`` in training (``models/slicing.py``).
    """
    if not isinstance(depth, int) or depth < 1:
        raise ConfigError(f"digits_mlp depth must be at least 1 (hidden layers), got {depth!r}.")
    dim = sliced_width(scaled(hidden, width), rate)
    layers: list[nn.Module] = [nn.Flatten()]
    previous = in_features
    for _ in range(depth):
        layers += [nn.Linear(previous, dim), nn.ReLU()]
        add_scaler(layers[-2], rate)
        previous = dim
    model = FeatureClassifier(nn.Sequential(*layers), nn.Linear(dim, num_classes), dim, num_classes)
    return mark_sliceable(model, rate)


@register_model("digits_cnn")
def digits_cnn(
    num_classes: int = 10,
    in_channels: int = 1,
    channels: int = 32,
    hidden: int = 64,
    width: float = 1.0,
    rate: float = 1.0,
    batch_norm: bool = False,
) -> FeatureClassifier:
    """A two-conv CNN for 8x8 images: conv-relu-conv-relu-pool(2) then a dense feature layer.

    Args:
        channels: filters of the second conv at width 1 (the first has half).
        hidden: size of the feature vector at width 1.
        width: multiplier on every layer, for weak / strong tiers.
        rate: HeteroFL's width rate: the first ``ceil(rate * units)`` channels / units of every layer of
            the rate-1 model, whose outputs are divided by ``rate`` in training (``models/slicing.py``).
        batch_norm: a batch norm after each conv (HeteroFL's conv model; its statistics are the
            strategy's business, e.g. HeteroFL's static batch norm).
    """
    if not isinstance(batch_norm, bool):
        raise ConfigError(f"digits_cnn batch_norm must be true or false, got {batch_norm!r}.")
    c1, c2 = sliced_width(scaled(channels // 2, width), rate), sliced_width(scaled(channels, width), rate)
    dim = sliced_width(scaled(hidden, width), rate)
    conv1, conv2 = nn.Conv2d(in_channels, c1, 3, padding=1), nn.Conv2d(c1, c2, 3, padding=1)
    dense = nn.Linear(c2 * 16, dim)
    for layer in (conv1, conv2, dense):
        add_scaler(layer, rate)
    norm1, norm2 = ([nn.BatchNorm2d(c1)], [nn.BatchNorm2d(c2)]) if batch_norm else ([], [])
    features = nn.Sequential(
        conv1,
        *norm1,
        nn.ReLU(),
        conv2,
        *norm2,
        nn.ReLU(),
        nn.MaxPool2d(2),  # 8x8 -> 4x4
        nn.Flatten(),
        dense,
        nn.ReLU(),
    )
    model = FeatureClassifier(features, nn.Linear(dim, num_classes), dim, num_classes)
    return mark_sliceable(model, rate)
