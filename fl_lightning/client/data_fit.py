"""Whether each role's model fits the data, checked once before the first step: it predicts at least the data's
classes (a target beyond its outputs would end round 1 in ``IndexError: Target 8 is out of bounds``), its first
layer takes the data's examples (``mat1 and mat2 shapes cannot be multiplied``, ``expected input to have 3
channels``), and an embedding holds every token id the data uses (``index out of range``).

For the built-in models only what the modules declare is read: the first layer is checked where the model's
``features`` is a ``Sequential`` that applies it to the examples as they are. A user's LightningModule declares
nothing, so its ``forward`` is tried on two examples, in eval mode, without gradients and with the random state
put back: what a run computes is the same bits with or without the check."""

from __future__ import annotations

from collections.abc import Collection, Mapping

import torch
from torch import Tensor, nn

from ..federation.errors import ConfigError
from ..models import FeatureClassifier
from .lightning import LightningClientModule


def check_models_fit_data(slots: Mapping, num_classes: int, x: Tensor, input_roles: Collection[str] = ()) -> None:
    """Refuses a role whose model predicts fewer classes than the data has, or, among ``input_roles``, one whose
    first layer cannot take the data's examples or whose embedding holds fewer token ids than they use, in one
    sentence naming the role, its size and the data's.

    Args:
        slots: the loop's ``{role: ModelSlot}``.
        num_classes: the data's class count (a language model's vocabulary).
        x: the data's examples, integer token ids for text.
        input_roles: the roles whose models take the examples (the clients'; a server-only model such as
            FedGKT's takes the clients' feature maps instead).
    """
    tokens = _token_range(x)
    for role, slot in slots.items():
        if role in input_roles and isinstance(slot.module, LightningClientModule):
            check_forward(slot.module, num_classes, x)
        model = slot.module.model
        outputs = class_outputs(model)
        if outputs is not None and outputs < num_classes:
            raise ConfigError(
                f"model role {role!r} predicts {outputs} classes (its num_classes) but the data has {num_classes}; "
                f"leave num_classes out of models.{role}.args (the data's count is passed) or set it to "
                f"{num_classes}."
            )
        if role not in input_roles:
            continue
        problem = input_problem(model, x)
        if problem is not None:
            raise ConfigError(
                f"model role {role!r} {problem} (shape {list(x.shape[1:])}); set the builder's input "
                f"size in models.{role}.args (e.g. in_features, in_channels) to match, or use a builder made for "
                "these inputs (`flrun models`)."
            )
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        if embedding is not None and tokens is not None and not 0 <= tokens[0] <= tokens[1] < embedding.num_embeddings:
            raise ConfigError(
                f"model role {role!r} embeds token ids 0..{embedding.num_embeddings - 1} but the data's inputs hold "
                f"ids {tokens[0]}..{tokens[1]}; give the model the data's vocabulary size (vocab_size: "
                f"{tokens[1] + 1} or more in models.{role}.args) or the data a smaller one."
            )


def check_forward(module: LightningClientModule, num_classes: int, x: Tensor) -> None:
    """Refuses a user's LightningModule whose ``forward`` on two of the data's examples returns anything but one
    logits tensor of ``[N, num_classes]`` (``[N, T, num_classes]`` for a sequence) before its first step. The
    module's mode, the random state (CPU and CUDA) and gradients are left as they were."""
    name, role = type(module.model).__name__, module.role
    parameter = next(module.model.parameters(), None)
    sample = x[:2]
    if parameter is not None:
        sample = sample.to(parameter.device)
        if sample.is_floating_point() and parameter.is_floating_point():
            sample = sample.to(parameter.dtype)
    training = module.model.training
    devices = [parameter.device] if parameter is not None and parameter.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            module.model.eval()
            out = module(sample)  # the user's forward, behind its boundary (an exception there is theirs)
    finally:
        module.model.train(training)
    expected = f"[N, {num_classes}] logits (N examples, one score per class; [N, T, {num_classes}] for sequences)"
    if not isinstance(out, Tensor):
        returned = f"a {type(out).__name__} of {len(out)}" if isinstance(out, (tuple, list)) else type(out).__name__
        raise ConfigError(
            f"model role {role!r}: the LightningModule {name}.forward returned {returned}, not a tensor; the "
            f"framework evaluates every model on forward's output, which must be one tensor of {expected}: return "
            "the logits alone (compute other outputs in training_step, or in another method)."
        )
    if out.dim() not in (2, 3) or out.shape[0] != sample.shape[0] or out.shape[-1] < num_classes:
        raise ConfigError(
            f"model role {role!r}: the LightningModule {name}.forward returned a tensor of shape {list(out.shape)} "
            f"for {sample.shape[0]} examples of a data set of {num_classes} classes; it must return {expected}: "
            f"give its head {num_classes} outputs (pass num_classes on to it)."
        )


def class_outputs(model: nn.Module) -> int | None:
    """How many classes ``model`` predicts: its linear head's outputs, else its ``num_classes``; None when a
    user's module declares neither."""
    head = getattr(model, "head", None)
    if isinstance(model, FeatureClassifier) and isinstance(head, nn.Linear):
        return head.out_features
    declared = getattr(model, "num_classes", None)
    return declared if isinstance(declared, int) and not isinstance(declared, bool) else None


def input_problem(model: nn.Module, x: Tensor) -> str | None:
    """What of the data's examples ``x`` the first layer of ``model``'s ``features`` cannot take ("takes 3 input
    channels but the data's examples have 1"), or None (it can, or the model does not say)."""
    if not isinstance(model, FeatureClassifier) or not x.is_floating_point():
        return None
    first = _leading_layers(model.features)
    conv = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
    if first and isinstance(first[0], conv) and x.dim() == first[0].weight.dim():
        if first[0].in_channels != x.shape[1]:
            return f"takes {first[0].in_channels} input channels but the data's examples have {x.shape[1]}"
    elif first and isinstance(first[0], nn.Linear) and first[0].in_features != x.shape[-1]:
        return f"takes {first[0].in_features} input features but the data's examples end in {x.shape[-1]}"
    elif len(first) == 2 and isinstance(first[0], nn.Flatten) and isinstance(first[1], nn.Linear):
        flat = (first[0].start_dim, first[0].end_dim) == (1, -1)
        if flat and first[1].in_features != x[:1].numel():
            return f"takes {first[1].in_features} input features but the data's examples flatten to {x[:1].numel()}"
    return None


def _leading_layers(features: nn.Module) -> list[nn.Module]:
    """The first two layers of a (nested) ``Sequential``, which see the examples as they are; [] otherwise."""
    if not isinstance(features, nn.Sequential):
        return []
    layers: list[nn.Module] = []
    for child in features:
        layers += _leading_layers(child) if isinstance(child, nn.Sequential) else [child]
        if len(layers) >= 2:
            break
    return layers[:2]


def _token_range(x: Tensor) -> tuple[int, int] | None:
    """The smallest and largest id of integer inputs (token ids); None for features."""
    if x.is_floating_point() or x.dtype == torch.bool or x.numel() == 0:
        return None
    return int(x.min()), int(x.max())
