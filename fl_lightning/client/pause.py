"""Whether a client's local fit runs now or later: the batched executor runs each client's ``client_update``
as a coroutine and pauses it at each fit (:mod:`fl_lightning.client.batched.executor`).

The loop asks :func:`paused_fit` first: inside such a client it hands the fit over and returns its result
once the executor has run it with other clients' fits; outside, it returns None and the loop fits at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .steps import ModelSlot, StepFn

LocalLoop = Any  # the loop asking (client.loop, which imports this module): passed through to the coroutine

_current = threading.local()  # the coroutine running on this thread, if any


class Pausable(Protocol):
    """A client coroutine: it can hand over a fit and count the fits a strategy ran itself."""

    def pause_fit(
        self, loop: LocalLoop, slot: ModelSlot, role: str, batches, rnd: int, step_fn: StepFn, on_record
    ) -> dict: ...

    def note_sequential(self, fits: int, why: str) -> None: ...


def run_as(coroutine: Pausable | None) -> None:
    """Makes ``coroutine`` the client running on this thread (the executor's client threads call it)."""
    _current.coroutine = coroutine


def paused_fit(
    loop: LocalLoop, slot: ModelSlot, role: str, batches, rnd: int, step_fn: StepFn, on_record: Callable | None
) -> dict[str, Any] | None:
    """Inside a coroutine: pauses the client until its fit has run and returns the fit's result; None outside."""
    coroutine = getattr(_current, "coroutine", None)
    if coroutine is None:
        return None
    return coroutine.pause_fit(loop, slot, role, batches, rnd, step_fn, on_record)


def note_sequential_fit(why: str) -> None:
    """Inside a client of the batched executor: counts a fit the strategy ran itself, outside ``loop.fit``
    (models trained together), as a sequential one with ``why`` (summary.json); nothing outside."""
    coroutine = getattr(_current, "coroutine", None)
    if coroutine is not None:
        coroutine.note_sequential(1, why)


def paused_fit_running() -> bool:
    """Whether this code runs inside a client the batched executor may pause (its fit runs later)."""
    return getattr(_current, "coroutine", None) is not None
