"""Name -> builder registry, so recipes refer to models as ``builder: digits_cnn``.

A recipe is a file a user may be handed, so its ``builder`` can only name code the user chose to trust:

- a builder registered with :func:`register_model` (the bundled ones, or any in a module the user's own
  code imported);
- a builder an installed package exposes in the ``fl_lightning.models`` entry point group
  (``[project.entry-points."fl_lightning.models"] my_cnn = "my_pkg.models:my_cnn"``): installing the
  package is the act of trust;
- a dotted path ``package.module.function`` whose module is listed, or lies under a package listed, in
  the environment variable ``FLRUN_TRUSTED_MODULES`` (comma-separated, e.g. ``my_pkg,lab.models``).

Anything else (``builder: os.system``) is refused before its module is even imported. The recipe itself
cannot extend this list: trust comes from the environment or the installation, never from the file.
Whatever a builder is, what it returns must be a :class:`FeatureClassifier` or a Lightning ``LightningModule``
(the user's own training step and optimizer, docs/howto/lightning_module.md); a builder may be the
LightningModule class itself.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from torch import nn

from ..federation.errors import ConfigError
from ..federation.user_code import calling, import_failure, is_ours, missing_module
from .base import FeatureClassifier, is_lightning_module

Builder = Callable[..., FeatureClassifier]
_BUILDERS: dict[str, Builder] = {}
ENTRY_POINT_GROUP = "fl_lightning.models"
TRUST_ENV = "FLRUN_TRUSTED_MODULES"
# Bundled modules that import torchvision: a run of the other models never needs it, so they are imported
# only for a name the other bundled modules do not register (tests/test_startup.py keeps the others light).
_TORCHVISION_MODULES = frozenset({"cifar_resnet", "fedgkt", "htfl"})


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Decorator registering a builder function under ``name``."""

    def wrap(fn: Builder) -> Builder:
        if name in _BUILDERS and _BUILDERS[name] is not fn:
            raise ValueError(f"model name {name!r} is registered twice")
        _BUILDERS[name] = fn
        return fn

    return wrap


def import_bundled(with_torchvision: bool = True) -> None:
    """Imports this package's modules, so that their builders register (those needing torchvision on request)."""
    for module in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if with_torchvision or module.name not in _TORCHVISION_MODULES:
            importlib.import_module(f"{__package__}.{module.name}")


def registered_models() -> dict[str, Builder]:
    """All trusted builders by name: the bundled and registered ones, then installed entry points (a
    registered name wins over an entry point of the same name)."""
    import_bundled()
    builders = dict(_BUILDERS)
    for point in entry_points(group=ENTRY_POINT_GROUP):
        if point.name not in builders:
            try:
                builders[point.name] = point.load()
            except Exception as err:  # noqa: BLE001 - a broken installed package, whatever it raises
                raise ConfigError(
                    f"entry point {point.name!r} = {point.value!r} ({ENTRY_POINT_GROUP}) cannot be loaded "
                    f"({type(err).__name__}: {err}); fix or uninstall the package that declares it."
                ) from None
    return dict(sorted(builders.items()))


def trusted_modules() -> list[str]:
    """Module or package names from ``FLRUN_TRUSTED_MODULES`` (comma-separated)."""
    return [m.strip() for m in os.environ.get(TRUST_ENV, "").split(",") if m.strip()]


def is_trusted(module_name: str) -> bool:
    """Whether ``module_name`` is, or lies under, a module named in ``FLRUN_TRUSTED_MODULES``."""
    return any(module_name == m or module_name.startswith(m + ".") for m in trusted_modules())


