"""``flrun table paper-001/table-5``: runs what a paper table still lacks, then builds the table.

The table's cells are those the recipes' ``reference`` blocks name (:mod:`fl_lightning.report.tables`). Cells
that are the same experiment (a recipe made of a ``base:`` recipe and a reference) run once, as the recipe
of their own, wherever its table is, since the runs of either fill both. Each (recipe, seed) is the run
directory ``<runs>/<paper>/<recipe>/seed<k>``, shared by the paper's tables: a complete run of the same
recipe and arguments is skipped, any other is started with ``--resume auto`` (an interrupted one continues,
one with more rounds is extended, a changed recipe is refused by ``flrun fit``), so running the command again
finishes the table. Every run is its own ``flrun fit`` process, its output appended to ``seed<k>.log`` beside
its directory, which it holds locked while it runs; with ``--n_jobs K`` K of them run at once, each on one
GPU of the machine (:mod:`fl_lightning.distributed.gpu_share`), as a sweep's workers do. The table is built from the
planned runs that are complete.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from ..distributed.capacity import check_memory
from ..distributed.gpu_share import as_child, environment_for, least_used, raise_interrupt, visible_gpus
from ..federation.errors import ConfigError
from ..report.tables import _experiments, recipe_cells

# set per run by the table itself: from the fit arguments they would make every seed one run
RESERVED = ("--seed", "--output_dir", "--resume", "--config")


@dataclass
class TableRun:
    """One recipe at one seed, in its run directory."""

    recipe: Path
    seed: int
    output_dir: Path

    @property
    def name(self) -> str:
        return f"{self.recipe.stem} seed {self.seed}"

    @property
    def log(self) -> Path:
        return self.output_dir.with_name(f"seed{self.seed}.log")

    def fit_argv(self, fit_args: list[str]) -> list[str]:
        """The ``flrun fit`` arguments of this run."""
        argv = ["--config", str(self.recipe), "--seed", str(self.seed), "--output_dir", str(self.output_dir)]
        return [*argv, "--runtime.progress", "false", "--resume", "auto", *fit_args]

    def summary(self) -> dict[str, Any]:
        try:
            return json.loads((self.output_dir / "summary.json").read_text())
        except (OSError, ValueError):
            return {}

    def state(self, fit_args: list[str]) -> str:
        """``done`` (complete, with this recipe and these arguments), ``changed`` (complete, but the recipe or
        the arguments changed since: ``flrun fit`` extends it or refuses), ``resume`` (a checkpoint to
        continue) or ``new``."""
        summary = self.summary()
        if summary.get("complete") and summary.get("config_sha256") == self._config_sha256():
            return "done" if self._same_experiment(fit_args) else "changed"
        # no summary, an unfinished one, or one of an earlier invocation (its recipe is not config.yaml's: a later
        # invocation, e.g. one extending the rounds, started and has not finished)
        return "resume" if (self.output_dir / "checkpoints" / "last.ckpt").is_file() else "new"

    def _config_sha256(self) -> str | None:
        try:
            return hashlib.sha256((self.output_dir / "config.yaml").read_bytes()).hexdigest()
        except OSError:
            return None

    def _same_experiment(self, fit_args: list[str]) -> bool:
        from ..run.arguments import parse_fit
        from ..run.state import SAFE_TO_CHANGE, _changed_keys

        try:
            saved = yaml.safe_load((self.output_dir / "config.yaml").read_text()) or {}
        except (OSError, yaml.YAMLError):
            return False
        _, _, resolved = parse_fit(self.fit_argv(fit_args))
        changed = _changed_keys(saved, yaml.safe_load(resolved) or {})
        ignored = [k for k in SAFE_TO_CHANGE if k != "rounds"] + ["resume"]  # labels and progress, not the numbers
        return all(any(key == k or key.startswith(k + ".") for k in ignored) for key in changed)


def check_fit_args(fit_args: list[str]) -> None:
    """Refuses the ``flrun fit`` arguments the table sets per run itself."""
    given = sorted({a.split("=", 1)[0] for a in fit_args if a.split("=", 1)[0] in RESERVED})
    if given:
        raise ConfigError(
            f"the arguments after -- may not set {', '.join(given)}: the table sets each run's recipe, seed, "
            "directory and resume itself; use --seeds and --runs instead."
        )


def _refuse_several_devices(runs, fit_args: list[str], n_jobs: int) -> None:
    """Refuses runs of several ranks when each run is given one GPU: all their ranks would share it."""
    from ..run.arguments import parse_fit

    for run in runs:  # one run per recipe: the seed does not change the devices
        devices = parse_fit(run.fit_argv(fit_args))[1].runtime.devices
        if devices > 1:
            raise ConfigError(
                f"{run.recipe.name} runs with runtime.devices {devices}, but with --n_jobs {n_jobs} each run is "
                "given one GPU, which its ranks would share; use --n_jobs 1 (each run then has every GPU of "
                "CUDA_VISIBLE_DEVICES) or -- --runtime.devices 1."
            )


def plan(table: str, seeds: list[int], runs_root: Path, recipes_dir: Path) -> list[TableRun]:
    """The runs the table ``table`` needs: one recipe per experiment of its cells, at every seed."""
    cells = recipe_cells(recipes_dir)
    wanted = [c for c in cells if f"{c['key'][0]}/{c['key'][1]}" == table]
    if not wanted:
        known = sorted({f"{c['key'][0]}/{c['key'][1]}" for c in cells})
        raise ConfigError(f"no recipe in {recipes_dir} names the table {table!r}; known tables: {', '.join(known)}.")
    if not seeds or len(set(seeds)) != len(seeds) or min(seeds) < 0:
        raise ConfigError(f"--seeds must list distinct seeds of 0 or more, got {seeds}; e.g. --seeds 0 1 2.")
    experiments = _experiments(cells)
    own = {c["key"]: c["recipe"] for c in cells if c["same_as"] is None}  # recipes that are not base-only
    covered: set = set()
    recipes = set()
    for cell in sorted(wanted, key=lambda c: c["recipe"]):
        group = experiments[cell["key"]]
        if cell["key"] not in covered:
            covered |= group
            recipes.add(min((own[k] for k in group if k in own), default=cell["recipe"]))
    folder = runs_root / table.split("/")[0]
    return [TableRun(recipes_dir / r, s, folder / Path(r).stem / f"seed{s}") for r in sorted(recipes) for s in seeds]


def run_all(
    runs: list[TableRun], fit_args: list[str], n_jobs: int, out: TextIO, states: dict[int, str] | None = None
) -> tuple[list, list]:
    """Starts every run that is not done, ``n_jobs`` at a time; returns the runs that are done and the failed
    ones with a reason. ``states``: each run's :meth:`TableRun.state` by ``id``, when known already.

    Ctrl-C or SIGTERM (raising KeyboardInterrupt here) or any error ends the running processes, each to
    resume from its last checkpoint next time; they also end if this process is killed (even by SIGKILL).
    """
    previous = signal.signal(signal.SIGTERM, raise_interrupt)  # `kill PID` must not leave the runs going on alone
    try:
        return _Runner(runs, fit_args, n_jobs, out, states).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Runner:
    def __init__(
        self, runs: list[TableRun], fit_args: list[str], n_jobs: int, out: TextIO, states: dict[int, str] | None
    ):
        self.fit_args, self.n_jobs, self.out = fit_args, n_jobs, out
        states = states or {id(run): run.state(fit_args) for run in runs}
        self.done = [run for run in runs if states[id(run)] == "done"]
        self.pending = [(run, states[id(run)]) for run in runs if states[id(run)] != "done"]
        self.todo = len(self.pending)
        self.say(f"{len(self.done)} of {len(runs)} runs done; {self.todo} to run")
        check_memory(min(n_jobs, self.todo), "--n_jobs", "run processes")  # before any starts
        self.gpus = visible_gpus() if n_jobs > 1 else []
        if self.gpus:
            _refuse_several_devices({run.recipe: run for run, _ in self.pending}.values(), fit_args, n_jobs)
            self.say(f"{n_jobs} at a time, each on one GPU of CUDA_VISIBLE_DEVICES {','.join(self.gpus)}")
        self.active: dict[subprocess.Popen, tuple[TableRun, str | None, float]] = {}
        self.failed: list[tuple[TableRun, str]] = []
        self.finished = 0

    def say(self, line: str) -> None:
        """A line of the table command's report: on ``out`` (stdout)."""
        self.out.write(f"{line}\n")
        self.out.flush()

    def run(self) -> tuple[list[TableRun], list[tuple[TableRun, str]]]:
        try:
            while self.pending or self.active:
                while self.pending and len(self.active) < self.n_jobs:
                    self.start(*self.pending.pop(0))
                time.sleep(0.2)
                for process in [p for p in self.active if p.poll() is not None]:
                    self.end(process)
        finally:  # an interrupt or any error: no run goes on alone
            for process in self.active:
                process.terminate()
            for process in self.active:
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
        return self.done, self.failed

    def start(self, run: TableRun, state: str) -> None:
        gpu = least_used(self.gpus, (g for _, g, _ in self.active.values()))
        run.output_dir.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "fl_lightning", "fit", *run.fit_argv(self.fit_args)]
        with run.log.open("a") as log:  # the child's copy of it keeps the lock while it runs
            try:
                fcntl.flock(log, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.finished += 1
                self.failed.append((run, "in use by another process (its log is locked)"))
                self.say(f"[{self.finished}/{self.todo}] {run.name}: in use by another process; not started")
                return
            log.write(f"$ {shlex.join(command)}\n")
            log.flush()
            process = subprocess.Popen(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=as_child(environment_for(gpu)),  # it ends when this command does, even by SIGKILL
            )
            self.active[process] = (run, gpu, time.monotonic())
        self.say(f"{run.name}: started ({state}){f' on GPU {gpu}' if gpu is not None else ''}")

    def end(self, process: subprocess.Popen) -> None:
        run, _, began = self.active.pop(process)
        self.finished += 1
        head = f"[{self.finished}/{self.todo}] {run.name}"
        seconds = time.monotonic() - began
        summary = run.summary()
        if process.returncode == 0 and summary.get("complete"):
            self.done.append(run)
            value = summary.get("final", {}).get(summary.get("monitor"))
            shown = f": {summary['monitor']} {value:.4f}" if isinstance(value, (int, float)) else ""
            self.say(f"{head}: done in {seconds:.0f} s{shown}")
            return
        if process.returncode < 0:
            reason = f"killed by {signal.Signals(-process.returncode).name}"
        elif process.returncode == 0:
            reason = f"stopped after round {summary.get('rounds')} of {summary.get('rounds_planned')}"
        else:
            reason = _last_error(run.log) or f"exit status {process.returncode}"
        self.failed.append((run, reason))
        self.say(f"{head}: failed in {seconds:.0f} s: {reason} (log {run.log})")


def _last_error(log: Path) -> str:
    """The line of the last attempt's output (after its ``$`` line) that says what went wrong: flrun's
    one-sentence error, or the exception ending a traceback."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return ""
    attempt = text.rsplit("\n$ ", 1)[-1].splitlines()[1:] if "\n$ " in text else text.splitlines()[1:]
    lines = [line.strip() for line in attempt if line.strip()]
    for line in reversed(lines):
        if line.startswith("flrun fit: error:") or "Error" in line.split(":")[0]:
            return line[:300]
    return lines[-1][:300] if lines else ""
