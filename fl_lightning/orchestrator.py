"""FederationOrchestrator: the only round loop of the code base. It does no algorithm math.

Every random choice is drawn from a stream derived from (seed, round, client), so a resumed run
continues exactly where an uninterrupted one would be, and client order does not matter.
"""

from __future__ import annotations

import time
from typing import Any, Iterator

import numpy as np

from .checkpoint import rng_state, save_checkpoint, set_rng_state
from .client.context import ClientContext, derive_seed, seed_torch
from .client.loop import LocalLoop
from .data import FederatedData
from .errors import ConfigError
from .evaluation import Evaluator
from .ledger import CommunicationLedger
from .asynchrony import AsynchronousSchedule
from .sampling import ClientSampler
from .strategies.base import ServerContext, Strategy
from .tracking import RoundProgress, RunFiles, RunLogger
from .types import ClientSpec, ClientTask, ClientUpdate

SERVER_STREAM = 2**31 - 1  # the "client id" of the server's and the sampler's random streams


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
        self.run_info = run_info or {}
        self.client_states: dict[int, dict] = {}
        self.evaluator = Evaluator(loop, data, clients, self.client_states)
        self.ledger = CommunicationLedger()
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.elapsed = 0.0
        self.rounds_done = 0
        self.schedule = schedule
        if schedule is not None:
            if len(strategy.phases) > 1:
                raise ConfigError(
                    f"{type(strategy).__name__} has several phases per round and cannot run asynchronously."
                )
            schedule.setup(clients, derive_seed(seed, 0, SERVER_STREAM, 5))
        strategy.setup(ServerContext(clients, list(loop.slots), data, rounds, seed, loop))
        self.monitor = monitor or strategy.monitor

    # ------------------------------------------------------------------ the round loop
    def run(self, checkpoint: dict[str, Any] | None = None) -> dict[str, Any]:
        if checkpoint is not None:
            self._restore(checkpoint)
        progress = RoundProgress(self.progress_enabled, self.rounds, self.rounds_done, self.monitor)
        started = time.perf_counter() - self.elapsed
        try:
            for rnd in range(self.rounds_done + 1, self.rounds + 1):
                row = self._round(rnd)
                self.rounds_done = rnd
                self.elapsed = time.perf_counter() - started
                row["time/elapsed_s"] = self.elapsed
                evaluated = rnd % self.eval_every == 0 or rnd == self.rounds
                if evaluated:
                    row.update(self._evaluate(rnd))
                    self.history.append(row)
                    self.files.write_metrics(self.history)
                for logger in self.loggers:
                    logger.log_metrics({k: v for k, v in row.items() if k != "round"}, step=rnd)
                progress.update(rnd, row)
                stopping = self.stop_after is not None and rnd >= self.stop_after
                if rnd % self.checkpoint_every == 0 or rnd == self.rounds or stopping:
                    self._checkpoint()
                if stopping:
                    break
        finally:
            progress.close()
        return self._summary()

    def _round(self, rnd: int) -> dict[str, Any]:
        client_metrics: dict[str, list[float]] = {}
        server_metrics: dict[str, float] = {}
        if self.schedule is None:
            num_tasks = self._synchronous(rnd, client_metrics, server_metrics)
        else:
            num_tasks = self._asynchronous(rnd, client_metrics, server_metrics)
        traffic = self.ledger.per_round.get(rnd, {"uplink": 0, "downlink": 0})
        row: dict[str, Any] = {"round": rnd, "clients": num_tasks}
        row.update({f"train/{k}": float(np.mean(v)) for k, v in client_metrics.items()})
        if client_metrics:
            row["train/loss"] = float(np.mean([np.mean(v) for k, v in client_metrics.items() if k.endswith("loss")]))
        row.update(server_metrics)
        row.update(
            {
                "comm/round_uplink_bytes": traffic["uplink"],
                "comm/round_downlink_bytes": traffic["downlink"],
                "comm/uplink_bytes": self.ledger.uplink_bytes,
                "comm/downlink_bytes": self.ledger.downlink_bytes,
            }
        )
        return row

    def _synchronous(self, rnd: int, client_metrics: dict, server_metrics: dict) -> int:
        sampled = self.sampler.sample(
            rnd, self.clients, np.random.default_rng(derive_seed(self.seed, rnd, SERVER_STREAM, 2))
        )
        num_tasks = 0
        for number, phase in enumerate(self.strategy.phases):
            tasks = self.strategy.configure_round(rnd, sampled, phase)
            for task in tasks:
                task.phase = phase
            num_tasks += len(tasks)
            updates = self._client_updates(rnd, tasks, client_metrics)
            seed_torch(derive_seed(self.seed, rnd, SERVER_STREAM, 10 + number))  # server-side randomness
            server_metrics.update(self.strategy.aggregate(rnd, updates, phase) or {})
            if next(updates, None) is not None:
                raise RuntimeError(f"{type(self.strategy).__name__}.aggregate did not consume every client update")
        return num_tasks

    def _asynchronous(self, rnd: int, client_metrics: dict, server_metrics: dict) -> int:
        """Handles ``arrivals_per_round`` arrivals in simulated-time order (FedHe Algorithm 1)."""
        schedule = self.schedule
        if not schedule.started:  # every client (or `concurrency` of them) starts from the initial state
            rng = np.random.default_rng(derive_seed(self.seed, 0, SERVER_STREAM, 6))
            first = (
                self.clients
                if schedule.concurrency is None
                else [
                    self.clients[i] for i in np.sort(rng.choice(len(self.clients), schedule.concurrency, replace=False))
                ]
            )
            for client in first:
                self._dispatch(rnd, client, client_metrics)
            schedule.started = True
        staleness = []
        for _ in range(schedule.arrivals_per_round):
            arrival = schedule.pop()
            staleness.append(schedule.version - arrival.version)
            self.ledger.record(rnd, "uplink", arrival.update.uplink)
            seed_torch(derive_seed(self.seed, schedule.seq, SERVER_STREAM, 10))
            server_metrics.update(self.strategy.aggregate(rnd, iter([arrival.update])) or {})
            schedule.version += 1
            self._dispatch(rnd, self.clients[arrival.client_id], client_metrics)
        server_metrics.update(
            {
                "async/staleness_mean": float(np.mean(staleness)),
                "async/staleness_max": float(np.max(staleness)),
                "async/clock": schedule.clock,
            }
        )
        return len(staleness)

    def _dispatch(self, rnd: int, client: ClientSpec, client_metrics: dict) -> None:
        """Sends a client the current server state and computes its update, delivered at its arrival."""
        task = self.strategy.configure_round(rnd, [client])[0]
        stream = self.schedule.seq + 1
        update = self._run_client(rnd, task, client_metrics, stream)
        self.schedule.push(client.id, update, np.random.default_rng(derive_seed(self.seed, stream, client.id, 4)))

    def _client_updates(
        self, rnd: int, tasks: list[ClientTask], metrics: dict[str, list[float]]
    ) -> Iterator[ClientUpdate]:
        """Runs clients one at a time, as the strategy's ``aggregate`` asks for their updates."""
        for task in tasks:
            update = self._run_client(rnd, task, metrics)
            self.ledger.record(rnd, "uplink", update.uplink)
            yield update

    def _run_client(self, rnd: int, task: ClientTask, metrics: dict[str, list[float]], stream: int = 0) -> ClientUpdate:
        self.ledger.record(rnd, "downlink", task.downlink)
        client = task.client
        seed_torch(
            derive_seed(self.seed, rnd, client.id, 0, stream) if stream else derive_seed(self.seed, rnd, client.id, 0)
        )
        state = self.client_states.setdefault(client.id, {})
        ctx = ClientContext(client, rnd, self.loop, self.data, state, self.seed, stream)
        update = self.strategy.client_update(task, ctx)
        ctx.finish()
        if not state:
            del self.client_states[client.id]
        for key, value in update.metrics.items():
            metrics.setdefault(key, []).append(value)
        return update

    def _evaluate(self, rnd: int) -> dict[str, float]:
        metrics = self.strategy.evaluate(self.evaluator)
        if self.monitor not in metrics:
            raise ConfigError(
                f"monitor metric {self.monitor!r} is not among the evaluation metrics "
                f"{sorted(metrics)}; set --monitor to one of them."
            )
        if self.best is None or metrics[self.monitor] > self.best["metrics"][self.monitor]:
            self.best = {"round": rnd, "metrics": dict(metrics)}
        self.last_eval = {"round": rnd, "metrics": dict(metrics)}
        return metrics

    # ------------------------------------------------------------------ state
    def _checkpoint(self) -> None:
        state = {
            "rounds_done": self.rounds_done,
            "strategy": self.strategy.state_dict(),
            "client_states": self.client_states,
            "shared_optimizers": {r: s.optimizer.state_dict() for r, s in self.loop.slots.items()}
            if self.loop.training.optimizer_state == "shared"
            else {},
            "ledger": self.ledger.state_dict(),
            "history": self.history,
            "best": self.best,
            "last_eval": getattr(self, "last_eval", None),
            "elapsed": self.elapsed,
            "rng": rng_state(),
            "loggers": [logger.state_dict() for logger in self.loggers],
            "run_info": self.run_info,
            "schedule": self.schedule.state_dict() if self.schedule is not None else None,
        }
        save_checkpoint(self.files.last_checkpoint, state)

    def _restore(self, state: dict[str, Any]) -> None:
        saved_hash = state["run_info"].get("partition_sha256")
        if saved_hash and saved_hash != self.run_info.get("partition_sha256"):
            raise ConfigError(
                "the checkpoint was made with a different data partition (data, seed or population "
                "changed); resume with the original recipe or start a new --output_dir."
            )
        self.rounds_done = state["rounds_done"]
        self.strategy.load_state_dict(state["strategy"])
        self.client_states.clear()  # in place: the evaluator holds the same dict
        self.client_states.update(state["client_states"])
        for role, opt_state in state["shared_optimizers"].items():
            self.loop.slots[role].optimizer.load_state_dict(opt_state)
        self.ledger.load_state_dict(state["ledger"])
        self.history, self.best, self.elapsed = state["history"], state["best"], state["elapsed"]
        if state.get("last_eval") is not None:
            self.last_eval = state["last_eval"]
        set_rng_state(state["rng"])
        if self.schedule is not None:
            self.schedule.load_state_dict(state["schedule"])

    def _summary(self) -> dict[str, Any]:
        last = getattr(self, "last_eval", None)
        summary = {
            **{k: v for k, v in self.run_info.items()},
            "seed": self.seed,
            "rounds": self.rounds_done,
            "rounds_planned": self.rounds,
            "complete": self.rounds_done == self.rounds,
            "monitor": self.monitor,
            "final": last["metrics"] if last else {},
            "final_round": last["round"] if last else None,
            "best": self.best["metrics"] if self.best else {},
            "best_round": self.best["round"] if self.best else None,
            "comm": self.ledger.summary(),
            "wall_time_s": self.elapsed,
            "output_dir": str(self.files.root),
            "per_client_acc": {str(k): v for k, v in self.evaluator.per_client.items()},
        }
        self.files.write_json(self.files.summary, summary)
        return summary
