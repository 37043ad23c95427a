"""HtFLlib's heterogeneous feature extractors, unified as HtFLlib unifies them (``system/flcore/trainmodel``).

HtFLlib (the benchmark of heterogeneous-model FL) builds each client's network from a torchvision
architecture, its own FedAvg CNN, its shallow ResNets or its copy of torchvision's MobileNetV2, all without
pre-trained weights, then replaces the network's classifier by a parameter-free ``AdaptiveAvgPool1d(
feature_dim)``: whatever the width of the pooled vector (64 for ResNet4, 1,024 for GoogLeNet, 1,280 for
MobileNetV2, 2,048 for ResNet50), every extractor emits ``feature_dim`` numbers (512), averaged over
neighbouring units or repeated. The head is ``Linear(feature_dim, C)``, for the ViTs
``Linear(feature_dim, 768) - Tanh - Linear(768, C)``. The model groups (HtFE2 ... HtM10) and the
assignment of client i to architecture ``i mod n`` are recipes: ``recipes/_base/htfl_*.yaml``.

``head_hidden`` gives the HtFE8-HtC4 group's heterogeneous heads: ``[]``, ``[512]``, ``[256]``, ``[128]``
hidden units between the features and the classes, each followed by a ReLU (HtFLlib also puts a ReLU on
the logits, which is not copied: docs/reference/datasets_and_models.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn
from torchvision import models as tv
from torchvision.models.resnet import BasicBlock

from ..federation.errors import ConfigError
from .base import FeatureClassifier
from .cifar_resnet import init_resnet, resnet_stage
from .registry import register_model

VIT_WIDTH = 768  # the hidden size of ViT-B, which HtFLlib's ViT head maps the features back to


def unified(body: nn.Module, classifier: str, num_classes: int, feature_dim: int, head: nn.Module) -> FeatureClassifier:
    """``body`` with its classifier (the submodule at the dotted path ``classifier``) replaced by
    ``AdaptiveAvgPool1d(feature_dim)``, then ``head``."""
    parent, _, attr = classifier.rpartition(".")
    setattr(body.get_submodule(parent), attr, nn.AdaptiveAvgPool1d(feature_dim))
    return FeatureClassifier(body, head, feature_dim, num_classes)


def check_feature_dim(feature_dim: int) -> None:
    if not isinstance(feature_dim, int) or isinstance(feature_dim, bool) or feature_dim < 1:
        raise ConfigError(f"feature_dim must be a positive whole number, got {feature_dim!r}; HtFLlib uses 512.")


def linear_head(feature_dim: int, num_classes: int, hidden: Sequence[int] = ()) -> nn.Module:
    """``Linear(feature_dim, C)``, or hidden layers (each then a ReLU) before it (HtFLlib's ``Head``)."""
    sizes = [feature_dim, *hidden]
    if any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes[1:]):
        raise ConfigError(f"head_hidden must list positive layer sizes, got {list(hidden)!r}; e.g. [256].")
    if not hidden:
        return nn.Linear(feature_dim, num_classes)
    layers: list[nn.Module] = []
    for n_in, n_out in zip(sizes, sizes[1:]):
        layers += [nn.Linear(n_in, n_out), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(sizes[-1], num_classes))


