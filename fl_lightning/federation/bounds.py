"""Option bounds declared in a signature and checked once, when the object is built.

A strategy (or any :class:`Bounded` class) writes the range of a numeric option as its annotation instead of
an ``if ...: raise`` in ``__init__``::

    class FedMD(Strategy):
        def __init__(self, temperature: Positive = 1.0, digest_batch_size: PositiveInt | None = None): ...

    FedMD(temperature=0)  # ConfigError: FedMD temperature must be > 0, got 0.

The bounds are `annotated-types <https://github.com/annotated-types/annotated-types>`_ constraints (``Gt``,
``Ge``, ``Lt``, ``Le``, ``Interval``). The classes below are those, defined in this module so that the
command-line parser takes them as plain numbers and leaves the check to the class: a value is then refused
in the same sentence from a recipe, the command line and Python. An optional option (``PositiveInt | None``)
accepts ``None``; each value of a ``dict[str, Positive]`` (a rate per role) and each item of a list is checked.
Checks that relate two options (``energy_start <= energy_end``) stay in ``__init__``.
"""

from __future__ import annotations

import inspect
import types
import typing
import weakref
from collections.abc import Mapping
from typing import Annotated, Any, Union

import annotated_types as at

from .errors import ConfigError


class Gt(at.Gt):
    """The value must be greater than ``gt``."""

    __slots__ = ()


class Ge(at.Ge):
    """The value must be at least ``ge``."""

    __slots__ = ()


class Lt(at.Lt):
    """The value must be less than ``lt``."""

    __slots__ = ()


class Le(at.Le):
    """The value must be at most ``le``."""

    __slots__ = ()


class Interval(at.Interval):
    """The value must lie in an interval, e.g. ``Interval(gt=0, le=1)`` for (0, 1]."""

    __slots__ = ()


Positive = Annotated[float, Gt(0)]  # a rate, a temperature, a scale
NonNegative = Annotated[float, Ge(0)]  # a loss weight, a margin (0 turns the term off)
Fraction01 = Annotated[float, Interval(ge=0, le=1)]  # a mixing weight in [0, 1]
PositiveFraction = Annotated[float, Interval(gt=0, le=1)]  # a share of something that cannot be empty: (0, 1]
PositiveInt = Annotated[int, Ge(1)]  # a batch size, a period, a number of batches
NonNegativeInt = Annotated[int, Ge(0)]  # a number of steps, epochs or rounds (0: none)

_NUMBER = (int, float)


def _describe(bound: Any) -> str:
    """``> 0``, ``>= 1``, ``in (0, 1]``: the bound as the message states it."""
    if isinstance(bound, at.Interval):
        low = f"({bound.gt!r}" if bound.gt is not None else f"[{bound.ge!r}" if bound.ge is not None else ""
        high = f"{bound.lt!r})" if bound.lt is not None else f"{bound.le!r}]" if bound.le is not None else ""
        return f"in {low}, {high}" if low and high else " and ".join(_describe(part) for part in bound)
    for kind, op, attr in ((at.Gt, ">", "gt"), (at.Ge, ">=", "ge"), (at.Lt, "<", "lt"), (at.Le, "<=", "le")):
        if isinstance(bound, kind):
            return f"{op} {getattr(bound, attr)!r}"
    raise TypeError(f"unsupported bound {bound!r}")


def bound_text(hint: Any) -> str | None:
    """The bound of an option's annotation as its help states it beside the type: ``> 0``, ``>= 1`` (of an
    optional option too), ``each value > 0`` of a mapping, ``each > 0`` of a list; ``None`` when unbounded."""
    origin = typing.get_origin(hint)
    if origin is Annotated:
        found = [_describe(meta) for meta in typing.get_args(hint)[1:] if _is_bound(meta)]
        return " and ".join(found) if found else bound_text(typing.get_args(hint)[0])
    if origin in (Union, types.UnionType):
        arms = [arm for arm in typing.get_args(hint) if arm is not type(None)]
        return next((text for text in map(bound_text, arms) if text), None)
    if origin in (dict, Mapping) and typing.get_args(hint):
        item = bound_text(typing.get_args(hint)[1])
        return f"each value {item}" if item else None
    if origin in (list, tuple) and typing.get_args(hint):
        item = bound_text(typing.get_args(hint)[0])
        return f"each {item}" if item else None
    return None


def _holds(bound: Any, value: Any) -> bool:
    """Whether ``value`` satisfies ``bound`` (NaN satisfies none)."""
    if isinstance(bound, at.Interval):
        return all(_holds(part, value) for part in bound)
    if isinstance(bound, at.Gt):
        return bool(value > bound.gt)
    if isinstance(bound, at.Ge):
        return bool(value >= bound.ge)
    if isinstance(bound, at.Lt):
        return bool(value < bound.lt)
    if isinstance(bound, at.Le):
        return bool(value <= bound.le)
    return True  # other metadata (a docstring, a parser hint) bounds nothing


def _is_bound(meta: Any) -> bool:
    return isinstance(meta, at.Interval | at.Gt | at.Ge | at.Lt | at.Le)


