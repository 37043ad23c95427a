"""What a run has done so far, and how it becomes a checkpoint, is restored from one and is summarized.

Also what a resume accepts: :func:`check_resume` compares the recipe a run was started (or last resumed)
with to the one it is resumed with, before anything in the run directory is written.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..federation.errors import ConfigError
from ..federation.ledger import CommunicationLedger
from ..federation.release import current_path
from .checkpoint import rng_state, save_checkpoint, set_rng_state
from .client_store import ClientStateStore

if TYPE_CHECKING:
    from ..client.loop import LocalLoop
    from ..strategies.base import Strategy
    from ..tracking import RunLogger
    from .asynchrony import AsynchronousSchedule

SAFE_TO_CHANGE = (
    "rounds",
    "logger",
    "runtime.progress",
    "runtime.client_state_memory_mb",
    "runtime.devices",
    "output_dir",
    "stop_after",
    "checkpoint_every",
    "name",
    "reference",
    "monitor",
)
"""Recipe keys a resume may change (``rounds`` only upward); docs/reference/resume.md says why each is safe."""

NEWER_KEYS = {"runtime.lockstep": False}
"""Recipe keys newer than some checkpoints, with the value the code before them ran as: a run saved without the key
resumes with that value as if nothing changed."""

_LOWER_IS_BETTER = ("loss", "_std", "top_class_share")


def lower_is_better(monitor: str) -> bool:
    """Whether the best round of ``monitor`` is its lowest: losses, spreads (``*_std``) and the collapse
    indicator ``*top_class_share``; every other metric (accuracies) is best at its highest."""
    return monitor.endswith(_LOWER_IS_BETTER)


def _better(value: float, best: float, monitor: str) -> bool:
    return value < best if lower_is_better(monitor) else value > best


class MissingMonitor(ConfigError):
    """An evaluation (of round ``round``, when known) without the monitored metric."""

    def __init__(self, monitor: str, metrics: dict[str, float], rnd: int | None = None):
        self.monitor, self.metrics, self.round = monitor, sorted(metrics), rnd
        super().__init__(
            f"monitor metric {monitor!r} is not among the evaluation metrics {self.metrics}; continue "
            "with --resume auto and --monitor set to one of them (a resume may change the monitor)."
        )


def check_monitor(monitor: str, metrics: dict[str, float], rnd: int | None = None) -> None:
    """Refuses a monitor the evaluations do not produce, naming those they do."""
    if monitor not in metrics:
        raise MissingMonitor(monitor, metrics, rnd)


class RankShare:
    """The local trainings each rank ran over the run (resumes included) and their clients: summary.json's
    ``ranks`` block, which says which ranks ran and what each trained. A client that crashed before training
    is no training. A rank counts its own (:meth:`trained`); with several ranks each phase's exchange carries
    them (:meth:`take`, :meth:`add`), so every rank, rank 0 that writes the checkpoint among them, holds all.

    Args:
        rank: this process's rank (0 for one process).
    """

    def __init__(self, rank: int = 0):
        self.rank = rank
        self.pending: list[int] = []  # this rank's trainings not yet counted (not yet exchanged)
        self.tasks: dict[int, int] = {}
        self.clients: dict[int, set[int]] = {}

    def trained(self, client_id: int) -> None:
        """Counts a local training of ``client_id`` on this rank."""
        self.pending.append(client_id)

    def take(self) -> list[int]:
        """This rank's trainings since the last call, for the phase's exchange."""
        taken, self.pending = self.pending, []
        return taken

    def add(self, rank: int, client_ids: list[int]) -> None:
        """Counts ``rank``'s trainings of ``client_ids``."""
        self.tasks[rank] = self.tasks.get(rank, 0) + len(client_ids)
        self.clients.setdefault(rank, set()).update(client_ids)

    def summary(self) -> list[dict[str, Any]]:
        """Every rank that trained, in rank order: ``rank``, ``trained_tasks``, ``clients`` (sorted ids)."""
        self.add(self.rank, self.take())
        return [
            {"rank": rank, "trained_tasks": self.tasks[rank], "clients": sorted(self.clients[rank])}
            for rank in sorted(self.tasks)
        ]

    def load(self, shares: list[dict[str, Any]]) -> None:
        """Continues from a checkpoint's :meth:`summary`."""
        for share in shares:
            self.tasks[share["rank"]] = share["trained_tasks"]
            self.clients[share["rank"]] = set(share["clients"])


