"""``fl_lightning.fit(config=..., **options)``: a run from Python, e.g. in a notebook.

The keyword arguments are turned into the ``flrun fit`` command line they stand for and parsed by the same
parser, so a run from Python is checked, resolved, recorded and resumed exactly as ``flrun fit`` would do it,
and a mistake raises the same one-sentence :class:`~fl_lightning.federation.errors.ConfigError`, its options
written as the keyword arguments of the call (:func:`python_words`).
"""

from __future__ import annotations

import json
import numbers
import os
import re
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
    try:
        argv = [*config_arguments(config), *option_arguments(options)]
        os.environ.setdefault("WANDB_SILENT", "true")  # as flrun does: wandb's banner is not the run's output
        return fit_from_argv(argv, extra_loggers=loggers)
    except ConfigError as err:  # the command line's sentence, in the words of the call that was made
        err.args = (python_words(str(err)), *err.args[1:])
        raise


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


# words after an option that are the sentence going on, not the option's value ("--monitor set to one of them")
_PROSE = frozenset(
    "a an and are as at but by does for from given goes if in is it more must not of on only or set so takes than "
    "that the then to was which with writes you".split()
)
_OPTION = re.compile(r"--([A-Za-z_]\w*(?:\.[\w-]+)*)(?:( )('[^']*'|\S+))?")


def python_words(message: str) -> str:
    """``message`` with the ``flrun fit`` options it names written as the keyword arguments of
    ``fl_lightning.fit``: ``--resume auto`` as ``resume="auto"``, ``--rounds 1`` as ``rounds=1``, a nested one as
    ``**{"training.batch_size": 32}``, a name alone as ``rounds``. Commands in backquotes stay as they are."""

    parts = message.split("`")
    for i in range(0, len(parts), 2):  # the text outside backquotes
        parts[i] = _OPTION.sub(_keyword, parts[i])
    return "`".join(parts)


def _keyword(match: re.Match) -> str:
    """One option (every one: an unknown option is a keyword the call gave) as a keyword argument."""
    key, space, value = match.groups()
    tail = ""
    if value is not None:
        stripped = value.rstrip(".,;:)?")
        value, tail = stripped, value[len(stripped) :]
    if not value or value.lower() in _PROSE or (value.startswith(("-", "(")) and not _is_number(value)):
        shown = key if key.isidentifier() else repr(key)
        return shown + (f"{space}{value}{tail}" if space else "")
    constants = {"true": "True", "false": "False", "null": "None"}
    literal = value if value.startswith("'") or _is_number(value) else constants.get(value, json.dumps(value))
    return (f"{key}={literal}" if key.isidentifier() else f"**{{{json.dumps(key)}: {literal}}}") + tail


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
