"""FederationOrchestrator: the only round loop of the code base. It does no algorithm math.

Every random choice is drawn from a stream derived from (seed, round, client, purpose) (``seeding.py``),
so a resumed run continues exactly where an uninterrupted one would be, and client order does not matter.
What the run has done so far (history, client states, traffic) lives in a :class:`RunState`; the
asynchronous round body lives next to its schedule in ``asynchrony.py``.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from ..client.batched.executor import BatchedExecutor
from ..client.context import ClientContext
from ..client.evaluation import Evaluator, PersonalEvaluation
from ..client.flops import role_step_flops
from ..client.loop import LocalLoop
from ..data import FederatedData
from ..distributed.ranks import check_shardable, current_ranks
from ..federation.errors import ConfigError
from ..federation.sampling import ClientSampler
from ..federation.seeding import Owner, Stream, derive_seed, seed_torch, server_phase
from ..federation.types import ClientSpec, ClientTask, ClientUpdate
from ..strategies.base import ServerContext, Strategy, check_evaluation_split
from ..tracking import RoundProgress, RunFiles, RunLogger
from .asynchrony import AsynchronousRounds, AsynchronousSchedule
from .client_store import CLIENTS_DIR
from .robustness import FAULT_KINDS, FIX, Diverged, Faults, nonfinite_metrics, nonfinite_parts, poison
from .sharding import ShardedPhases
from .state import RunState

STEPS = "steps/"  # events[STEPS + role]: the training steps of a role's clients this round


class FederationOrchestrator:
    """Runs rounds: sample -> configure -> local updates -> aggregate -> evaluate -> log -> checkpoint.

    Args:
        strategy: the federated algorithm.
        clients: the population's clients.
        sampler: picks each round's clients.
        loop: the local training loop (owns one model instance per role).
        data: the federated data, already set up.
        files: the run directory.
        loggers: W&B / TensorBoard loggers (CSV is written by ``files``).
        rounds: total rounds.
        seed: the run seed.
        eval_every: evaluate every k rounds (and always after the last round).
        checkpoint_every: checkpoint every k rounds (and at the end or when stopping early).
        stop_after: end this invocation after that round (resume later with ``--resume auto``).
        monitor: metric deciding the best round; the strategy's default when not given.
        progress: show the rich progress bar.
        run_info: extra entries for summary.json (name, config hash, versions).
        schedule: asynchronous mode (simulated clock and client speeds); synchronous rounds when None.
        config: the resolved recipe (YAML), kept in checkpoints so that a resume can be compared with it.
        evaluation: which clients a personalized evaluation covers (all of them at every evaluation by default).
        client_state_memory_mb: megabytes of per-client state kept in memory; the rest waits in its files
            (``client_store.py``). None keeps it all in memory.
        executor: ``sequential`` (one client after another) or ``batched`` (clients' local fits batched
            with ``torch.func.vmap`` where their step allows it; ``client/batched/``).
        batch_clients: at most this many clients per batched computation.
        lockstep: batched clients take every step together, their batches padded (``runtime.lockstep``).
        faults: faults injected into the clients (``robustness.Faults``); none when None.
        divergence: what a non-finite client update does: ``stop`` the run (exit 2) or ``drop`` the update.
    """

    def __init__(
        self,
        strategy: Strategy,
        clients: list[ClientSpec],
        sampler: ClientSampler,
        loop: LocalLoop,
        data: FederatedData,
        files: RunFiles,
        loggers: list[RunLogger],
        rounds: int,
        seed: int,
        eval_every: int = 1,
        checkpoint_every: int = 1,
        stop_after: int | None = None,
        monitor: str | None = None,
        progress: bool = True,
        run_info: dict[str, Any] | None = None,
        schedule: AsynchronousSchedule | None = None,
        config: str | None = None,
        evaluation: PersonalEvaluation | None = None,
        client_state_memory_mb: float | None = None,
        executor: str = "sequential",
        batch_clients: int = 64,
        lockstep: bool = False,
        faults: Faults | None = None,
        divergence: str = "stop",
    ):
        if rounds < 1:
            raise ConfigError(f"rounds must be at least 1, got {rounds}.")
        if eval_every < 1 or checkpoint_every < 1:
            raise ConfigError("eval_every and checkpoint_every must be at least 1.")
        self.strategy, self.clients, self.sampler = strategy, clients, sampler
        self.loop, self.data, self.files, self.loggers = loop, data, files, loggers
        self.rounds, self.seed = rounds, seed
        self.eval_every, self.checkpoint_every, self.stop_after = eval_every, checkpoint_every, stop_after
        self.progress_enabled = progress
        if divergence not in ("stop", "drop"):
            raise ConfigError(f"divergence must be stop or drop, got {divergence!r}.")
        if faults is not None:
            faults.check_clients(len(clients))
        self.faults, self.divergence = faults, divergence
        # per-round counts of lost updates; logged only when something can be lost, so default rows keep their columns
        self.event_keys = (*(FAULT_KINDS if faults else ()), "dropped_nonfinite", "phases_without_updates")
        # per-round counts the ranks add up: the lost updates by cause, and each role's training steps (STEPS + role)
        self.events: dict[str, int] = {}
        self.ranks = current_ranks()  # one process, or one of several that share each phase's clients
        client_dir = files.checkpoints / CLIENTS_DIR if self.ranks.writes else self.ranks.scratch  # rank 0 alone
        self.state = RunState(client_dir, run_info, config, client_state_memory_mb, loop.fabric.device)
        self.evaluator = Evaluator(loop, data, clients, self.state.client_states, evaluation, seed)
        self.schedule = schedule
        if executor not in ("sequential", "batched"):
            raise ConfigError(f"executor must be sequential or batched, got {executor!r}.")
        # asynchronous rounds run one arrival at a time: nothing to batch there (summary.json says so)
        batching = executor == "batched" and schedule is None
        self.batched = BatchedExecutor(loop, batch_clients, lockstep) if batching else None
        asked = executor == "batched" and schedule is not None
        self.unbatched = "asynchronous rounds train one arrival at a time" if asked else None
        self.asynchronous = (
            AsynchronousRounds(schedule, strategy, clients, self.state.ledger, seed, self._run_client, faults)
            if schedule is not None
            else None
        )
        self.sharded = None
        if self.ranks.world > 1:
            check_shardable(self.ranks.world, schedule, loop.training.optimizer_state)

            def crashes(rnd: int, task: ClientTask) -> bool:  # a crashing client never trains
                return faults is not None and faults.draw(seed, rnd, task.client.id) == "crash"

            self.sharded = ShardedPhases(self.ranks, self.state, loop, crashes, strategy.state_dict)
        server = ServerContext(clients, list(loop.slots), data, rounds, seed, loop)
        strategy.setup(server)
        check_evaluation_split(strategy, server)
        self.monitor = monitor or strategy.monitor
        # after setup, which may freeze a backbone: a frozen parameter's gradient is not computed, nor counted
        models = {role: slot.module.model for role, slot in loop.slots.items()}
        self.step_flops, self.uncounted = role_step_flops(models, data.x[:1], loop.training.batch_size)
        if self.uncounted:
            self.state.train_flops = None  # a role's steps without their cost: no total rather than a low one

    # ------------------------------------------------------------------ the round loop
    def run(self, checkpoint: dict[str, Any] | None = None) -> dict[str, Any]:
        """Runs the remaining rounds (all of them, or those after ``checkpoint``); returns the summary."""
        state = self.state
        if checkpoint is not None:
            state.restore(checkpoint, self.strategy, self.loop, self.schedule)
            state.use_monitor(self.monitor)
        else:
            state.client_states.start()  # client files a killed start left behind go
        progress = RoundProgress(
            self.progress_enabled, self.rounds, state.rounds_done, self.monitor, self.loop.fabric.device.type
        )
        self.progress = progress
        started = time.perf_counter() - state.elapsed
        try:
            # a resume past its --stop_after round trains nothing (a job chain's rerun), and rewrites the summary
            last = self.rounds if self.stop_after is None or self.stop_after > state.rounds_done else state.rounds_done
            for rnd in range(state.rounds_done + 1, last + 1):
                progress.start_round(rnd)
                row = self._round(rnd)
                metrics = None
                if rnd % self.eval_every == 0 or rnd == self.rounds:
                    self.evaluator.begin(rnd, final=rnd == self.rounds)
                    metrics = {**self.strategy.evaluate(self.evaluator), **self.evaluator.validation_metrics()}
                self._check_finite(rnd, {**row, **(metrics or {})})
                state.rounds_done = rnd
                state.elapsed = time.perf_counter() - started
                row["time/elapsed_s"] = state.elapsed
                if metrics is not None:
                    state.record_evaluation(rnd, metrics, self.monitor, self.evaluator.per_client)
                    row.update(metrics)
                    state.history.append(row)
                    if self.ranks.writes:
                        self.files.write_metrics(state.history)
                for logger in self.loggers:
                    logger.log_metrics({k: v for k, v in row.items() if k != "round"}, step=rnd)
                progress.update(rnd, row)
                stopping = self.stop_after is not None and rnd >= self.stop_after
                if (rnd % self.checkpoint_every == 0 or rnd == self.rounds or stopping) and self.ranks.writes:
                    state.save(self.files.last_checkpoint, self.strategy, self.loop, self.loggers, self.schedule)
                if stopping:
                    break
        except Diverged as err:  # the last good checkpoint stays; the summary says what happened, never a null
            self._write_summary({"diverged": True, "diverged_round": err.round, "diverged_reason": str(err)})
            raise
        finally:
            progress.close()
        return self._write_summary({"diverged": False})

    def _write_summary(self, extra: dict[str, Any]) -> dict[str, Any]:
        state = self.state
        summary = state.summary(self.seed, self.rounds, self.monitor, self.files.root)
        summary.update(extra)
        if self.batched is not None:  # how many local fits really ran batched (the rest could not)
            summary["executor"] = {"mode": "batched", **self.batched.fits.counts}
            if self.batched.fits.sequential_reasons:
                summary["executor"]["sequential_reasons"] = dict(self.batched.fits.sequential_reasons)
            if self.batched.fits.lockstep is not None:  # steps of all of a group's clients, and how many padded
                summary["executor"]["lockstep"] = self.batched.fits.lockstep.summary()
        elif self.unbatched is not None:  # batched was asked for and could not be
            summary["executor"] = {"mode": "sequential", "why": self.unbatched}
        if self.loop.graphs is not None:  # how many steps were replayed from CUDA graphs, and why others were not
            summary["cuda_graphs"] = self.loop.graphs.summary()
        if self.faults is not None or self.divergence == "drop":
            summary["faults"] = {k: state.events.get(k, 0) for k in self.event_keys}
        summary["compute"] = {"train_flops": state.train_flops, "step_flops": dict(self.step_flops)}
        if self.uncounted:
            summary["compute"]["not_counted"] = dict(self.uncounted)
        if self.ranks.writes:
            self.files.write_json(self.files.summary, summary)
        return summary

    def _check_finite(self, rnd: int, row: dict[str, Any]) -> None:
        """Stops the run when the server's or an evaluation's metrics are not finite (whatever the policy)."""
        bad = nonfinite_metrics(row)
        if bad:
            raise Diverged(
                f"round {rnd} diverged: {', '.join(sorted(bad)[:4])} {'is' if len(bad) == 1 else 'are'} not finite "
                f"(the server state or an evaluation); {FIX.split(', or set')[0]}.",
                rnd,
            )

    def _round(self, rnd: int) -> dict[str, Any]:
        client_metrics: dict[str, list[float]] = {}
        server_metrics: dict[str, float] = {}
        self.events = {}
        if self.asynchronous is None:
            num_tasks = self._synchronous(rnd, client_metrics, server_metrics)
        else:
            num_tasks = self.asynchronous.run_round(rnd, client_metrics, server_metrics)
        ledger = self.state.ledger
        traffic = ledger.per_round.get(rnd, {"uplink": 0, "downlink": 0})
        steps = {key[len(STEPS) :]: self.events.pop(key) for key in list(self.events) if key.startswith(STEPS)}
        row: dict[str, Any] = {"round": rnd, "clients": num_tasks}
        row.update({f"train/{k}": float(np.mean(v)) for k, v in client_metrics.items()})
        if client_metrics:
            row["train/loss"] = float(np.mean([np.mean(v) for k, v in client_metrics.items() if k.endswith("loss")]))
        row.update(server_metrics)
        if self.faults is not None or self.divergence == "drop":
            row.update({f"faults/{k}": self.events.get(k, 0) for k in self.event_keys})
            for key, count in self.events.items():
                self.state.events[key] = self.state.events.get(key, 0) + count
        row.update(
            {
                "comm/round_uplink_bytes": traffic["uplink"],
                "comm/round_downlink_bytes": traffic["downlink"],
                "comm/uplink_bytes": ledger.uplink_bytes,
                "comm/downlink_bytes": ledger.downlink_bytes,
                "comm/mib_per_client": (ledger.uplink_bytes + ledger.downlink_bytes) / len(self.clients) / 2**20,
            }
        )
        if self.state.train_flops is not None:  # None: a role's step could not be counted (summary.json says why)
            self.state.train_flops += sum(n * self.step_flops[role] for role, n in steps.items())
            row["compute/train_flops"] = self.state.train_flops
            row["compute/gflops_per_client"] = self.state.train_flops / len(self.clients) / 1e9
        return row

    def _synchronous(self, rnd: int, client_metrics: dict[str, list[float]], server_metrics: dict[str, float]) -> int:
        """One synchronous round: every phase's tasks, their updates streamed into ``aggregate``."""
        rng = np.random.default_rng(derive_seed(self.seed, rnd, Owner.SERVER, Stream.SAMPLER))
        sampled = self.sampler.sample(rnd, self.clients, rng)
        num_tasks = 0
        for number, phase in enumerate(self.strategy.phases):
            tasks = self.strategy.configure_round(rnd, sampled, phase)
            for task in tasks:
                task.phase = phase
            num_tasks += len(tasks)
            self.progress.start_phase(phase, len(tasks))
            if self.sharded is None:
                updates = self._client_updates(rnd, tasks, client_metrics)
            else:  # this rank trains its share; every rank gets every update, in task order (sharding.py)
                updates = self.sharded.updates(
                    rnd, tasks, self._client_updates, client_metrics, self.events, self.progress
                )
            if self.faults is not None or self.divergence == "drop":  # updates may be lost: is any left?
                first = next(updates, None)
                if first is None:  # the server keeps its state; aggregate never sees an empty phase
                    self._count("phases_without_updates")
                    continue
                updates = itertools.chain([first], updates)
            seed_torch(derive_seed(self.seed, rnd, Owner.SERVER, server_phase(number)))  # server-side randomness
            server_metrics.update(self.strategy.aggregate(rnd, updates, phase) or {})
            if next(updates, None) is not None:
                raise RuntimeError(f"{type(self.strategy).__name__}.aggregate did not consume every client update")
        return num_tasks

    def _client_updates(
        self, rnd: int, tasks: list[ClientTask], metrics: dict[str, list[float]]
    ) -> Iterator[ClientUpdate]:
        """Runs clients (one at a time, or a chunk batched) as the strategy's ``aggregate`` asks for their updates."""
        self.loop.begin_phase()
        if self.batched is None:
            updates = (self._run_client(rnd, task, metrics) for task in tasks)
        else:
            updates = self.batched.run([functools.partial(self._run_client, rnd, task, metrics) for task in tasks])
        for update in updates:
            if update is not None:  # a lost update sends nothing
                self.state.ledger.record(rnd, "uplink", update.uplink)
                yield update

    def _run_client(
        self, rnd: int, task: ClientTask, metrics: dict[str, list[float]], stream: int = 0
    ) -> ClientUpdate | None:
        """Runs one client's task with its own random streams (``stream`` > 0: one of several in a round).

        Returns None when the update is lost: an injected fault, or a non-finite update under ``divergence: drop``.
        """
        self.state.ledger.record(rnd, "downlink", task.downlink)
        client = task.client
        fault = self.faults.draw(self.seed, rnd, client.id, stream) if self.faults is not None else None
        if fault == "crash":  # it fails before sending anything: its state stays as it was
            self._count("crash")
            self.progress.client_done()
            return None
        seed_torch(derive_seed(self.seed, rnd, client.id, Stream.DROPOUT, *((stream,) if stream else ())))
        client_states = self.state.client_states
        ctx = ClientContext(client, rnd, self.loop, self.data, client_states.open(client.id), self.seed, stream)
        update = self.strategy.client_update(task, ctx)
        ctx.finish()
        for role, steps in ctx.trained_steps.items():  # trained, whether or not its update arrives
            self.events[STEPS + role] = self.events.get(STEPS + role, 0) + steps
        client_states.close(client.id, ctx.state)  # kept, or written to its file beyond the memory budget
        self.progress.client_done()
        if fault == "nan":
            self._count("nan")
            poison(update)
        elif fault == "drop_upload" or (fault == "straggle" and self.asynchronous is None):
            self._count(fault)  # trained, but the server never receives it (past the deadline, or lost)
            return None
        elif fault == "straggle":
            self._count(fault)  # asynchronous mode: it arrives late (AsynchronousRounds delays it)
        bad = nonfinite_parts(update)
        if bad:
            if self.divergence == "stop":
                injected = " (an injected nan fault)" if fault == "nan" else ""
                raise Diverged(
                    f"round {rnd} diverged: client {client.id} sent non-finite {', '.join(bad[:4])}{injected}; {FIX}.",
                    rnd,
                )
            self._count("dropped_nonfinite")
            return None
        for key, value in update.metrics.items():
            metrics.setdefault(key, []).append(value)
        return update

    def _count(self, event: str) -> None:
        self.events[event] = self.events.get(event, 0) + 1
