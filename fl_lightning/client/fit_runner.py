"""Who runs a client's local fit: ``LocalLoop`` runs it at once, unless a :class:`FitRunner` holds the loop.

The batched executor (:mod:`fl_lightning.client.batched.executor`) runs each client's ``client_update`` as a
coroutine. For the duration of a client's turn it sets that client as the loop's ``fit_runner``: the client's
``ctx.fit(...)`` then hands the fit over (the client pauses) and returns its result once the executor has run it
together with other clients' fits. Outside a turn ``loop.fit_runner`` is None and every fit runs at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .steps import ModelSlot, StepFn


class FitRunner(Protocol):
    """Runs the local fits that ``LocalLoop.fit`` hands over, later, with other clients' fits."""

    def run_fit(
        self,
        slot: ModelSlot,
        role: str,
        batches: Iterable[tuple],
        rnd: int,
        step_fn: StepFn,
        on_record: Callable[[tuple], None] | None,
    ) -> dict[str, Any]:
        """Takes the fit of ``slot`` (of ``role``) on ``batches``; returns its result (``loss``, ``steps``) once it
        has run. The caller's tensors are as the fit left them when it returns."""
        ...

    def note_sequential(self, fits: int, why: str) -> None:
        """Counts ``fits`` the client's strategy ran itself, outside ``LocalLoop.fit``, as sequential ones."""
        ...