def resolve_builder(name: str) -> Builder:
    """A trusted builder by registered / entry-point name or by a dotted path in a trusted module.

    Raises:
        ConfigError: unknown name, or a dotted path outside the trusted modules (refused before import).
    """
    import_bundled(with_torchvision=False)
    if name in _BUILDERS:  # registered: it wins over an entry point of the same name (registered_models)
        return _BUILDERS[name]
    builders = registered_models()
    if name in builders:
        return builders[name]
    if "." not in name:
        close = difflib.get_close_matches(name, builders, n=3)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ConfigError(
            f"unknown model builder {name!r}.{hint} Registered models: {', '.join(builders)} "
            "(or your own builder: see docs/howto/own_model.md)."
        )
    module_name, _, attr = name.rpartition(".")
    if not is_trusted(module_name):
        raise ConfigError(
            f"model builder {name!r} is neither a registered builder nor in a trusted module, so it is not "
            f"called; expose it in the {ENTRY_POINT_GROUP!r} entry point group of an installed package, "
            f"register it with @fl_lightning.models.register_model in code you import, or trust its module "
            f"by setting {TRUST_ENV}={module_name} in the environment."
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 - the user's module runs any code when imported
        if missing_module(module_name, err):
            raise ConfigError(f"model builder {name!r} cannot be imported ({err}); check the dotted path.") from None
        raise import_failure(module_name, err) from None
    try:
        fn = getattr(module, attr)
    except AttributeError as err:
        raise ConfigError(f"model builder {name!r} cannot be imported ({err}); check the dotted path.") from None
    if not callable(fn):
        raise ConfigError(f"model builder {name!r} is a {type(fn).__name__}, not a function returning a model.")
    return fn


@dataclass
class ModelSpec:
    """A model role's architecture: a registered builder and its keyword arguments.

    Attributes:
        builder: registered name (see ``flrun models``), an installed entry point's name, or the dotted path
            of a builder function in a module trusted through ``FLRUN_TRUSTED_MODULES``.
        args: keyword arguments of the builder, e.g. ``{width: 0.25}``.
        projection_dim: when set, the builder's head is replaced by a projection head of that output size
            and a classifier on it (MOON's model; see :func:`~fl_lightning.models.projection.with_projection_head`).
    """

    builder: str
    args: dict[str, Any] = field(default_factory=dict)
    projection_dim: int | None = None

    def build(self, **context: Any) -> nn.Module:
        """Builds the model (a FeatureClassifier or a LightningModule); ``context`` (e.g. ``num_classes``) fills
        builder arguments not set."""
        fn = resolve_builder(self.builder)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            raise ConfigError(
                f"model builder {self.builder!r} has no inspectable signature; wrap it in a function."
            ) from None
        unknown = sorted(set(self.args) - set(params))
        if unknown:
            close = difflib.get_close_matches(unknown[0], list(params), n=1)
            hint = f"did you mean {close[0]}? " if close else ""
            raise ConfigError(
                f"model builder {self.builder!r} has no argument(s) {', '.join(unknown)}; "
                f"{hint}it accepts: {', '.join(params)}."
            )
        kwargs = {k: v for k, v in context.items() if k in params}
        kwargs.update(self.args)
        if not _ours(fn):  # the user's builder: what it raises is theirs
            try:
                inspect.signature(fn).bind(**kwargs)
            except TypeError as err:  # a required argument the recipe does not give
                raise ConfigError(
                    f"model builder {self.builder!r} cannot be called with {sorted(kwargs)} ({err}); give its "
                    f"arguments in models.<role>.args."
                ) from None
            with calling(f"model builder {self.builder}"):
                built = fn(**kwargs)
            return self._checked(built)
        try:
            model = fn(**kwargs)
        except ConfigError as err:  # the builder's own check of its arguments
            raise ConfigError(f"model builder {self.builder!r} with args {self.args}: {err}") from None
        except (TypeError, ValueError) as err:  # e.g. width: wide
            raise ConfigError(
                f"model builder {self.builder!r} could not be called with {self.args} ({err}); "
                "fix the arguments' types in models.<role>.args."
            ) from None
        return self._checked(model)

    def _checked(self, model: Any) -> nn.Module:
        """The built model, refused unless a FeatureClassifier or a LightningModule; with its projection head."""
        if not isinstance(model, FeatureClassifier) and not is_lightning_module(model):
            raise ConfigError(
                f"model builder {self.builder!r} returned {type(model).__name__}, neither a FeatureClassifier "
                "(features + head) nor a LightningModule; wrap your network in fl_lightning.models.FeatureClassifier, "
                "or hand in a LightningModule (docs/howto/lightning_module.md)."
            )
        if self.projection_dim is not None and not isinstance(model, FeatureClassifier):
            raise ConfigError(
                f"projection_dim replaces a FeatureClassifier's head (MOON's model), but model builder "
                f"{self.builder!r} returned the LightningModule {type(model).__name__}; use a built-in builder "
                "for this role (e.g. digits_cnn) or leave projection_dim out."
            )
        if self.projection_dim is not None:
            from .projection import with_projection_head

            model = with_projection_head(model, self.projection_dim)
        return model


def _ours(fn: Callable) -> bool:
    """Whether a builder is this package's own (its errors about arguments are the recipe's to fix)."""
    try:
        return is_ours(inspect.getsourcefile(fn) or "")
    except TypeError:  # a builtin or a C extension's callable
        return False
