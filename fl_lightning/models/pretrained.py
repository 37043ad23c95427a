"""Paper 001's CIFAR-100 fine-tuning models: a frozen ViT-B/16 with two trainable output layers, and a
torchvision ResNet50 auxiliary (about 29% of the ViT's size). The ViT's weights are pinned to one Hub
commit and read as safetensors (never pickles) from a local directory, ``<pretrained_dir>`` (where
``flrun data fetch vit_b16`` puts them, checksummed) or the Hugging Face cache; when they are absent, a run
fetches and verifies them once (the ``fetch_weights`` it hands the builder), or says in one sentence where
they go.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..federation.errors import ConfigError
from ..federation.pins import VIT_ID, VIT_REVISION
from .base import FeatureClassifier
from .registry import register_model

if TYPE_CHECKING:  # transformers takes seconds to import: only the builder does, when it runs
    from transformers import ViTModel


class ViTFeatures(nn.Module):
    """Frozen ViT backbone -> [CLS] embedding -> trainable Linear + ReLU (the first of two output layers)."""

    def __init__(self, backbone: ViTModel, hidden: int, image_size: int):
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
    pretrained: str = VIT_ID,
    revision: str = VIT_REVISION,
    pretrained_dir: str = "data",
    hidden: int = 512,
    random_init: bool = False,
    config: dict | None = None,
    fetch_weights: Callable[[str, Path], None] | None = None,
) -> FeatureClassifier:
    """ViT-B/16 with a frozen backbone and two trainable output layers (paper 001, CIFAR-100 fine-tuning).

    Args:
        pretrained: a local directory with ``config.json`` and ``model.safetensors``, or a Hub model id.
        revision: the Hub commit of ``pretrained`` (pinned; the default is the commit whose files
            ``flrun data fetch vit_b16`` checks).
        pretrained_dir: the data directory holding ``pretrained/<org>--<name>/`` (``flrun data fetch vit_b16
            --data_dir <pretrained_dir>``).
        hidden: width of the first trainable output layer.
        random_init: build from ``config`` without weights (tests, timing); never for results.
        config: ``ViTConfig`` overrides, e.g. a tiny ``{hidden_size: 32, num_hidden_layers: 2, ...}``.
        fetch_weights: given by the run, not by a recipe: ``fetch_weights("vit_b16", data_dir)`` downloads and
            verifies the pinned weights when they are absent, or raises the one sentence saying where they go.
    """
    from transformers import ViTConfig, ViTModel

    if random_init:
        backbone = ViTModel(ViTConfig(**(config or {})), add_pooling_layer=False)
    else:
        folder = _vit_weights(pretrained, revision, Path(pretrained_dir), fetch_weights)
        try:
            backbone = ViTModel.from_pretrained(
                folder,
                add_pooling_layer=False,
                local_files_only=True,  # found locally above: no Hub calls, no retries
                use_safetensors=True,  # weights only, never a pickle that could run code
                **(config or {}),
            )
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"the ViT in {folder} cannot be loaded ({err}); it needs config.json and model.safetensors."
            ) from None
    image_size = backbone.config.image_size
    if not isinstance(image_size, int):
        raise ConfigError(
            f"the ViT's image_size is {image_size}; give one number (square images), e.g. image_size: 224."
        )
    features = ViTFeatures(backbone, hidden, image_size)
    return FeatureClassifier(features, nn.Linear(hidden, num_classes), hidden, num_classes)


def _hub_cache(repo_id: str, revision: str) -> str | None:
    """The Hugging Face cache's snapshot folder of ``repo_id`` at ``revision``, or None (no network)."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return snapshot_download(repo_id, revision=revision, local_files_only=True)
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def _vit_weights(
    pretrained: str, revision: str, data_dir: Path, fetch_weights: Callable[[str, Path], None] | None
) -> str:
    """A local folder with the ViT's config and safetensors: the given one, the fetched one, or the Hub
    cache's snapshot of ``revision``; fetched (and verified) once by ``fetch_weights`` when absent."""
    if Path(pretrained).is_dir():
        return pretrained
    folder = data_dir / "pretrained" / pretrained.replace("/", "--")
    known = pretrained == VIT_ID and revision == VIT_REVISION
    if known and (folder / "model.safetensors").is_file():
        return str(folder)
    cached = _hub_cache(pretrained, revision)
    if cached is not None:
        return cached
    if known and fetch_weights is not None:
        fetch_weights("vit_b16", data_dir)
        return str(folder)
    if known:
        raise ConfigError(
            f"ViT-B/16 weights not found: expected {folder / 'model.safetensors'}; run `flrun data fetch vit_b16 "
            f"--data_dir {data_dir}` on a machine with internet and copy {data_dir} to this machine."
        )
    raise ConfigError(
        f"pretrained ViT weights {pretrained!r} at revision {revision} are not available offline; put its "
        "config.json and model.safetensors in a folder and set models.<role>.args.pretrained to it, or run "
        f"`hf download {pretrained} --revision {revision}` on a machine with internet."
    )


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
        net.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
    dim = net.fc.in_features
    net.fc = nn.Identity()
    return FeatureClassifier(net, nn.Linear(dim, num_classes), dim, num_classes)
