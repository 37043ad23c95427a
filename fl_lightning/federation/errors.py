"""The one exception type users see: a sentence saying what is wrong and how to fix it."""

from __future__ import annotations

import difflib
from collections.abc import Sequence


class ConfigError(ValueError):
    """Bad input from a recipe, a command line or the file system.

    The CLI prints its message as one line and exits non-zero, without a traceback, so every
    message must name what is wrong and how to fix it.
    """


class RankLost(ConfigError):
    """One of several ranks lost contact with the others mid-run (one of them ended): the run stops, its last
    checkpoint intact. Under ``flrun fit --runtime.devices N`` the launcher says which rank ended and how."""


def bad_choice(key: str, value: object, choices: Sequence[str], where: str = "") -> ConfigError:
    """The error for a value outside its choices, naming the key, the value given and the closest valid choice.

    Example: ``raise bad_choice("sampler.name", "cmaes2", ("tpe", "random"), " in sweep.yaml")`` gives
    ``sampler.name 'cmaes2' in sweep.yaml is not one of tpe, random (did you mean 'tpe'?).`` when one is close.
    """
    close = difflib.get_close_matches(str(value).lower(), [c.lower() for c in choices], n=1)
    hint = f" (did you mean {choices[[c.lower() for c in choices].index(close[0])]!r}?)" if close else ""
    return ConfigError(f"{key} {str(value)[:80]!r}{where} is not one of {', '.join(choices)}{hint}.")
