"""FedPCL's client model for any builder: the feature extractors of one or more models, frozen and concatenated,
then a trainable projection (Linear, ReLU, L2 normalisation) and a linear head.

Each backbone is a ``{builder, args, weights}`` entry, built as a recipe's model role is. Its pretrained
weights, when given, are read from a local file the way ``models/pretrained.py`` reads them: safetensors, or a
PyTorch state dict loaded with ``weights_only`` (never a pickle that could run code). Without weights a backbone
keeps its random initialisation, drawn from its own ``backbone_seed`` so that every client and every build of the
role holds the same frozen network, as every client of the FedPCL paper holds the same downloaded one.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..federation.errors import ConfigError
from .base import FeatureClassifier
from .registry import ModelSpec, register_model

BACKBONE_KEYS = {"builder", "args", "weights"}


class Backbones(nn.Module):
    """The backbones' feature vectors concatenated ``[B, sum D_i]``; frozen ones run without gradients and stay
    in eval mode (batch-norm statistics and dropout as built, whatever the mode asked for)."""

    def __init__(self, extractors: list[nn.Module], frozen: bool):
        super().__init__()
        self.extractors = nn.ModuleList(extractors)
        self.frozen = frozen
        if frozen:
            self.extractors.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.frozen):
            return torch.cat([extractor(x) for extractor in self.extractors], dim=1)

    def train(self, mode: bool = True):
        super().train(mode)
        if self.frozen:
            self.extractors.eval()
        return self


class L2Normalize(nn.Module):
    """Each row scaled to unit length (the last step of FedPCL's projection)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=1)


@register_model("frozen_backbones")
def frozen_backbones(
    backbones: list[dict[str, Any]] | None = None,
    num_classes: int = 10,
    in_channels: int = 1,
    projection_dim: int = 256,
    trainable: bool = False,
    backbone_seed: int = 0,
    fetch_weights: Callable[[str, Path], None] | None = None,
) -> FeatureClassifier:
    """Frozen feature extractors of other builders, concatenated, then Linear + ReLU + L2 norm (FedPCL's model).

    ``features`` ends with the unit-length projection ``[B, projection_dim]``; ``head`` is a linear classifier
    on it (FedPCL replaces it by its nearest-prototype head when evaluating).

    Args:
        backbones: the extractors, each ``{builder: <name>, args: {...}, weights: <path>}`` (``args`` and
            ``weights`` optional); their ``features`` outputs are concatenated. Default: one ``digits_cnn``.
        projection_dim: the projection's output size (256 in the FedPCL code).
        trainable: train the backbones too (the from-scratch variant HtFLlib ran); frozen by default.
        backbone_seed: seed of the backbones' random initialisation (what a backbone without ``weights`` keeps).
        num_classes, in_channels, fetch_weights: given by the run, passed on to the backbones' builders.

    Example (a recipe's ``models`` entry)::

        cnn: {builder: frozen_backbones, args: {backbones: [{builder: digits_cnn, args: {hidden: 128}}]}}
    """
    specs = _backbone_specs(backbones if backbones is not None else [{"builder": "digits_cnn"}])
    if not isinstance(projection_dim, int) or isinstance(projection_dim, bool) or projection_dim < 1:
        raise ConfigError(f"frozen_backbones projection_dim must be a positive integer, got {projection_dim!r}.")
    context = {"num_classes": num_classes, "in_channels": in_channels, "fetch_weights": fetch_weights}
    with torch.random.fork_rng(devices=[]):  # the caller's generator draws the projection only
        torch.manual_seed(backbone_seed)
        built = [_backbone(spec, weights, context) for spec, weights in specs]
    dim = sum(model.feature_dim for model in built)
    features = nn.Sequential(
        Backbones([model.features for model in built], frozen=not trainable),
        nn.Linear(dim, projection_dim),
        nn.ReLU(),
        L2Normalize(),
    )
    return FeatureClassifier(features, nn.Linear(projection_dim, num_classes), projection_dim, num_classes)


def _backbone_specs(entries: Any) -> list[tuple[ModelSpec, str | None]]:
    """Each entry as a model spec and its weights file, refused in one sentence when malformed."""
    if not isinstance(entries, list) or not entries:
        raise ConfigError(
            f"frozen_backbones backbones must be a non-empty list of {{builder, args, weights}} entries, got "
            f"{entries!r}; e.g. backbones: [{{builder: digits_cnn}}]."
        )
    specs = []
    for entry in entries:
        if not isinstance(entry, dict) or "builder" not in entry or set(entry) - BACKBONE_KEYS:
            raise ConfigError(
                f"each frozen_backbones backbone is a mapping with builder and optionally args and weights, got "
                f"{entry!r}; e.g. {{builder: digits_cnn, args: {{hidden: 128}}}}."
            )
        specs.append((ModelSpec(entry["builder"], dict(entry.get("args") or {})), entry.get("weights")))
    return specs


def _backbone(spec: ModelSpec, weights: str | None, context: dict[str, Any]) -> FeatureClassifier:
    model = spec.build(**context)
    if not isinstance(model, FeatureClassifier):
        raise ConfigError(
            f"frozen_backbones needs each backbone's features, but builder {spec.builder!r} returned a "
            f"{type(model).__name__}; use a builder that returns a FeatureClassifier."
        )
    if weights is not None:
        load_backbone_weights(model, Path(weights), spec.builder)
    return model


def load_backbone_weights(model: FeatureClassifier, path: Path, builder: str) -> None:
    """Loads a local state dict of ``model`` (``.safetensors``, or a PyTorch file read with ``weights_only``):
    every ``features`` tensor must be in it; head tensors may be absent (a backbone's classifier is unused)."""
    if not path.is_file():
        raise ConfigError(
            f"backbone weights {str(path)!r} for builder {builder!r} not found; give the path of a local "
            ".safetensors or .pt state dict of that builder's model (nothing is downloaded)."
        )
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path))
    else:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - a damaged or non-tensor file, whatever torch raises
            raise ConfigError(f"backbone weights {str(path)!r} cannot be read as a state dict ({err}).") from None
    expected = model.state_dict()
    missing = [k for k in expected if k.startswith("features.") and k not in state]
    unexpected = [k for k in state if k not in expected]
    reshaped = [k for k in state if k in expected and state[k].shape != expected[k].shape]
    if missing or unexpected or reshaped:
        raise ConfigError(
            f"backbone weights {str(path)!r} do not fit builder {builder!r} with its args: missing "
            f"{missing[:3]}, unexpected {unexpected[:3]}, of another shape {reshaped[:3]}; save the state dict of "
            "that model (model.state_dict()) or give the builder the args it was trained with."
        )
    model.load_state_dict(state, strict=False)
