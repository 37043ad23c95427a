"""``flrun table --dry_run``: the runs a table needs and whether each is done, their total, how long the rest
may take where that can be told (from finished runs of the same recipes), and which runs lack their data set
(:mod:`fl_lightning.sweep.table_data`), with the command that fetches it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import TextIO

from ..data import sources
from ..tracking.progress import duration
from .table import TableRun
from .table_data import lacking_by_recipe


def preview(runs: list[TableRun], fit_args: list[str], n_jobs: int, out: TextIO) -> None:
    """Writes one line per run to ``out``, then the totals, the time estimate and the missing data sets."""
    states = {id(run): run.state(fit_args) for run in runs}
    lacking = lacking_by_recipe(runs, fit_args)
    lines = []
    for run in runs:
        flag = "  (data missing)" if lacking[run.recipe] and states[id(run)] != "done" else ""
        lines.append(f"{states[id(run)]:>7}  {run.name}  {run.output_dir}{flag}")
    counts = Counter(states.values())
    pending = [run for run in runs if states[id(run)] != "done"]
    kinds = ", ".join(f"{counts[k]} {label}" for k, label in KINDS if counts[k])
    lines.append(f"{len(runs)} runs: {counts['done']} done, {len(pending)} to run" + (f" ({kinds})" if kinds else ""))
    if pending:
        lines.append(time_estimate(runs, pending, states, n_jobs))
    for (title, name, data_dir, download), recipes in _by_data_set(pending, lacking).items():
        count = sum(1 for run in pending if run.recipe in recipes)
        fetched = " (or let flrun table download it before the runs: their recipes set download: true)"
        lines.append(
            f"data missing for {count} of the runs to do ({', '.join(sorted(r.stem for r in recipes))}): {title}, "
            f"not found in {data_dir}; fetch it with {sources.fetch_command(name, data_dir)}"
            f"{fetched if download else ''}."
        )
    out.write("".join(f"{line}\n" for line in lines))


KINDS = (("new", "new"), ("resume", "to resume"), ("changed", "changed since they finished"))


def time_estimate(runs: list[TableRun], pending: list[TableRun], states: dict[int, str], n_jobs: int) -> str:
    """About how long the pending runs take one after another, from the finished runs of the same recipes."""
    seconds: dict[Path, list[float]] = {}
    for run in runs:
        wall = run.summary().get("wall_time_s") if states[id(run)] == "done" else None
        if isinstance(wall, (int, float)):
            seconds.setdefault(run.recipe, []).append(float(wall))
    known = [sum(seconds[run.recipe]) / len(seconds[run.recipe]) for run in pending if run.recipe in seconds]
    if not known:
        return (
            "time: no estimate, since none of their recipes has a finished run here yet (each finished run records "
            "its time in summary.json)."
        )
    total = sum(known)
    at_once = f", about {duration(total / n_jobs)} with --n_jobs {n_jobs}" if n_jobs > 1 else ""
    if len(known) == len(pending):
        return f"time: about {duration(total)} one run after another{at_once} (from the finished runs of each recipe)."
    runs_of = f"the {len(known)} run" + ("s whose recipes have" if len(known) > 1 else " whose recipe has")
    return (
        f"time: about {duration(total)} for {runs_of} a finished run here{at_once}; no estimate for the other "
        f"{len(pending) - len(known)} (none of their recipe has finished yet)."
    )


def _by_data_set(pending: list[TableRun], lacking: dict[Path, list]) -> dict[tuple, set[Path]]:
    grouped: dict[tuple, set[Path]] = {}
    for run in pending:
        for item in lacking[run.recipe]:
            grouped.setdefault(item, set()).add(run.recipe)
    return grouped
