"""``flrun table paper-001/table-5``: runs what a paper table still lacks, then builds the table.

The table's cells are those the recipes' ``reference`` blocks name (:mod:`fl_lightning.report_table`); cells
that are the same experiment (a recipe made of a ``base:`` recipe and a reference) run once, since the runs
of either fill both. Each (recipe, seed) is the run directory ``<runs>/<table id>/<recipe>/seed<k>``: a
complete run is skipped, an interrupted one resumes from its last checkpoint (``--resume auto``), so running
the command again finishes the table. Every run is its own ``flrun fit`` process, its output appended to
``seed<k>.log`` beside its directory; with ``--n_jobs K`` K of them run at once, each on one GPU of the
machine (:mod:`fl_lightning.gpu_share`), as a sweep's workers do.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from .errors import ConfigError
from .gpu_share import environment_for, least_used, visible_gpus
from .report_table import _experiments, recipe_cells


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

    def state(self) -> str:
        """``done`` (its summary says complete), ``resume`` (a checkpoint to continue) or ``new``."""
        try:
            if json.loads((self.output_dir / "summary.json").read_text()).get("complete"):
                return "done"
        except (OSError, ValueError):
            pass
        return "resume" if (self.output_dir / "checkpoints" / "last.ckpt").is_file() else "new"

    def command(self, fit_args: list[str]) -> list[str]:
        return [
            sys.executable,
            "-m",
            "fl_lightning",
            "fit",
            "--config",
            str(self.recipe),
            "--seed",
            str(self.seed),
            "--output_dir",
            str(self.output_dir),
            "--runtime.progress",
            "false",
            "--resume",
            "auto",
            *fit_args,
        ]


def plan(table: str, seeds: list[int], runs_root: Path, recipes_dir: Path) -> list[TableRun]:
    """The runs the table ``table`` needs: one recipe per experiment of its cells, at every seed."""
    cells = recipe_cells(recipes_dir)
    wanted = [c for c in cells if f"{c['key'][0]}/{c['key'][1]}" == table]
    if not wanted:
        known = sorted({f"{c['key'][0]}/{c['key'][1]}" for c in cells})
        raise ConfigError(f"no recipe in {recipes_dir} names the table {table!r}; known tables: {', '.join(known)}.")
    if not seeds or len(set(seeds)) != len(seeds):
        raise ConfigError(f"--seeds must list distinct seeds, got {seeds}; e.g. --seeds 0 1 2.")
    experiments = _experiments(cells)
    covered: set = set()
    recipes = []
    # a recipe of its own before a base-only one naming the same experiment
    for cell in sorted(wanted, key=lambda c: (c["same_as"] is not None, c["recipe"])):
        if cell["key"] not in covered:
            covered |= experiments[cell["key"]]
            recipes.append(recipes_dir / cell["recipe"])
    folder = runs_root.joinpath(*table.split("/"))
    return [TableRun(r, s, folder / r.stem / f"seed{s}") for r in sorted(recipes) for s in seeds]


def run_all(runs: list[TableRun], fit_args: list[str], n_jobs: int, out: TextIO) -> list[tuple[TableRun, str]]:
    """Runs every run not yet done, ``n_jobs`` at a time; returns the failed ones with their last error line.

    Ctrl-C or SIGTERM ends the running processes (raising KeyboardInterrupt here); each resumes from its last
    checkpoint next time.
    """
    if n_jobs < 1:
        raise ConfigError(f"--n_jobs must be at least 1, got {n_jobs}.")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # `kill PID` must not leave the runs going on alone
    try:
        return _run_all(runs, fit_args, n_jobs, out)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _run_all(runs: list[TableRun], fit_args: list[str], n_jobs: int, out: TextIO) -> list[tuple[TableRun, str]]:
    pending = [run for run in runs if run.state() != "done"]
    todo = len(pending)
    print(f"{len(runs) - todo} of {len(runs)} runs done; {todo} to run", file=out, flush=True)
    gpus = visible_gpus() if n_jobs > 1 else []
    if gpus:
        print(f"{n_jobs} at a time, each on one GPU of CUDA_VISIBLE_DEVICES {','.join(gpus)}", file=out, flush=True)
    active: dict[subprocess.Popen, tuple[TableRun, str | None, float]] = {}
    failed: list[tuple[TableRun, str]] = []
    finished = 0
    try:
        while pending or active:
            while pending and len(active) < n_jobs:
                run = pending.pop(0)
                gpu = least_used(gpus, (g for _, g, _ in active.values()))
                run.output_dir.parent.mkdir(parents=True, exist_ok=True)
                with run.log.open("a") as log:  # the child holds its own descriptor
                    log.write(f"$ {' '.join(run.command(fit_args))}\n")
                    log.flush()
                    process = subprocess.Popen(
                        run.command(fit_args),
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        stdin=subprocess.DEVNULL,
                        env=environment_for(gpu),
                    )
                active[process] = (run, gpu, time.monotonic())
                where = f" on GPU {gpu}" if gpu is not None else ""
                print(f"{run.name}: started ({run.state()}){where}", file=out, flush=True)
            time.sleep(0.2)
            for process in [p for p in active if p.poll() is not None]:
                run, _, began = active.pop(process)
                finished += 1
                seconds = time.monotonic() - began
                head = f"[{finished}/{todo}]"
                if process.returncode == 0 and run.state() == "done":
                    print(f"{head} {run.name}: done in {seconds:.0f} s{_headline(run)}", file=out, flush=True)
                else:
                    reason = _last_error(run.log) or f"exit status {process.returncode}"
                    failed.append((run, reason))
                    print(
                        f"{head} {run.name}: failed in {seconds:.0f} s: {reason} (log {run.log})", file=out, flush=True
                    )
    except KeyboardInterrupt:
        for process in active:
            process.terminate()
        for process in active:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        raise
    return failed


def _headline(run: TableRun) -> str:
    summary = json.loads((run.output_dir / "summary.json").read_text())
    value = summary.get("final", {}).get(summary.get("monitor"))
    return f": {summary['monitor']} {value:.4f}" if isinstance(value, (int, float)) else ""


def _last_error(log: Path) -> str:
    """The last line of a failed run's log that says what went wrong (flrun's one-sentence error, or the
    exception of a traceback)."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    for line in reversed(lines):
        if line.startswith("flrun fit: error:") or "Error" in line.split(":")[0]:
            return line[:300]
    return lines[-1][:300] if lines else ""