class RunState:
    """Rounds done, metric history, best and last evaluation, elapsed time, client states, traffic and the
    local training compute.

    Args:
        client_dir: where the client-state files go (``<run>/checkpoints/clients``).
        run_info: entries for summary.json (name, hashes, versions, resumes), saved in checkpoints.
        config: the resolved recipe (YAML), saved in checkpoints so a resume can be compared with it.
        client_state_memory_mb: megabytes of client state kept in memory (None: all of it).
        device: the Fabric device (where client states read back from their files go).
    """

    def __init__(
        self,
        client_dir: Path,
        run_info: dict[str, Any] | None = None,
        config: str | None = None,
        client_state_memory_mb: float | None = None,
        device: Any = "cpu",
        rank: int = 0,
    ):
        self.run_info = run_info or {}
        self.shares = RankShare(rank)  # the local trainings of each rank
        self.config = config
        self.rounds_done = 0
        self.history: list[dict[str, Any]] = []
        self.best: dict[str, Any] | None = None
        self.last_eval: dict[str, Any] | None = None
        self.elapsed = 0.0
        # handed to clients as ctx.state and to the evaluator; checkpoints name its files (client_store.py)
        self.client_states = ClientStateStore(client_dir, client_state_memory_mb, device)
        self.ledger = CommunicationLedger()
        self.privacy: dict[str, Any] | None = None  # the privacy mechanism's state (its noise multiplier), if any
        self.events: dict[str, int] = {}  # lost updates over the run, by cause (robustness.py)
        self.train_flops: int | None = 0  # the clients' local training FLOPs so far (client/flops.py); None: unknown

    def record_evaluation(
        self, rnd: int, metrics: dict[str, float], monitor: str, per_client: dict[int, float] | None = None
    ) -> None:
        """Keeps the evaluation (``per_client``: each client's personal accuracy, for summary.json; kept in
        checkpoints so that a resumed run's summary has them without evaluating again)."""
        check_monitor(monitor, metrics, rnd)
        value = metrics[monitor]  # NaN (no client evaluated) never becomes the best
        if not math.isnan(value) and (self.best is None or _better(value, self.best["metrics"][monitor], monitor)):
            self.best = {"round": rnd, "metrics": dict(metrics), "monitor": monitor}
        self.last_eval = {"round": rnd, "metrics": dict(metrics), "per_client": dict(per_client or {})}

    def use_monitor(self, monitor: str) -> None:
        """A resumed run's best round by ``monitor``: the checkpoint's if it was chosen by the same metric, else
        found again among the evaluations so far (a resume may change the monitor)."""
        if self.last_eval is None or (self.best is not None and self.best.get("monitor") == monitor):
            return
        keys = set(self.last_eval["metrics"])
        check_monitor(monitor, self.last_eval["metrics"])  # refused now, not silently at the end
        self.best, best_value = None, None
        for row in self.history:  # every evaluated round, in order: the first of equal values stays the best
            value = row.get(monitor)
            if value is None or math.isnan(value):
                continue
            if best_value is None or _better(value, best_value, monitor):
                best_value = value
                metrics = {k: v for k, v in row.items() if k in keys}
                self.best = {"round": row["round"], "metrics": metrics, "monitor": monitor}

    # ------------------------------------------------------------------ checkpoints
    def checkpoint(
        self,
        strategy: Strategy,
        loop: LocalLoop,
        loggers: list[RunLogger],
        schedule: AsynchronousSchedule | None,
    ) -> dict[str, Any]:
        """Everything a resume needs, as tensors and plain containers (see ``checkpoint.py``).

        The client states are written to their files here (those that changed); the checkpoint names them.
        """
        shared = loop.training.optimizer_state in ("shared", "shared_per_phase")
        return {
            "rounds_done": self.rounds_done,
            "strategy": strategy.state_dict(),
            "client_states": self.client_states.manifest(),
            "shared_optimizers": {r: s.optimizer.state_dict() for r, s in loop.slots.items()} if shared else {},
            "ledger": self.ledger.state_dict(),
            "events": dict(self.events),
            "ranks": self.shares.summary(),
            "train_flops": self.train_flops,
            "history": self.history,
            "best": self.best,
            "last_eval": self.last_eval,
            "elapsed": self.elapsed,
            "rng": rng_state(),
            "loggers": [logger.state_dict() for logger in loggers],
            "run_info": self.run_info,
            "config": self.config,
            "schedule": schedule.state_dict() if schedule is not None else None,
            **({"privacy": self.privacy} if self.privacy is not None else {}),
        }

    def save(
        self,
        path: Path,
        strategy: Strategy,
        loop: LocalLoop,
        loggers: list[RunLogger],
        schedule: AsynchronousSchedule | None,
    ) -> None:
        """Writes the checkpoint to ``path`` (client files first), then deletes client files no kept one names."""
        save_checkpoint(path, self.checkpoint(strategy, loop, loggers, schedule))
        self.client_states.saved()

    def restore(
        self, state: dict[str, Any], strategy: Strategy, loop: LocalLoop, schedule: AsynchronousSchedule | None
    ) -> None:
        """Loads a checkpoint into this run (after :func:`check_resume` accepted it)."""
        self.rounds_done = state["rounds_done"]
        strategy.load_state_dict(state["strategy"])
        self.client_states.restore(state["client_states"], state.get("loaded_from"))  # the evaluator holds it too
        for role, opt_state in state["shared_optimizers"].items():
            loop.slots[role].optimizer.load_state_dict(opt_state)
        self.ledger.load_state_dict(state["ledger"])
        self.events = dict(state.get("events", {}))  # checkpoints written before faults existed have none
        self.shares.load(state.get("ranks", []))  # a checkpoint written before the ranks block: from here on
        if self.train_flops is not None:  # a checkpoint written before the compute estimate: unknown from here on
            self.train_flops = state.get("train_flops")
        self.history, self.best, self.elapsed = state["history"], state["best"], state["elapsed"]
        self.last_eval = state["last_eval"]
        set_rng_state(state["rng"])
        self.privacy = state.get("privacy")
        if schedule is not None:
            schedule.load_state_dict(state["schedule"])

    def summary(self, seed: int, rounds: int, monitor: str, output_dir: Path) -> dict[str, Any]:
        """The content of summary.json."""
        last, best = self.last_eval, self.best
        per_client = last.get("per_client", {}) if last else {}  # a checkpoint of before 2026-11-26 has none
        return {
            **self.run_info,
            "seed": seed,
            "rounds": self.rounds_done,
            "rounds_planned": rounds,
            "complete": self.rounds_done == rounds,
            "monitor": monitor,
            "final": last["metrics"] if last else {},
            "final_round": last["round"] if last else None,
            "best": best["metrics"] if best else {},
            "best_round": best["round"] if best else None,
            "comm": self.ledger.summary(),
            "wall_time_s": self.elapsed,
            "output_dir": str(output_dir),
            "per_client_acc": {str(k): v for k, v in per_client.items()},
        }


