"""Whether each role's model fits the data, checked once before the first step: it predicts at least the data's
classes (a target beyond its outputs would end round 1 in ``IndexError: Target 8 is out of bounds``), and an
embedding holds every token id the data uses (else ``index out of range`` inside the first forward)."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor, nn

from ..federation.errors import ConfigError
from ..models import FeatureClassifier


def check_models_fit_data(slots: Mapping, num_classes: int, x: Tensor) -> None:
    """Refuses a role whose model predicts fewer classes than the data has, or embeds fewer token ids than the
    data's inputs use, in one sentence naming the role, its size and the data's.

    Args:
        slots: the loop's ``{role: ModelSlot}``.
        num_classes: the data's class count (a language model's vocabulary).
        x: the data's examples, integer token ids for text.
    """
    tokens = _token_range(x)
    for role, slot in slots.items():
        model = slot.module.model
        outputs = class_outputs(model)
        if outputs is not None and outputs < num_classes:
            raise ConfigError(
                f"model role {role!r} predicts {outputs} classes (its num_classes) but the data has {num_classes}; "
                f"leave num_classes out of models.{role}.args (the data's count is passed) or set it to "
                f"{num_classes}."
            )
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if embedding is not None and tokens is not None and not 0 <= tokens[0] <= tokens[1] < embedding.num_embeddings:
            raise ConfigError(
                f"model role {role!r} embeds token ids 0..{embedding.num_embeddings - 1} but the data's inputs hold "
                f"ids {tokens[0]}..{tokens[1]}; give the model the data's vocabulary size (vocab_size: "
                f"{tokens[1] + 1} or more in models.{role}.args) or the data a smaller one."
            )


def class_outputs(model: nn.Module) -> int | None:
    """How many classes ``model`` predicts: its linear head's outputs, else its ``num_classes``; None when a
    user's module declares neither."""
    head = getattr(model, "head", None)
    if isinstance(model, FeatureClassifier) and isinstance(head, nn.Linear):
        return head.out_features
    declared = getattr(model, "num_classes", None)
    return declared if isinstance(declared, int) and not isinstance(declared, bool) else None


def _token_range(x: Tensor) -> tuple[int, int] | None:
    """The smallest and largest id of integer inputs (token ids); None for features."""
    if x.is_floating_point() or x.dtype == torch.bool or x.numel() == 0:
        return None
    return int(x.min()), int(x.max())
