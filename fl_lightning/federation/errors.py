"""The one exception type users see: a sentence saying what is wrong and how to fix it."""

from __future__ import annotations

import difflib
import re
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


# what PyTorch's allocators say when memory runs out: the CPU's (a RuntimeError from c10's alloc_cpu.cpp) and
# CUDA's (torch.OutOfMemoryError, a RuntimeError); a MemoryError is Python's own
_ALLOCATION_FAILED = ("DefaultCPUAllocator", "can't allocate memory", "out of memory", "not enough memory")
_CPU_BYTES = re.compile(r"allocate (\d+) bytes")
_CUDA_BYTES = re.compile(r"[Tt]ried to allocate ([\d.]+) (GiB|MiB|KiB|B)\b")


def is_allocation_failure(err: BaseException) -> bool:
    """Whether ``err`` is memory that could not be allocated (Python's MemoryError, PyTorch's allocators)."""
    if isinstance(err, MemoryError):
        return True
    return isinstance(err, RuntimeError) and any(text in str(err) for text in _ALLOCATION_FAILED)


def allocation_bytes(err: BaseException) -> int | None:
    """The size of the allocation that failed, where the allocator's message gives it."""
    text = str(err)
    found = _CPU_BYTES.search(text)
    if found:
        return int(found.group(1))
    found = _CUDA_BYTES.search(text)
    if found:
        return int(float(found.group(1)) * {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10, "B": 1}[found.group(2)])
    return None
