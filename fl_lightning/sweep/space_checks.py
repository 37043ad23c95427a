"""Every field of a sweep parameter checked before the first trial: a space Optuna would take in a wrong form (a
``choices`` string searched letter by letter, ``high: .inf``, an int range of ``1.5`` to ``1e30``), or refuse only
when it samples, is one sentence naming the parameter and the field.

A parameter is ``{type: float, low, high[, log][, step]}``, ``{type: int, low, high[, log][, step]}`` or
``{type: categorical, choices: [...]}``.
"""

from __future__ import annotations

import math
from typing import Any

from ..federation.errors import ConfigError
from ..run.safe_yaml import clip

FIELDS = {"float": {"low", "high", "log", "step"}, "int": {"low", "high", "log", "step"}, "categorical": {"choices"}}
EXACT_INT = 2**53  # beyond it a YAML number (a float) no longer names one integer
PLAIN = (str, int, float, bool, type(None))  # what Optuna stores as a categorical choice


# Optuna's old distribution names, as a sweep file may still write them: what to write instead
OLD_TYPES = {
    "loguniform": "{type: float, low: ..., high: ..., log: true}",
    "uniform": "{type: float, low: ..., high: ...}",
    "discrete_uniform": "{type: float, low: ..., high: ..., step: ...}",
    "int_loguniform": "{type: int, low: ..., high: ..., log: true}",
    "intloguniform": "{type: int, low: ..., high: ..., log: true}",
    "int_uniform": "{type: int, low: ..., high: ...}",
    "categorical_choices": "{type: categorical, choices: [...]}",
}


def check_parameter(name: str, p: Any) -> None:
    """Raises ConfigError unless ``p`` is a well-formed search space for the recipe key ``name``."""
    if not isinstance(p, dict):
        raise ConfigError(f"parameter {name!r}: give a mapping such as {{type: float, low: 0.01, high: 0.1}}.")
    kind = p.get("type")
    if kind not in FIELDS:
        instead = f"; write {OLD_TYPES[kind]}" if isinstance(kind, str) and kind in OLD_TYPES else ""
        raise ConfigError(
            f"parameter {name!r}: type must be float, int or categorical, got {clip(repr(kind), 60)}{instead}."
        )
    unknown = sorted(map(str, set(p) - FIELDS[kind] - {"type"}))
    if unknown:
        raise ConfigError(
            f"parameter {name!r}: {kind} takes {', '.join(sorted(FIELDS[kind]))}, not {clip(', '.join(unknown), 80)}."
        )
    if kind == "categorical":
        _check_choices(name, p.get("choices"))
    else:
        _check_range(name, kind, p)


def _check_choices(name: str, choices: Any) -> None:
    if not isinstance(choices, list) or not choices:
        raise ConfigError(
            f"parameter {name!r}: categorical needs a non-empty `choices` list, e.g. choices: [8, 16, 32], "
            f"got {clip(repr(choices), 60)}."
        )
    for choice in choices:
        if not isinstance(choice, PLAIN) or (isinstance(choice, float) and not math.isfinite(choice)):
            raise ConfigError(
                f"parameter {name!r}: choice {clip(repr(choice), 60)} is not a plain value (a string, finite number, "
                "true/false or null); give a mapping or list as a JSON string, as sweeps/merged_codist_cifar100.yaml "
                "does."
            )


def _check_range(name: str, kind: str, p: dict) -> None:
    if "low" not in p or "high" not in p:
        raise ConfigError(
            f"parameter {name!r}: a {kind} range needs low and high, e.g. {{type: {kind}, low: 1, high: 8}}."
        )
    low, high = (_bound(name, kind, key, p[key]) for key in ("low", "high"))
    if not low < high:
        raise ConfigError(f"parameter {name!r}: give low < high, got low={low} high={high}.")
    log = p.get("log", False)
    if not isinstance(log, bool):
        raise ConfigError(f"parameter {name!r}: log must be true or false, got {clip(repr(log), 60)}.")
    if log and low <= 0:
        raise ConfigError(f"parameter {name!r}: a log scale needs low > 0, got {low}.")
    step = p.get("step")
    if step is None:
        return
    step = _bound(name, kind, "step", step)
    if not step > 0 or step > high - low:
        raise ConfigError(
            f"parameter {name!r}: step must be positive and at most high - low ({high - low}), got {step}."
        )
    if log and (kind == "float" or step != 1):  # Optuna refuses both, but only when it samples
        raise ConfigError(f"parameter {name!r}: a log scale cannot have a step; remove one of them.")


def _bound(name: str, kind: str, key: str, value: Any) -> float | int:
    """``value`` as the number a ``kind`` range's ``key`` must be: finite, and an exact integer for ``int``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"parameter {name!r}: {key} must be a finite number, got {clip(repr(value), 60)}.")
    if kind == "float":
        return float(value)
    if abs(value) > EXACT_INT or (isinstance(value, float) and not value.is_integer()):
        raise ConfigError(
            f"parameter {name!r}: {key} of an int range must be a whole number (at most 2^53 in size), got {value!r}."
        )
    return int(value)
