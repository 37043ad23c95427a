"""FedGKT's split models (He et al., NeurIPS 2020): a small client CNN whose feature maps a large server CNN
continues from, as FedML's ``fedgkt`` code builds them for CIFAR (``resnet_gkt/resnet.py``: ``resnet8_56``
on the client, ``resnet56_server`` / ``resnet110_server`` on the server).

- **Client, ResNet-8:** a 3x3 stem (16 channels, batch norm, ReLU) whose output ``[B, 16, 32, 32]`` is what
  the client uploads, then its own classifier: two torchvision bottleneck blocks of 16 planes (64 channels
  out), global average pooling and a dense layer (1 + 6 convs + 1 dense = 8 layers).
- **Server, ResNet-(9n + 2):** three stages of ``n`` bottleneck blocks (16, 32, 64 planes; 64, 128, 256
  channels out; strides 1, 2, 2) on the clients' 16-channel maps, pooling and a dense layer. FedML's
  ResNet-56 server has n = 6, its ResNet-110 n = 12 (the client's stem counts as the first layer).

Convs start Kaiming-normal (fan out), batch norms at weight 1 and bias 0, as FedML's (and torchvision's)
initialisation. The client is a :class:`SplitFeatureClassifier`: its ``features`` / ``head`` keep the model
contract (the pooled 64-d vector, then the dense layer) and ``extract`` / ``classify`` cut it after the stem.
"""

from __future__ import annotations

from torch import nn
from torchvision.models.resnet import Bottleneck

from ..federation.errors import ConfigError
from .base import FeatureClassifier, SplitFeatureClassifier
from .cifar_resnet import init_resnet, resnet_stage
from .registry import register_model


@register_model("fedgkt_client_resnet8")
def fedgkt_client_resnet8(num_classes: int = 10, in_channels: int = 3) -> SplitFeatureClassifier:
    """FedGKT's client ResNet-8 (FedML resnet8_56), split after its stem: it uploads 16-channel feature maps."""
    stem = [nn.Conv2d(in_channels, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(inplace=True)]
    rest = [resnet_stage(Bottleneck, 16, 16, 2, stride=1), nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten()]
    features = nn.Sequential(*stem, *rest)
    init_resnet(features)
    dim = 16 * Bottleneck.expansion
    return SplitFeatureClassifier(features, nn.Linear(dim, num_classes), dim, num_classes, split=len(stem))


@register_model("fedgkt_server_resnet")
def fedgkt_server_resnet(num_classes: int = 10, feature_channels: int = 16, depth: int = 56) -> FeatureClassifier:
    """FedGKT's server ResNet-56 / 110 (FedML resnet56_server): bottleneck stages on the clients' feature maps.

    Args:
        feature_channels: channels of the clients' feature maps (16 for :func:`fedgkt_client_resnet8`); not
            ``in_channels``, which a run fills with the data's image channels.
        depth: 9n + 2 layers counted as FedML names them (n bottleneck blocks per stage): 56 (n = 6) and
            110 (n = 12) are FedML's; 20 (n = 2) is a smaller server of the same shape.
    """
    if not isinstance(depth, int) or isinstance(depth, bool) or depth < 11 or (depth - 2) % 9:
        raise ConfigError(
            f"fedgkt_server_resnet depth must be 9n + 2 for n >= 1 bottleneck blocks per stage (e.g. 56 or 110, "
            f"FedML's servers), got {depth!r}."
        )
    blocks = (depth - 2) // 9
    stages, inplanes = [], feature_channels
    for planes, stride in ((16, 1), (32, 2), (64, 2)):
        stages.append(resnet_stage(Bottleneck, inplanes, planes, blocks, stride))
        inplanes = planes * Bottleneck.expansion
    features = nn.Sequential(*stages, nn.AdaptiveAvgPool2d((1, 1)), nn.Flatten())
    init_resnet(features)
    return FeatureClassifier(features, nn.Linear(inplanes, num_classes), inplanes, num_classes)
