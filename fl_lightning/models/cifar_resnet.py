"""CIFAR ResNets of paper 003 (Felo / Velo): torchvision's ResNet blocks with a 3x3 stride-1 stem.

The paper uses "ResNet10, 14, 18, 22 and 26 from the PyTorch source codes" (and 34, 50 for the extreme
setting). torchvision defines 18 [2,2,2,2], 34 [3,4,6,3] and 50 (bottleneck [3,4,6,3]); the official
code's comments give 22 [2,3,3,2] and 26 [3,3,3,3]; ResNet10 and 14 are defined nowhere, so we take
[1,1,1,1] and [1,2,2,1] (docs/reference/datasets_and_models.md). For 32x32 inputs the stem is Conv3x3(64,
stride 1) with no max-pool. Felo compares features across architectures, so ``feature_dim`` adds a Linear +
ReLU projection
of the pooled vector (512, or 2048 for ResNet50) to a common size.

HeteroFL (paper 003 slices ResNet26) needs ``rate``: the rate-r network keeps the first ``ceil(r * n)``
channels of every layer (stem 64, stages 64 / 128 / 256 / 512, the projection's units), so its parameters
are the leading blocks of the rate-1 network's, under the same names (``models/slicing.py``); every conv
(and the projection) divides its output by r in training, HeteroFL's scaler. Rate 1 is the unchanged
network above.
"""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import BasicBlock, Bottleneck, ResNet, conv1x1

from .base import FeatureClassifier
from .registry import register_model
from .slicing import add_scaler, mark_sliceable, sliced_width

Block = type[BasicBlock] | type[Bottleneck]

DEPTHS: dict[int, tuple[Block, list[int]]] = {
    10: (BasicBlock, [1, 1, 1, 1]),
    14: (BasicBlock, [1, 2, 2, 1]),
    18: (BasicBlock, [2, 2, 2, 2]),
    22: (BasicBlock, [2, 3, 3, 2]),
    26: (BasicBlock, [3, 3, 3, 3]),
    34: (BasicBlock, [3, 4, 6, 3]),
    50: (Bottleneck, [3, 4, 6, 3]),
}


def resnet_stage(block: Block, inplanes: int, planes: int, blocks: int, stride: int) -> nn.Sequential:
    """One stage of ``blocks`` torchvision blocks, as ``ResNet._make_layer`` builds it (same module names):
    a 1x1 conv + batch-norm projection on the first block's shortcut when the shape changes."""
    downsample = None
    if stride != 1 or inplanes != planes * block.expansion:
        downsample = nn.Sequential(
            conv1x1(inplanes, planes * block.expansion, stride), nn.BatchNorm2d(planes * block.expansion)
        )
    layers = [block(inplanes, planes, stride, downsample)]
    layers += [block(planes * block.expansion, planes) for _ in range(1, blocks)]
    return nn.Sequential(*layers)


def init_resnet(module: nn.Module) -> None:
    """torchvision's ResNet initialisation: Kaiming-normal (fan out) convs, batch norms at weight 1, bias 0."""
    for m in module.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.BatchNorm2d):
            nn.init.constant_(m.weight, 1)
            nn.init.constant_(m.bias, 0)


def _sliced_body(block: Block, layers: list[int], in_channels: int, rate: float) -> list[nn.Module]:
    """The rate-``rate`` slice of the rate-1 body (stem and four stages), every conv with the scaler."""
    widths = [sliced_width(w, rate) for w in (64, 128, 256, 512)]
    stem = nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)
    stages, inplanes = [], widths[0]
    for planes, blocks, stride in zip(widths, layers, (1, 2, 2, 2)):
        stages.append(resnet_stage(block, inplanes, planes, blocks, stride))
        inplanes = planes * block.expansion
    body = [stem, nn.BatchNorm2d(widths[0]), nn.ReLU(inplace=True), *stages, nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten()]
    for module in body:
        init_resnet(module)
        for conv in [m for m in module.modules() if isinstance(m, nn.Conv2d)]:
            add_scaler(conv, rate)
    return body


def cifar_resnet(
    depth: int, num_classes: int = 10, in_channels: int = 3, feature_dim: int | None = None, rate: float = 1.0
) -> FeatureClassifier:
    block, layers = DEPTHS[depth]
    sliced_width(1, rate)  # refuses a rate outside (0, 1] in one sentence
    if rate == 1:  # torchvision's network, as before slicing existed (same parameters, same initial draws)
        net = ResNet(block, layers, num_classes=num_classes)
        net.conv1 = nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False)
        net.maxpool = nn.Identity()
        body = [net.conv1, net.bn1, net.relu, net.layer1, net.layer2, net.layer3, net.layer4, net.avgpool, nn.Flatten()]
    else:
        body = _sliced_body(block, layers, in_channels, rate)
    pooled = sliced_width(512, rate) * block.expansion
    dim = pooled
    if feature_dim is not None:
        dim = sliced_width(feature_dim, rate)
        body += [nn.Linear(pooled, dim), nn.ReLU()]
        add_scaler(body[-2], rate)
    model = FeatureClassifier(nn.Sequential(*body), nn.Linear(dim, num_classes), dim, num_classes)
    return mark_sliceable(model, rate)


def _register(depth: int) -> None:
    def build(
        num_classes: int = 10, in_channels: int = 3, feature_dim: int | None = None, rate: float = 1.0
    ) -> FeatureClassifier:
        return cifar_resnet(depth, num_classes, in_channels, feature_dim, rate)

    block, layers = DEPTHS[depth]
    build.__doc__ = (
        f"CIFAR ResNet{depth} ({block.__name__} x {layers}, 3x3 stem), paper 003; ``rate``: HeteroFL's slice."
    )
    build.__name__ = f"cifar_resnet{depth}"
    register_model(f"cifar_resnet{depth}")(build)


for _depth in DEPTHS:
    _register(_depth)
