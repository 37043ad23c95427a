"""``fl_lightning.fit(config=..., **options)``: a run from Python, e.g. in a notebook.

The keyword arguments are turned into the ``flrun fit`` command line they stand for and parsed by the same
parser, so a run from Python is checked, resolved, recorded and resumed exactly as ``flrun fit`` would do it,
and a mistake raises the same one-sentence :class:`~fl_lightning.federation.errors.ConfigError`.
"""

from __future__ import annotations

import json
import numbers
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..federation.errors import ConfigError

ConfigArg = str | os.PathLike | Mapping[str, Any] | list | tuple | None


def fit_recipe(config: ConfigArg = None, **options: Any) -> dict[str, Any]:
    """Runs a recipe with ``options`` on top; returns the run's summary (what ``summary.json`` holds)."""
    from ..tracking.loggers import RunLogger
    from .arguments import fit_from_argv

    loggers = _logger_objects(options.get("logger"), RunLogger)
    if loggers:  # logger objects cannot travel as text: the rest of --logger goes to the parser, they go along
        kept = [item for item in _as_list(options["logger"]) if not isinstance(item, RunLogger)]
        options = {**options, "logger": kept or "csv"}
    argv = [*config_arguments(config), *option_arguments(options)]
    os.environ.setdefault("WANDB_SILENT", "true")  # as flrun does: wandb's banner is not the run's output
    return fit_from_argv(argv, extra_loggers=loggers)


def config_arguments(config: ConfigArg) -> list[str]:
    """``--config`` arguments for recipe files, or the options of a recipe given as a mapping."""
    if config is None:
        return []
    if isinstance(config, Mapping):
        if "base" in config:
            raise ConfigError(
                "fit(config={...}) takes a recipe's keys; `base:` names files, so give the recipe file instead: "
                "fit(config='recipes/NAME.yaml', ...)."
            )
        return option_arguments(dict(config))
    paths = list(config) if isinstance(config, (list, tuple)) else [config]
    if not paths or not all(isinstance(p, (str, os.PathLike)) for p in paths):
        raise ConfigError(
            f"fit(config=...) takes a recipe file, a list of them or a mapping of recipe keys, not {config!r}; "
            "e.g. fit(config='recipes/quickstart.yaml')."
        )
    return [arg for path in paths for arg in ("--config", str(Path(path)))]


def option_arguments(options: Mapping[str, Any]) -> list[str]:
    """``--key value`` for each option: a dotted key (``training.batch_size``) or a top-level key whose
    mapping merges into the recipe's (``training={'batch_size': 32}``), values written as JSON (YAML)."""
    argv = []
    for key, value in options.items():
        if key in ("config", "__path__") or not key or key.startswith("-"):
            raise ConfigError(
                f"fit() got the option {key!r}; give recipe keys without dashes, e.g. rounds=5 or "
                "**{'training.batch_size': 32}, and the recipe as fit(config=...)."
            )
        argv += [f"--{key}", _text(key, value)]
    return argv


def _text(key: str, value: Any) -> str:
    """An option's value as the command line would carry it: strings as they are, the rest as JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        return str(Path(value))
    try:
        return json.dumps(value, default=_plain)
    except (TypeError, ValueError):
        raise ConfigError(
            f"fit({key}=...) got a {type(value).__name__}; give the value a recipe would hold (numbers, strings, "
            f"lists, mappings such as {{'class_path': ..., 'init_args': {{...}}}}), not a built object."
        ) from None


def _plain(value: Any) -> Any:
    """What JSON does not know but a recipe value may be: paths, tuples and sets, numpy's numbers (a loop over
    ``np.arange`` in a notebook)."""
    if isinstance(value, os.PathLike):
        return str(Path(value))
    if isinstance(value, (tuple, set, frozenset)):
        return list(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    raise TypeError(type(value).__name__)


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _logger_objects(value: Any, logger_type: type) -> list:
    return [item for item in _as_list(value) if isinstance(item, logger_type)] if value is not None else []
