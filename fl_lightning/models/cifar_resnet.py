"""CIFAR ResNets of paper 003 (Felo / Velo): torchvision's ResNet blocks with a 3x3 stride-1 stem.

The paper uses "ResNet10, 14, 18, 22 and 26 from the PyTorch source codes" (and 34, 50 for the extreme
setting). torchvision defines 18 [2,2,2,2], 34 [3,4,6,3] and 50 (bottleneck [3,4,6,3]); the official
code's comments give 22 [2,3,3,2] and 26 [3,3,3,3]; ResNet10 and 14 are defined nowhere, so we take
[1,1,1,1] and [1,2,2,1] (docs/benchmarks.md). For 32x32 inputs the stem is Conv3x3(64, stride 1) with no
max-pool. Felo compares features across architectures, so ``feature_dim`` adds a Linear + ReLU projection
of the pooled vector (512, or 2048 for ResNet50) to a common size.
"""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet

from .base import FeatureClassifier
from .registry import register_model

DEPTHS = {
    10: (BasicBlock, [1, 1, 1, 1]),
    14: (BasicBlock, [1, 2, 2, 1]),
    18: (BasicBlock, [2, 2, 2, 2]),
    22: (BasicBlock, [2, 3, 3, 2]),
    26: (BasicBlock, [3, 3, 3, 3]),
    34: (BasicBlock, [3, 4, 6, 3]),
    50: (Bottleneck, [3, 4, 6, 3]),
}


def cifar_resnet(
    depth: int, num_classes: int = 10, in_channels: int = 3, feature_dim: int | None = None
) -> FeatureClassifier:
    block, layers = DEPTHS[depth]
    net = ResNet(block, layers, num_classes=num_classes)
    net.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
    net.maxpool = nn.Identity()
    pooled = 512 * block.expansion
    body = [net.conv1, net.bn1, net.relu, net.layer1, net.layer2, net.layer3, net.layer4, net.avgpool, nn.Flatten()]
    dim = pooled
    if feature_dim is not None:
        body += [nn.Linear(pooled, feature_dim), nn.ReLU()]
        dim = feature_dim
    return FeatureClassifier(nn.Sequential(*body), nn.Linear(dim, num_classes), dim, num_classes)


def _register(depth: int) -> None:
    def build(num_classes: int = 10, in_channels: int = 3, feature_dim: int | None = None) -> FeatureClassifier:
        return cifar_resnet(depth, num_classes, in_channels, feature_dim)

    block, layers = DEPTHS[depth]
    build.__doc__ = f"CIFAR ResNet{depth} ({block.__name__} x {layers}, 3x3 stem), paper 003."
    build.__name__ = f"cifar_resnet{depth}"
    register_model(f"cifar_resnet{depth}")(build)


for _depth in DEPTHS:
    _register(_depth)
