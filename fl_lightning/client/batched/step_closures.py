"""A step function's closure: the values it captures, and the same function over other values.

The batched executor groups clients whose step functions differ only in closure tensors, and maps over
those tensors by rebuilding the function with one client's values.
"""

from __future__ import annotations

import math
import types
from collections.abc import Callable
from typing import Any, cast


def closure_values(fn: Callable) -> list:
    """The values a step function closes over (a bound method's instance first)."""
    function = getattr(fn, "__func__", fn)
    values = [cast(types.MethodType, fn).__self__] if hasattr(fn, "__func__") else []
    return values + [cell.cell_contents for cell in (function.__closure__ or ())]


def rebuild(fn: Callable, values: list) -> Callable:
    """``fn`` with its closure values replaced (one client's slices of the stacked tensors)."""
    if not values:
        return fn
    function = getattr(fn, "__func__", fn)
    offset = 1 if hasattr(fn, "__func__") else 0
    cells = tuple(types.CellType(v) for v in values[offset:])
    rebuilt = types.FunctionType(
        function.__code__, function.__globals__, function.__name__, function.__defaults__, cells
    )
    rebuilt.__kwdefaults__ = function.__kwdefaults__
    return types.MethodType(rebuilt, values[0]) if offset else rebuilt


def identity(value: Any) -> Any:
    """Closure values that are not tensors must be the same object (or equal numbers) to share a group."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return (type(value), value if not (isinstance(value, float) and math.isnan(value)) else "nan")
    return id(value)
