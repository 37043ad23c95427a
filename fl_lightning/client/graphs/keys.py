"""What a CUDA graph's replay depends on, as a hashable key (``graphs.fit_key_of`` builds a fit's from these).

A replay repeats the kernels of its capture on the capture's memory with the Python values the step read
then, so a key holds tensors by address, modules by their tensors' addresses and modes, and numbers,
strings and the attributes of objects by value.
"""

from __future__ import annotations

import functools
import types
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from .trace import SCALARS

_CONTAINER_LIMIT = 256  # larger closure containers are keyed by identity and length only


def module_key(module: nn.Module) -> tuple:
    """Every submodule's tensors' addresses, which parameters train, and training modes (walked directly:
    ``named_modules`` and its generators made this a few thousand Python calls per fit of a ResNet20 and its
    teacher)."""
    modules, stack = [], [module]
    while stack:
        m = stack.pop()
        modules.append(m)
        stack.extend(child for child in m._modules.values() if child is not None)
    tensors = tuple(
        t.data_ptr() for m in modules for t in (*m._parameters.values(), *m._buffers.values()) if t is not None
    )
    trained = tuple(t.requires_grad for m in modules for t in m._parameters.values() if t is not None)  # frozen?
    return id(module), tensors, trained, tuple(m.training for m in modules)


def frozen(value: Any, depth: int, active: set[int] | None = None) -> Any:
    """A hashable stand-in for what a step could read from ``value``: numbers and strings by value, tensors by
    address, modules by their tensors and modes; containers item by item; a function's closure and an object's
    attributes while ``depth`` lasts (each level uses one), else the object's identity. Python modules and
    classes are taken as constants; a container or object met again inside itself is keyed by identity."""
    if isinstance(value, SCALARS):
        return value
    if isinstance(value, np.generic):  # a numpy number
        return value.item()
    if isinstance(value, Tensor):
        return "tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype, value.device
    if isinstance(value, nn.Module):
        return "module", module_key(value)
    if isinstance(value, (torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (types.ModuleType, type)):
        return "constant", id(value)
    active = set() if active is None else active
    if id(value) in active:  # a cycle (a list holding itself, a function whose closure holds itself)
        return "cycle", id(value)
    active.add(id(value))
    try:
        if isinstance(value, (tuple, list, set, frozenset, dict)):
            items = list(value.items()) if isinstance(value, dict) else list(value)
            if len(items) > _CONTAINER_LIMIT:
                return "container", id(value), len(items)
            if isinstance(value, (set, frozenset)):
                return "set", frozenset(frozen(v, depth, active) for v in items)
            return type(value).__name__, tuple(frozen(v, depth, active) for v in items)
        if depth <= 0:
            return "id", id(value)
        if isinstance(value, (types.FunctionType, types.MethodType)):
            function = getattr(value, "__func__", value)
            cells = tuple(frozen(c.cell_contents, depth - 1, active) for c in function.__closure__ or ())
            defaults = frozen(function.__defaults__ or (), depth - 1, active)
            owner = frozen(value.__self__, depth - 1, active) if isinstance(value, types.MethodType) else None
            return "function", function.__code__, cells, defaults, owner
        if isinstance(value, functools.partial):
            return "partial", frozen((value.func, value.args, value.keywords), depth - 1, active)
        attributes = _attributes(value)
        if attributes is not None:  # an object in the closure (the strategy): its attributes
            return "object", id(value), tuple((k, frozen(v, depth - 1, active)) for k, v in attributes)
        return "id", id(value)
    finally:
        active.discard(id(value))


def _attributes(value: Any) -> list[tuple[str, Any]] | None:
    """An object's attributes, from its ``__dict__`` and its classes' ``__slots__``; None when it has neither."""
    found = list(vars(value).items()) if hasattr(value, "__dict__") else []
    for cls in type(value).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                found.append((name, getattr(value, name)))
    return found if found or hasattr(value, "__dict__") else None
