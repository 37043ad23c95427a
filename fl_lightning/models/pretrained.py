"""Paper 001's CIFAR-100 fine-tuning models: a frozen ViT-B/16 with two trainable output layers, and a
torchvision ResNet50 auxiliary (about 29% of the ViT's size). Pretrained weights come from a local
directory or the Hugging Face / torch hub caches; when they are absent the builder says where to put them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .base import FeatureClassifier
from .registry import register_model


class ViTFeatures(nn.Module):
    """Frozen ViT backbone -> [CLS] embedding -> trainable Linear + ReLU (the first of two output layers)."""

    def __init__(self, backbone: nn.Module, hidden: int, image_size: int):
        super().__init__()
        self.backbone = backbone.requires_grad_(False)
        self.image_size = image_size
        self.project = nn.Sequential(nn.Linear(backbone.config.hidden_size, hidden), nn.ReLU())

    def forward(self, x: Tensor) -> Tensor:
        if x.shape[-1] != self.image_size:  # CIFAR's 32x32 up to the backbone's resolution
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", align_corners=False)
        with torch.no_grad():
            cls = self.backbone(pixel_values=x).last_hidden_state[:, 0]
        return self.project(cls)

    def train(self, mode: bool = True):
        super().train(mode)
        self.backbone.eval()  # frozen: dropout off, whatever the mode
        return self


@register_model("vit_b16")
def vit_b16(
    num_classes: int = 100,
    pretrained: str = "google/vit-base-patch16-224-in21k",
    hidden: int = 512,
    random_init: bool = False,
    config: dict | None = None,
) -> FeatureClassifier:
    """ViT-B/16 with a frozen backbone and two trainable output layers (paper 001, CIFAR-100 fine-tuning).

    Args:
        pretrained: a local directory with ``config.json`` and weights, or a hub id already in the cache.
        hidden: width of the first trainable output layer.
        random_init: build from ``config`` without weights (tests, timing); never for results.
        config: ``ViTConfig`` overrides, e.g. a tiny ``{hidden_size: 32, num_hidden_layers: 2, ...}``.
    """
    from transformers import ViTConfig, ViTModel

    if random_init:
        vit_config = ViTConfig(**(config or {}))
        backbone = ViTModel(vit_config, add_pooling_layer=False)
    else:
        try:  # the local directory or cache first, so an offline machine fails at once instead of retrying
            backbone = ViTModel.from_pretrained(
                pretrained, add_pooling_layer=False, local_files_only=True, **(config or {})
            )
        except OSError:
            backbone = None
        if backbone is None and os.environ.get("HF_HUB_OFFLINE") != "1":
            try:
                backbone = ViTModel.from_pretrained(pretrained, add_pooling_layer=False, **(config or {}))
            except OSError:
                backbone = None
        if backbone is None:
            raise ConfigError(
                f"pretrained ViT weights {pretrained!r} are not available offline; download them once with "
                f"`huggingface-cli download {pretrained}` (or copy the model directory here and set "
                "models.<role>.args.pretrained to its path)."
            ) from None
    features = ViTFeatures(backbone, hidden, backbone.config.image_size)
    return FeatureClassifier(features, nn.Linear(hidden, num_classes), hidden, num_classes)


@register_model("torchvision_resnet50")
def torchvision_resnet50(num_classes: int = 100, weights_path: str | None = None) -> FeatureClassifier:
    """torchvision's ResNet50 (paper 001's CIFAR-100 auxiliary); ``weights_path``: a local ``.pth`` state dict."""
    from torchvision.models import resnet50

    net = resnet50()
    if weights_path is not None:
        if not Path(weights_path).is_file():
            raise ConfigError(
                f"ResNet50 weights {weights_path!r} not found; download torchvision's "
                "ResNet50_Weights.IMAGENET1K_V2 .pth file and give its path."
            )
        net.load_state_dict(torch.load(weights_path, map_location="cpu"))
    dim = net.fc.in_features
    net.fc = nn.Identity()
    return FeatureClassifier(net, nn.Linear(dim, num_classes), dim, num_classes)
