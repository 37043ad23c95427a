"""A user's own ``LightningModule`` as a client model: its ``training_step`` and ``configure_optimizers`` run in
the same Fabric loop as the built-in :class:`~fl_lightning.client.module.ClientModule`, and strategies
exchange its weights (its ``state_dict``) as they exchange any model's.

Evaluation is the same for every model (cross-entropy and accuracy of ``forward``'s logits on the test
split), so methods and models compare; a ``validation_step`` is not called. Methods that read the features
and the head apart (``Strategy.needs_split``) need the module to declare them: ``features`` and ``head``
submodules with ``forward(x) == head(features(x))``, and an int ``feature_dim``. Nothing here imports
Lightning: a run pays ``lightning.pytorch``'s import only when a recipe's builder made such a module.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..federation.errors import ConfigError
from ..federation.user_code import calling, converted
from ..models import FeatureClassifier
from .module import ClientModule


class LightningClientModule(ClientModule):
    """Wraps a user's ``LightningModule`` (``.model``, whose state dict is what strategies exchange).

    ``training_step`` is the module's own (a loss tensor, or a mapping holding ``loss``); ``configure_optimizers``
    is the module's own and must return one optimizer (the recipe's ``training.lr_schedule`` sets the learning
    rate over rounds, ``training.optimizer`` is not used for this role).
    """

    pure_training_step = False  # the user's step may do anything: the batched executor trains it sequentially
    model: Any  # the user's LightningModule: its own steps, and features and head where it declares them

    def __init__(self, model: nn.Module, role: str):
        # duck-typed as a FeatureClassifier: strategies that read features and head apart need declared_split
        super().__init__(cast(FeatureClassifier, model), optimizer=None)
        self.role = role
        self.split = declared_split(model)
        # self.log outside a Trainer warns at every call site; the run's metrics come from the federation
        warnings.filterwarnings("ignore", message=r"You are trying to `self\.log\(\)` but the `self\.trainer`")

    def hook(self, name: str) -> str:
        """How a sentence names one of the user's hooks: ``LightningModule mymod.Net.training_step (role 'global')``."""
        cls = type(self.model)
        return f"LightningModule {cls.__module__}.{cls.__qualname__}.{name} (model role {self.role!r})"

    def forward(self, x: Tensor) -> Tensor:
        try:  # not a context manager: the steps' hot path
            return self.model(x)
        except Exception as err:  # noqa: BLE001 - the user's forward raises anything
            new = converted(err, self.hook("forward"))
            if new is err:
                raise
            raise new from None

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int = 0) -> Tensor:
        try:
            out = self.model.training_step(batch, batch_idx)
        except Exception as err:  # noqa: BLE001 - the user's step raises anything
            new = converted(err, self.hook("training_step"))
            if new is err:
                raise
            raise new from None
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if not isinstance(loss, Tensor) or loss.dim() != 0:
            raise ConfigError(
                f"model role {self.role!r}: {type(self.model).__name__}.training_step returned "
                f"{type(out).__name__}, not a loss; return the scalar loss tensor (or a dict holding it as 'loss')."
            )
        return loss

    @torch.no_grad()
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        try:
            return super().test_step(batch, batch_idx)
        except Exception as err:  # noqa: BLE001 - the user's forward raises anything
            new = converted(err, self.hook("forward"))
            if new is err:
                raise
            raise new from None

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if not any(p.requires_grad for p in self.model.parameters()):
            raise ConfigError(
                f"model role {self.role!r}: the LightningModule {type(self.model).__name__} has no trainable "
                "parameters; the framework trains it with an optimizer of its parameters and exchanges them: give "
                "it at least one parameter that requires a gradient (an nn.Linear head, for example)."
            )
        with calling(self.hook("configure_optimizers")):
            returned = self.model.configure_optimizers()
        return one_optimizer(returned, f"{type(self.model).__name__} (role {self.role!r})")


def declared_split(model: nn.Module) -> bool:
    """Whether ``model`` declares ``features`` and ``head`` submodules and its feature size (``feature_dim``;
    taken from an ``nn.Linear`` head's input size when not set)."""
    features, head = getattr(model, "features", None), getattr(model, "head", None)
    if not (isinstance(features, nn.Module) and isinstance(head, nn.Module)):
        return False
    if not isinstance(getattr(model, "feature_dim", None), int) and isinstance(head, nn.Linear):
        model.feature_dim = head.in_features  # type: ignore[assignment]  # an int attribute on the user's module
    return isinstance(getattr(model, "feature_dim", None), int)


def one_optimizer(returned: object, owner: str) -> torch.optim.Optimizer:
    """The one optimizer ``configure_optimizers`` returned, alone, in a list or as ``{"optimizer": ...}``."""
    optimizer = returned
    if isinstance(returned, Mapping) and set(returned) == {"optimizer"}:
        optimizer = returned["optimizer"]
    elif isinstance(returned, (list, tuple)) and len(returned) == 1:
        optimizer = returned[0]
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"{owner}.configure_optimizers() returned {_described(returned)}; a client model trains with one "
            "optimizer and no scheduler here (training.lr_schedule sets the learning rate over rounds): return "
            "one torch.optim optimizer."
        )
    return optimizer


def _described(returned: object) -> str:
    if isinstance(returned, Mapping):
        return f"a dict with {', '.join(map(str, returned))}"
    if isinstance(returned, (list, tuple)):
        return f"a {type(returned).__name__} of {len(returned)}"
    return type(returned).__name__


def check_model_parts(slots: Mapping, method: str, needs_split: bool) -> None:
    """Refuses a method that reads features and heads apart on a LightningModule role that declares none."""
    if not needs_split:
        return
    for role, slot in slots.items():
        module = slot.module
        if isinstance(module, LightningClientModule) and not module.split:
            raise ConfigError(
                f"{method} reads every model's features and head apart, but model role {role!r} is the "
                f"LightningModule {type(module.model).__name__} without them; give it `features` and `head` "
                "submodules (forward(x) == head(features(x))) and an int `feature_dim` (read from an nn.Linear "
                "head), or use a method that exchanges whole models, e.g. FedAvg, FedDF or FedHe."
            )
