"""How a phase's client tasks run: one after another, or batched (``runtime.executor``).

Batched mode runs each task's ``client_update`` as a coroutine: a thread that the executor lets run alone
until the client asks for a local fit. For the duration of a client's turn the coroutine is the loop's
``fit_runner`` (:mod:`fl_lightning.client.fit_runner`), so its ``ctx.fit`` hands the fit over: the fit is
paused (``FitRequest``: the client's tensors, modes, optimizer state and random state copied), the next
client runs up to its own fit, and when every client of the chunk has paused or finished, the paused fits
run together (``batched.BatchedFit``). Each client resumes with its own tensors restored into the shared
instances and continues to its next fit or its end. Strategies do not change: their ``client_update`` sees
the shared instances exactly as in the sequential loop. Threads are used only to suspend and resume a
client's Python frame; one runs at a time, handed over explicitly, so the order of everything is fixed and
runs are deterministic."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from .fit_request import (
    FitRequest,
    random_state,
    restore,
    restore_optimizer,
    set_random_state,
    snapshot_optimizer,
    snapshot_slots,
    training_modes,
)
from .fits import BatchedFit

if TYPE_CHECKING:
    from ..loop import LocalLoop
    from ..steps import ModelSlot, StepFn


class _Cancelled(BaseException):
    """Raised inside a paused client when the chunk stops (another client failed)."""


class _Coroutine:
    """A client task on its own thread, run only while the executor waits for it; during its turns it is the
    loop's fit runner (:class:`~fl_lightning.client.fit_runner.FitRunner`), which pauses it at each fit."""

    def __init__(self, job: Callable[[], Any], fits: BatchedFit, loop: LocalLoop):
        self.job, self.fits, self.loop = job, fits, loop
        self.request: FitRequest | None = None
        self.done, self.cancelled = False, False
        self.value: Any = None
        self.error: BaseException | None = None
        self.final_rng_state: tuple | None = None  # torch's random state as the client's task left it
        self._turn, self._yielded = threading.Event(), threading.Event()
        self._threads = torch.get_num_threads()  # a new thread starts with OpenMP's default, not the run's setting
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()

    def _main(self) -> None:
        torch.set_num_threads(self._threads)
        self._turn.wait()
        try:
            if not self.cancelled:
                self.value = self.job()
        except _Cancelled:
            pass
        except BaseException as err:  # noqa: BLE001 (any error, KeyboardInterrupt too, is raised again in the run's thread)
            self.error = err
        finally:
            self.final_rng_state = random_state()
            self.done = True
            self._yielded.set()

    def advance(self) -> None:
        """Lets the client run until it pauses at a fit or finishes (called by the executor's thread), its fits
        handed to this coroutine meanwhile."""
        self.loop.fit_runner = self
        self._yielded.clear()
        self._turn.set()
        self._yielded.wait()
        self.loop.fit_runner = None  # not on an interrupt: a client still running keeps pausing at its fits

    def run_fit(self, slot: ModelSlot, role: str, batches, rnd: int, step_fn: StepFn, on_record) -> dict:
        """Called on the client's thread by ``loop.fit``: copies what the fit needs, pauses the client until the
        executor has run the fit, and returns its result."""
        request = FitRequest(
            role=role,
            batches=batches,
            step_fn=step_fn,
            on_record=on_record,
            rnd=rnd,
            slots=snapshot_slots(self.loop),
            modes=training_modes(self.loop),
            optimizer_state=snapshot_optimizer(slot),
            rng_state=random_state(),
        )
        return self.pause(request).result

    def note_sequential(self, fits: int, why: str) -> None:
        """Counts fits the client's strategy ran itself (models trained together) as sequential ones."""
        self.fits.note_sequential(fits, why)

    def pause(self, request: FitRequest) -> FitRequest:
        """Called on the client's thread: hands the fit to the executor and waits for its result."""
        self.request = request
        self._turn.clear()  # cleared before yielding, so the executor's next set() cannot be lost
        self._yielded.set()
        self._turn.wait()
        if self.cancelled:
            raise _Cancelled
        finished, self.request = self.request, None
        return finished

    def cancel(self) -> None:
        """Stops the client: a paused one raises at its pause; one still running (the run was interrupted
        while it ran) is let run to its next pause or its end first."""
        self.cancelled = True
        while not self.done:
            self.advance()
        self._thread.join()


class BatchedExecutor:
    """Runs client tasks in chunks of ``chunk`` clients whose local fits are batched where possible (in
    ``lockstep``: every client of a group at every step, batches padded)."""

    def __init__(self, loop: LocalLoop, chunk: int, lockstep: bool = False):
        self.loop, self.chunk = loop, chunk
        self.fits = BatchedFit(loop, lockstep)

    def run(self, jobs: list[Callable[[], Any]]) -> Iterator[Any]:
        """Runs ``jobs`` (each one client's task) a chunk at a time; their values in order."""
        for start in range(0, len(jobs), self.chunk):
            yield from self._run_chunk(jobs[start : start + self.chunk])

    def _run_chunk(self, jobs: list[Callable[[], Any]]) -> list[Any]:
        coroutines = [_Coroutine(job, self.fits, self.loop) for job in jobs]
        last_fit: dict[str, tuple[int, FitRequest]] = {}  # per role, the fit of the latest client in task order
        try:
            for coroutine in coroutines:
                self._advance(coroutine)
            while True:
                paused = [(i, c, c.request) for i, c in enumerate(coroutines) if c.request is not None and not c.done]
                if not paused:
                    break
                self.fits.run([request for _, _, request in paused])
                for i, coroutine, request in paused:
                    if i >= last_fit.get(request.role, (-1,))[0]:
                        last_fit[request.role] = (i, request)
                    restore(self.loop, request)
                    set_random_state(request.rng_state)
                    self._advance(coroutine)
            # a shared optimizer state carries on from the last client in task order, as one after another
            for _, request in last_fit.values():
                restore_optimizer(self.loop, request)
            # and so does torch's random state: what the server draws next (MergedCodist's distillation) follows it
            final_rng_state = coroutines[-1].final_rng_state
            assert final_rng_state is not None, "every client's task has finished"
            set_random_state(final_rng_state)
        except BaseException:
            for coroutine in coroutines:
                if not coroutine.done:
                    coroutine.cancel()
            raise
        return [c.value for c in coroutines]

    @staticmethod
    def _advance(coroutine: _Coroutine) -> None:
        coroutine.advance()
        if coroutine.error is not None:
            raise coroutine.error
