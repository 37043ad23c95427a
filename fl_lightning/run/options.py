"""What the orchestrator is told, in three groups: the round plan, how the clients execute, and what the run writes.

:func:`~fl_lightning.run.fit.fit` builds them once, at its top, from the recipe's options; a value that is wrong
fails there, in one sentence, before any data is loaded, and the orchestrator takes them as given. The fourth
group, what the run does about faulty clients, is :class:`~fl_lightning.run.robustness.Robustness`.

Example::

    plan = RoundPlan(rounds=50, eval_every=5)  # evaluates after rounds 5, 10, ..., 50
    plan.evaluates(10), plan.checkpoints(10), list(plan.rounds_to_run(48))  # True, True, [49, 50]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ..federation.errors import ConfigError

if TYPE_CHECKING:
    from ..client.training import LocalTraining
    from ..tracking import RunFiles, RunLogger
    from .asynchrony import AsynchronousSchedule
    from .runtime import Runtime


@dataclass(frozen=True)
class RoundPlan:
    """The run's rounds, and after which of them it evaluates, checkpoints and stops."""

    rounds: int
    """Communication rounds of the whole run."""
    eval_every: int = 1
    """Evaluate every k rounds, and after the last round."""
    checkpoint_every: int = 1
    """Checkpoint every k rounds, after the last round, and when this invocation stops early."""
    stop_after: int | None = None
    """End this invocation after this round (a job's time limit; resume later); None runs to the last round."""

    def __post_init__(self):
        for key in ("rounds", "eval_every", "checkpoint_every", "stop_after"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ConfigError(f"{key} must be at least 1, got {value}; e.g. --{key} 1.")

    def rounds_to_run(self, done: int) -> range:
        """The rounds this invocation runs once ``done`` rounds are done: up to the last, or to ``stop_after``;
        none when ``stop_after`` is at or before ``done`` (a job chain's rerun trains nothing)."""
        last = self.rounds if self.stop_after is None else min(self.rounds, self.stop_after)
        return range(done + 1, max(last, done) + 1)

    def evaluates(self, rnd: int) -> bool:
        """Whether round ``rnd`` ends with an evaluation."""
        return rnd % self.eval_every == 0 or rnd == self.rounds

    def stops_at(self, rnd: int) -> bool:
        """Whether this invocation ends after round ``rnd`` before the last round (``stop_after``)."""
        return self.stop_after is not None and rnd >= self.stop_after

    def checkpoints(self, rnd: int) -> bool:
        """Whether round ``rnd`` ends with a checkpoint."""
        return rnd % self.checkpoint_every == 0 or rnd == self.rounds or self.stops_at(rnd)


@dataclass(frozen=True)
class ExecutionPlan:
    """How the clients of a phase run in this process (from the recipe's ``runtime``)."""

    executor: Literal["sequential", "batched"] = "sequential"
    """``sequential``: one client after another; ``batched``: clients' local fits batched with ``torch.func.vmap``
    where their step allows it (``client/batched/``)."""
    batch_clients: int = 64
    """At most this many clients per batched computation."""
    lockstep: bool = False
    """Batched clients take every step together, their batches padded (``runtime.lockstep``)."""
    client_state_memory_mb: float | None = None
    """Megabytes of per-client state kept in memory; the rest waits in its files (``client_store.py``). None
    keeps it all in memory."""
    sequential_because: str | None = None
    """Why the clients run one after another although ``batched`` was asked for (``summary.json``'s
    ``executor.why``); None when they run as asked."""

    @classmethod
    def of(cls, runtime: Runtime, training: LocalTraining, schedule: AsynchronousSchedule | None) -> ExecutionPlan:
        """The plan of a recipe's ``runtime``: ``auto`` is sequential, and asynchronous rounds, which train one
        arrival at a time, have nothing to batch."""
        from .runtime import resolve_executor

        executor = resolve_executor(runtime, training)
        memory = runtime.client_state_memory_mb
        if executor == "batched" and schedule is not None:
            why = "asynchronous rounds train one arrival at a time"
            return cls("sequential", runtime.batch_clients, False, memory, sequential_because=why)
        return cls(executor, runtime.batch_clients, runtime.lockstep, memory)


@dataclass(frozen=True)
class RunOutput:
    """Where the run reports, and what its summary and checkpoints say about it."""

    files: RunFiles
    """The run directory: ``metrics.csv``, ``summary.json``, checkpoints."""
    loggers: list[RunLogger] = field(default_factory=list)
    """The started loggers: W&B, TensorBoard, the CSV logger (``resolve_loggers`` ends the list with it)."""
    progress: bool = True
    """Show the progress bar."""
    monitor: str | None = None
    """The metric that decides the best round; the strategy's own when None."""
    run_info: dict[str, Any] | None = None
    """Entries of ``summary.json`` that describe the run: name, run id, config hash, versions, hardware."""
    config: str | None = None
    """The resolved recipe (YAML), kept in checkpoints so that a resume can be compared with it."""