def planned_rounds(checkpoint: dict[str, Any]) -> int | None:
    """The ``rounds`` of the recipe saved in ``checkpoint`` (None when it has none: ``fit`` called without the CLI)."""
    if checkpoint.get("config") is None:
        return None
    rounds = _load_yaml(checkpoint["config"]).get("rounds")
    return rounds if isinstance(rounds, int) else None


def check_resume(
    checkpoint: dict[str, Any], run_info: dict[str, Any], config: str | None, rounds: int, where: Path
) -> list[dict[str, Any]]:
    """Refuses a resume that would silently change the run; returns the run's ``resumed_with`` record.

    Args:
        checkpoint: the loaded checkpoint.
        run_info: this invocation's run info (its partition hash).
        config: this invocation's resolved recipe; None when ``fit`` is called without the CLI (then only
            the partition and the rounds are checked).
        rounds: this invocation's ``rounds``.
        where: the run directory, for the messages.

    Returns:
        The earlier resumes' changes plus this one's (``{"round", "changed": {key: [old, new]}}``), when any.
    """
    saved_info = checkpoint["run_info"]
    saved_hash = saved_info.get("partition_sha256")
    if saved_hash and saved_hash != run_info.get("partition_sha256"):
        named = ""
        if config is not None and checkpoint.get("config") is not None:
            changed = _changed_keys(_load_yaml(checkpoint["config"]), _load_yaml(config))
            keys = [k for k in changed if k.split(".")[0] in ("data", "seed", "population")]
            named = "".join(f", {k} ({changed[k][0]!r} -> {changed[k][1]!r})" for k in keys[:4])
        raise ConfigError(
            f"cannot resume {where}: the checkpoint was made with a different data partition (data, seed or "
            f"population changed{named}); resume with the original recipe or start a new --output_dir."
        )
    done = checkpoint["rounds_done"]
    if rounds < done:
        raise ConfigError(
            f"cannot resume {where} with rounds {rounds}: it has already run {done} rounds; pass --rounds {done} "
            "or more, or start a new --output_dir."
        )
    resumes = list(saved_info.get("resumed_with", []))
    if config is None or checkpoint.get("config") is None:
        return resumes
    changed = _changed_keys(_load_yaml(checkpoint["config"]), _load_yaml(config))
    changed = {k: v for k, v in changed.items() if not (k in NEWER_KEYS and v == (None, NEWER_KEYS[k]))}
    refused = {k: v for k, v in changed.items() if not _safe(k, *v)}
    if refused:
        shown = ", ".join(f"{k} ({old!r} -> {new!r})" for k, (old, new) in list(refused.items())[:6])
        more = f" and {len(refused) - 6} more" if len(refused) > 6 else ""
        raise ConfigError(
            f"cannot resume {where}: the recipe changed {shown}{more}; resume with the recipe in "
            f"{where / 'config.yaml'}, change only {', '.join(SAFE_TO_CHANGE)} (rounds only upward), "
            "or start a new --output_dir."
        )
    recorded = {k: [old, new] for k, (old, new) in changed.items() if k != "resume"}
    if recorded:
        resumes.append({"round": done, "changed": recorded})
    return resumes


def _safe(key: str, old: Any, new: Any) -> bool:
    if key == "rounds":
        return isinstance(old, int) and isinstance(new, int) and new >= old
    return key == "resume" or any(key == safe or key.startswith(safe + ".") for safe in SAFE_TO_CHANGE)


def _load_yaml(text: str) -> dict[str, Any]:
    from .safe_yaml import load_text  # a checkpoint may come from anyone: its recipe is read as any handed-over YAML

    loaded = load_text(text, "the recipe saved in the checkpoint")
    return loaded if isinstance(loaded, dict) else {}


def _changed_keys(old: Any, new: Any, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    """Dotted keys whose values differ between two nested dicts (lists compare whole).

    A class path at a module's old location (a run recorded before the package was laid out by concern) equals
    the same class at its new one.
    """
    if isinstance(old, dict) and isinstance(new, dict):
        changed: dict[str, tuple[Any, Any]] = {}
        for key in {**old, **new}:
            changed.update(_changed_keys(old.get(key), new.get(key), f"{prefix}{key}."))
        return changed
    if isinstance(old, str) and isinstance(new, str) and current_path(old) == current_path(new):
        return {}
    return {prefix.rstrip("."): (old, new)} if old != new else {}
