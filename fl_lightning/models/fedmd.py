"""The ten CNNs of FedHe's Table II (FedMD's architectures, ``FedMD_clean/Neural_Networks.py``).

Models 0-4 have two conv layers (n1, n2), models 5-9 three (n1, n2, n3); Table II's "198" for model 9
is a typo for 192 (FIDELITY). Layout, from the reference Keras code:

- block 1: Conv(n1, 3x3, stride 1, same) -> BN -> ReLU -> Dropout -> AvgPool(2, stride 1, same)
- 3-layer: Conv(n2, 2x2, stride 2, valid) -> BN -> ReLU -> Dropout -> AvgPool(2, stride 2, valid)
           -> Conv(n3, 3x3, stride 2, valid) -> BN -> ReLU -> Dropout
- 2-layer: Conv(n2, 3x3, stride 2, valid) -> BN -> ReLU -> Dropout
- Flatten -> Dense(classes, no bias)

Model 9 has 306,496 trainable parameters on MNIST and 308,800 on CIFAR-10 (307,392 / 309,696 with
BatchNorm statistics, as Keras counts); the paper's 324,672 / 326,976 are 17,280 higher, one extra dense
matrix (docs/reference/datasets_and_models.md).
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .base import FeatureClassifier
from .registry import register_model

TABLE_II = {  # model: (n1, n2, n3 or None, dropout)
    0: (128, 256, None, 0.2),
    1: (128, 384, None, 0.2),
    2: (128, 512, None, 0.2),
    3: (256, 256, None, 0.3),
    4: (256, 512, None, 0.4),
    5: (64, 128, 256, 0.2),
    6: (64, 128, 192, 0.2),
    7: (128, 192, 256, 0.2),
    8: (128, 128, 128, 0.3),
    9: (128, 128, 192, 0.3),
}


class SameAvgPool2d(nn.Module):
    """Keras ``AveragePooling2D(2, strides=1, padding='same')``: pads right / bottom and averages only
    over the real (unpadded) values."""

    def forward(self, x: Tensor) -> Tensor:
        summed = F.avg_pool2d(F.pad(x, (0, 1, 0, 1)), 2, stride=1, divisor_override=1)
        ones = F.pad(x.new_ones(1, 1, *x.shape[2:]), (0, 1, 0, 1))
        return summed / F.avg_pool2d(ones, 2, stride=1, divisor_override=1)


def _block(in_ch: int, out_ch: int, kernel: int, stride: int, padding: int, dropout: float) -> list[nn.Module]:
    return [nn.Conv2d(in_ch, out_ch, kernel, stride, padding), nn.BatchNorm2d(out_ch), nn.ReLU(), nn.Dropout(dropout)]


def fedmd_cnn(
    n1: int, n2: int, n3: int | None, dropout: float, num_classes: int = 10, in_channels: int = 1, image_size: int = 28
) -> FeatureClassifier:
    """A FedMD CNN with 2 (``n3`` None) or 3 conv layers."""
    layers = _block(in_channels, n1, 3, 1, 1, dropout) + [SameAvgPool2d()]
    if n3 is None:
        layers += _block(n1, n2, 3, 2, 0, dropout)
        size, channels = (image_size - 3) // 2 + 1, n2
    else:
        layers += _block(n1, n2, 2, 2, 0, dropout) + [nn.AvgPool2d(2, 2)]
        layers += _block(n2, n3, 3, 2, 0, dropout)
        size, channels = ((image_size // 2) // 2 - 3) // 2 + 1, n3
    dim = channels * size * size
    layers.append(nn.Flatten())
    return FeatureClassifier(nn.Sequential(*layers), nn.Linear(dim, num_classes, bias=False), dim, num_classes)


def _register(index: int) -> None:
    n1, n2, n3, dropout = TABLE_II[index]

    def build(num_classes: int = 10, in_channels: int = 1, image_size: int = 28) -> FeatureClassifier:
        return fedmd_cnn(n1, n2, n3, dropout, num_classes, in_channels, image_size)

    build.__doc__ = (
        f"FedHe Table II model {index}: filters {n1}/{n2}" + (f"/{n3}" if n3 else "") + f", dropout {dropout}."
    )
    build.__name__ = f"fedhe_cnn{index}"
    register_model(f"fedhe_cnn{index}")(build)


for _index in TABLE_II:
    _register(_index)