class FedAvgCNN(nn.Module):
    """HtFLlib's ``FedAvgCNN``: two 5x5 convolutions (32, 64 filters), each ReLU then 2x2 max-pool, a
    512-unit ReLU layer, and ``fc`` the classifier (replaced by the pooling)."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int):
        super().__init__()
        size = ((image_size - 4) // 2 - 4) // 2  # 5 for 32x32 images: HtFLlib's dim = 64 x 5 x 5 = 1600
        if size < 1:
            raise ConfigError(f"htfl_cnn needs images of at least 14 pixels a side, got image_size={image_size}.")
        self.conv1 = nn.Sequential(nn.Conv2d(in_channels, 32, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.conv2 = nn.Sequential(nn.Conv2d(32, 64, 5), nn.ReLU(), nn.MaxPool2d(2))
        self.fc1 = nn.Sequential(nn.Flatten(), nn.Linear(64 * size * size, 512), nn.ReLU())
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        return self.fc(self.fc1(self.conv2(self.conv1(x))))


class ShallowResNet(nn.Module):
    """HtFLlib's ResNet4 / 6 / 8 / 10: torchvision's 7x7 stride-2 stem and 3x3 max-pool, then one basic block
    per stage for the first 1-4 of the stages of 64, 128, 256 and 512 channels, global average pooling and
    ``fc`` (replaced by the pooling)."""

    def __init__(self, stages: int, in_channels: int, num_classes: int):
        super().__init__()
        widths = (64, 128, 256, 512)[:stages]
        layers: list[nn.Module] = [
            nn.Conv2d(in_channels, 64, 7, 2, 3, bias=False),
            nn.BatchNorm2d(64),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(3, 2, 1),
        ]
        inplanes = 64
        for i, planes in enumerate(widths):
            layers.append(resnet_stage(BasicBlock, inplanes, planes, 1, 1 if i == 0 else 2))
            inplanes = planes
        self.body = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.fc = nn.Linear(inplanes, num_classes)
        init_resnet(self)

    def forward(self, x):
        return self.fc(self.body(x))


def _cnn(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
    return FedAvgCNN(in_channels, image_size, num_classes)


def _torchvision(name: str, **extra) -> Callable[[int, int, int], nn.Module]:
    def build(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
        if in_channels != 3:
            raise ConfigError(f"htfl_{name} takes RGB images (in_channels 3), got in_channels={in_channels}.")
        return getattr(tv, name)(weights=None, num_classes=num_classes, **extra)

    return build


def _shallow(stages: int) -> Callable[[int, int, int], nn.Module]:
    def build(num_classes: int, in_channels: int, image_size: int) -> nn.Module:
        return ShallowResNet(stages, in_channels, num_classes)

    return build


# name -> (network builder, the attribute holding its classifier, the original pooled width, docstring)
EXTRACTORS: dict[str, tuple[Callable[[int, int, int], nn.Module], str, int, str]] = {
    "cnn": (_cnn, "fc", 512, "HtFLlib's FedAvgCNN(dim=1600): two 5x5 convolutions and a 512-unit layer"),
    "googlenet": (
        _torchvision("googlenet", aux_logits=False, init_weights=True),
        "fc",
        1024,
        "torchvision's GoogLeNet without auxiliary classifiers (its dropout kept before the pooling)",
    ),
    "mobilenet_v2": (
        _torchvision("mobilenet_v2"),
        "classifier.1",  # Sequential(Dropout(0.2), Linear): the dropout stays before the pooling, as in HtFLlib
        1280,
        "torchvision's MobileNetV2 (its dropout kept before the pooling)",
    ),
    **{
        f"resnet{2 + 2 * stages}": (
            _shallow(stages),
            "fc",
            (64, 128, 256, 512)[stages - 1],
            f"HtFLlib's ResNet{2 + 2 * stages}: torchvision's stem and one basic block in each of {stages} stage(s)",
        )
        for stages in (1, 2, 3, 4)
    },
    **{
        f"resnet{depth}": (
            _torchvision(f"resnet{depth}"),
            "fc",
            512 if depth < 50 else 2048,
            f"torchvision's ResNet{depth}",
        )
        for depth in (18, 34, 50, 101, 152)
    },
}
VITS = {"vit_b16": "vit_b_16", "vit_b32": "vit_b_32"}


def htfl_extractor(
    name: str,
    num_classes: int = 10,
    in_channels: int = 3,
    image_size: int = 32,
    feature_dim: int = 512,
    head_hidden: Sequence[int] = (),
) -> FeatureClassifier:
    """The HtFLlib architecture ``name`` (a key of :data:`EXTRACTORS`) with its classifier replaced by the pooling
    to ``feature_dim`` and a head on top."""
    check_feature_dim(feature_dim)
    build, classifier, _, _ = EXTRACTORS[name]
    body = build(num_classes, in_channels, image_size)
    return unified(body, classifier, num_classes, feature_dim, linear_head(feature_dim, num_classes, head_hidden))


def htfl_vit(name: str, num_classes: int = 10, image_size: int = 32, feature_dim: int = 512) -> FeatureClassifier:
    """torchvision's ViT ``name`` at ``image_size`` (HtFLlib's HtM10 gives it 32x32 images), its ``heads`` replaced
    by the pooling, and HtFLlib's ViT head ``Linear(feature_dim, 768) - Tanh - Linear(768, C)``."""
    check_feature_dim(feature_dim)
    body = getattr(tv, VITS[name])(weights=None, image_size=image_size, num_classes=num_classes)
    head = nn.Sequential(nn.Linear(feature_dim, VIT_WIDTH), nn.Tanh(), nn.Linear(VIT_WIDTH, num_classes))
    return unified(body, "heads", num_classes, feature_dim, head)


def _register(name: str) -> None:
    def build(
        num_classes: int = 10,
        in_channels: int = 3,
        image_size: int = 32,
        feature_dim: int = 512,
        head_hidden: list[int] | None = None,
    ) -> FeatureClassifier:
        return htfl_extractor(name, num_classes, in_channels, image_size, feature_dim, head_hidden or ())

    pooled = EXTRACTORS[name][2]
    build.__doc__ = f"{EXTRACTORS[name][3]}; its {pooled} pooled units averaged to feature_dim (HtFLlib)."
    build.__name__ = f"htfl_{name}"
    register_model(f"htfl_{name}")(build)


def _register_vit(name: str) -> None:
    def build(num_classes: int = 10, image_size: int = 32, feature_dim: int = 512) -> FeatureClassifier:
        return htfl_vit(name, num_classes, image_size, feature_dim)

    patch = name.removeprefix("vit_b")
    build.__doc__ = f"torchvision's ViT-B/{patch}, 768 units averaged to feature_dim, HtFLlib's Tanh head (HtM10)."
    build.__name__ = f"htfl_{name}"
    register_model(f"htfl_{name}")(build)


for _name in EXTRACTORS:
    _register(_name)
for _name in VITS:
    _register_vit(_name)
