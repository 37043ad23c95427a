"""ResNet20 for 32x32 images, as in the official code of paper 001 (HeteroKDFL ``model.py``).

Stem: 3x3 conv with 16 filters that is never width-scaled; three stages of three basic blocks with
int(16r), int(32r), int(64r) filters; a 1x1 projection shortcut in the first block of every stage
(stage 1 included, even at r = 1); the last BN of each block starts at zero; global average pooling
then a dense head. Convs have no bias.

``rate`` is HeteroFL's width slice (``models/slicing.py``), which unlike ``width`` cuts every layer, the stem
included: the first ``ceil(rate * n)`` channels, each conv's output divided by the rate in training.
"""

from __future__ import annotations

from torch import Tensor, nn

from .base import FeatureClassifier, scaled
from .registry import register_model
from .slicing import add_scaler, mark_sliceable, sliced_width


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int, project: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        nn.init.zeros_(self.bn2.weight)  # residual branch starts as identity, as in the reference code
        self.shortcut = (
            nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride, bias=False), nn.BatchNorm2d(channels))
            if project
            else nn.Identity()
        )
        self.relu = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        return self.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


@register_model("resnet20")
def resnet20(num_classes: int = 10, in_channels: int = 3, width: float = 1.0, rate: float = 1.0) -> FeatureClassifier:
    """ResNet20 with width multiplier ``width`` (paper 001 uses 0.25 for the auxiliary model).

    Args:
        rate: HeteroFL's width rate: the first ``ceil(rate * n)`` channels of every layer (stem included)
            of the rate-1 model, whose convs divide their output by ``rate`` in training.
    """
    stem = sliced_width(16, rate)
    layers: list[nn.Module] = [nn.Conv2d(in_channels, stem, 3, 1, 1, bias=False), nn.BatchNorm2d(stem), nn.ReLU()]
    previous = stem
    for stage, base in enumerate((16, 32, 64)):
        channels = sliced_width(scaled(base, width), rate)
        for block in range(3):
            stride = 2 if stage > 0 and block == 0 else 1
            layers.append(BasicBlock(previous, channels, stride, project=block == 0))
            previous = channels
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
    body = nn.Sequential(*layers)
    for conv in [m for m in body.modules() if isinstance(m, nn.Conv2d)]:
        add_scaler(conv, rate)
    model = FeatureClassifier(body, nn.Linear(previous, num_classes), previous, num_classes)
    return mark_sliceable(model, rate)
