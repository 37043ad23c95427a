"""Name -> builder registry, so recipes refer to models as ``builder: digits_cnn``."""

from __future__ import annotations

import difflib
import importlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import ConfigError
from .base import FeatureClassifier

Builder = Callable[..., FeatureClassifier]
_BUILDERS: dict[str, Builder] = {}


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator registering a builder function under ``name``."""

    def wrap(fn: Builder) -> Builder:
        if name in _BUILDERS and _BUILDERS[name] is not fn:
            raise ValueError(f"model name {name!r} is registered twice")
        _BUILDERS[name] = fn
        return fn

    return wrap


def registered_models() -> dict[str, Builder]:
    """All registered builders by name (imports the bundled model modules first)."""
    from . import cifar_resnet, codist, digits, fedgh, fedmd, paper001, pretrained, resnet  # noqa: F401

    return dict(sorted(_BUILDERS.items()))


def resolve_builder(name: str) -> Builder:
    """A builder by registered name or by dotted import path (``package.module.function``)."""
    builders = registered_models()
    if name in builders:
        return builders[name]
    if "." in name:
        module_name, _, attr = name.rpartition(".")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as err:
            raise ConfigError(f"model builder {name!r} cannot be imported ({err}); check the dotted path") from None
    close = difflib.get_close_matches(name, builders, n=3)
    hint = f" Did you mean {', '.join(close)}?" if close else ""
    raise ConfigError(
        f"unknown model builder {name!r}.{hint} Registered models: {', '.join(builders)} "
        "(or give a dotted path to your own builder function)."
    )


@dataclass
class ModelSpec:
    """A model role's architecture: a registered builder and its keyword arguments.

    Attributes:
        builder: registered name (see ``flrun models``) or dotted path of a builder function.
        args: keyword arguments of the builder, e.g. ``{width: 0.25}``.
    """

    builder: str
    args: dict[str, Any] = field(default_factory=dict)

    def build(self, **context: Any) -> FeatureClassifier:
        """Builds the model; ``context`` (e.g. ``num_classes``) fills builder arguments not set."""
        fn = resolve_builder(self.builder)
        params = inspect.signature(fn).parameters
        unknown = sorted(set(self.args) - set(params))
        if unknown:
            raise ConfigError(
                f"model builder {self.builder!r} has no argument(s) {', '.join(unknown)}; "
                f"it accepts: {', '.join(params)}."
            )
        kwargs = {k: v for k, v in context.items() if k in params}
        kwargs.update(self.args)
        try:
            model = fn(**kwargs)
        except TypeError as err:
            raise ConfigError(f"model builder {self.builder!r} could not be called with {kwargs}: {err}") from None
        if not isinstance(model, FeatureClassifier):
            raise ConfigError(
                f"model builder {self.builder!r} returned {type(model).__name__}, not a FeatureClassifier "
                "(features + head); wrap your network in fl_lightning.models.FeatureClassifier."
            )
        return model
