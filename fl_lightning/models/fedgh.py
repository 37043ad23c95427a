"""FedGH's CNN-1..5 (paper 004 Table 2; ``experiments/FLHetero/Models/CNNs.py``).

Conv(16, 5x5) -> ReLU -> MaxPool2 -> Conv(c2, 5x5) -> ReLU -> MaxPool2 -> fc1 -> ReLU -> fc2(500) -> ReLU is
the extractor; its 500-dimensional output is the representation and the header is Linear(500, C).
On CIFAR-10 they have 2,621,558 / 1,815,142 / 1,320,558 / 1,060,358 / 670,058 parameters (10.00 / 6.92 /
5.04 / 4.04 / 2.56 MiB; the paper prints 3.81 for CNN-4, docs/reference/datasets_and_models.md).
"""

from __future__ import annotations

from torch import nn

from .base import FeatureClassifier
from .registry import register_model

CONFIGS = {1: (32, 2000), 2: (16, 2000), 3: (32, 1000), 4: (32, 800), 5: (32, 500)}  # (c2, fc1)


def fedgh_cnn(
    c2: int, fc1: int, num_classes: int = 10, in_channels: int = 3, image_size: int = 32, representation: int = 500
) -> FeatureClassifier:
    size = ((image_size - 4) // 2 - 4) // 2
    features = nn.Sequential(
        nn.Conv2d(in_channels, 16, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, c2, 5),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * size * size, fc1),
        nn.ReLU(),
        nn.Linear(fc1, representation),
        nn.ReLU(),
    )
    return FeatureClassifier(features, nn.Linear(representation, num_classes), representation, num_classes)


def _register(index: int) -> None:
    c2, fc1 = CONFIGS[index]

    def build(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> FeatureClassifier:
        return fedgh_cnn(c2, fc1, num_classes, in_channels, image_size)

    build.__doc__ = f"FedGH CNN-{index}: second conv {c2} filters, fc1 {fc1}, 500-d representation."
    build.__name__ = f"fedgh_cnn{index}"
    register_model(f"fedgh_cnn{index}")(build)


for _index in CONFIGS:
    _register(_index)