def _strip(hint: Any) -> Any:
    return typing.get_args(hint)[0] if typing.get_origin(hint) is Annotated else hint


def _fits(hint: Any, value: Any) -> bool:
    """Whether ``value`` is of the kind of one arm of a union (a mapping, a sequence or a number)."""
    origin = typing.get_origin(_strip(hint)) or _strip(hint)
    if origin in (dict, Mapping):
        return isinstance(value, Mapping)
    if origin in (list, tuple):
        return isinstance(value, list | tuple)
    return isinstance(value, _NUMBER) and not isinstance(value, bool)


def violation(hint: Any, value: Any) -> tuple[str, str, Any] | None:
    """The first bound of ``hint`` that ``value`` breaks, as ``(where, bound, value)``: ``where`` is ``""`` or a
    key of a mapping (``"['small']"``), ``bound`` the bound's text (``"> 0"``); ``None`` when every bound holds.

    Values of another kind than the hint's numbers (a string, a ``None``) are left to the parser and the
    class's own checks."""
    origin = typing.get_origin(hint)
    if origin is Annotated:
        base, *metadata = typing.get_args(hint)
        if isinstance(value, _NUMBER) and not isinstance(value, bool):
            for meta in metadata:
                if _is_bound(meta) and not _holds(meta, value):
                    return "", _describe(meta), value
        return violation(base, value)
    if origin in (Union, types.UnionType):
        arms = [arm for arm in typing.get_args(hint) if arm is not type(None)]
        for arm in arms:
            if _fits(arm, value):
                found = violation(arm, value)
                if found and len(arms) < len(typing.get_args(hint)):  # an optional option
                    return found[0], f"{found[1]} (or null)", found[2]
                return found
        return None
    if origin in (dict, Mapping) and isinstance(value, Mapping):
        item_hint = typing.get_args(hint)[1] if typing.get_args(hint) else Any
        for key, item in value.items():
            found = violation(item_hint, item)
            if found:
                return f"[{key!r}]{found[0]}", found[1], found[2]
    if origin in (list, tuple) and isinstance(value, list | tuple):
        for i, item in enumerate(value):
            found = violation(typing.get_args(hint)[0], item)
            if found:
                return f"[{i}]{found[0]}", found[1], found[2]
    return None


_HINTS: weakref.WeakKeyDictionary[type, dict[str, Any]] = weakref.WeakKeyDictionary()


def _init_hints(init: Any) -> dict[str, Any]:
    """The evaluated annotations of ``init``; one that cannot be evaluated (a name imported for type checkers
    only) bounds nothing and is left out."""
    try:
        return typing.get_type_hints(init, include_extras=True)
    except Exception:
        hints = {}
        for name, annotation in getattr(init, "__annotations__", {}).items():
            try:
                alone = _Holder(name, annotation)
                hints[name] = typing.get_type_hints(alone, init.__globals__, include_extras=True)[name]
            except Exception:
                continue
        return hints


class _Holder:
    """One annotation on its own, for ``typing.get_type_hints``."""

    def __init__(self, name: str, annotation: Any):
        self.__annotations__ = {name: annotation}


def option_hints(cls: type) -> dict[str, Any]:
    """The annotations of the ``__init__`` parameters of ``cls`` and of its bases, the most derived first (an
    option a subclass passes on through ``**kwargs`` is bounded where its base declares it)."""
    if cls not in _HINTS:
        hints: dict[str, Any] = {}
        for klass in reversed(cls.__mro__):
            init = klass.__dict__.get("__init__")
            if init is not None and klass is not object:
                hints.update(_init_hints(init))
        hints.pop("return", None)
        _HINTS[cls] = hints
    return _HINTS[cls]


def check_bounds(cls: type, args: tuple, kwargs: dict[str, Any]) -> None:
    """Raises :class:`ConfigError` for the first argument of ``cls(*args, **kwargs)`` outside its declared bound.

    The sentence names the method (``cls.name``, else the class name), the option, its bound and the value:
    ``FedMD temperature must be > 0, got 0.``"""
    signature = inspect.signature(cls.__init__)  # type: ignore[misc]  # the class's own, not an instance's
    try:
        arguments = signature.bind_partial(None, *args, **kwargs).arguments
    except TypeError:
        return  # a wrong call: __init__ itself says so
    hints = option_hints(cls)
    given: dict[str, Any] = {}
    for name, value in list(arguments.items())[1:]:
        parameter = signature.parameters[name]
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            given.update(value)  # options of a base, passed on through **kwargs
        elif parameter.kind is not inspect.Parameter.VAR_POSITIONAL:
            given[name] = value
    for name, value in given.items():
        found = violation(hints.get(name, Any), value)
        if found:
            where, bound, bad = found
            method = getattr(cls, "name", None) or cls.__name__
            raise ConfigError(f"{method} {name}{where} must be {bound}, got {bad!r}.")


class Bounded:
    """A class whose ``__init__`` options are checked against their annotated bounds before ``__init__`` runs."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        check_bounds(cls, args, kwargs)
        return super().__new__(cls)
