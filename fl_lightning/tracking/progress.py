"""Progress of a run: a rich bar on a terminal, one plain line per round otherwise, and a warning when
a run will take many hours."""

from __future__ import annotations

import sys
import time

from rich.console import Console
from rich.measure import Measurement
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from . import metric_keys as keys

LONG_RUN_S = 2 * 3600  # estimated runs longer than this are announced with advice


def duration(seconds: float) -> str:
    """``42 s``, ``7.5 min``, ``3.2 h``, ``2.5 days``."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.1f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def long_run_warning(seconds_per_round: float, rounds_left: int, device: str, estimated: bool = False) -> str | None:
    """One sentence announcing a run longer than :data:`LONG_RUN_S`, with what would make it faster."""
    total = seconds_per_round * rounds_left
    if total <= LONG_RUN_S:
        return None
    how = "estimated from the first client" if estimated else "measured"
    advice = (
        "a GPU (--runtime.accelerator cuda) runs it far faster"
        if device == "cpu"
        else "fewer rounds (--rounds) or a smaller population shortens it"
    )
    return (
        f"this run will take about {duration(total)} on {device} ({duration(seconds_per_round)} per round "
        f"{how}, {rounds_left} rounds to go); {advice}, and --stop_after with --resume auto splits it into jobs."
    )


class RoundProgress:
    """Shows ``round k/N``, the clients done in the current phase, the last monitored value (with the round it
    was evaluated at, after rounds without evaluation) and the ETA.

    On a terminal this is a rich bar; when output is redirected (a log file, a batch job) it prints one
    plain line per round instead of redrawing a bar. Disabled, it only keeps the long-run warning.
    """

    def __init__(self, enabled: bool, total: int, done: int, monitor: str, device: str = "cpu"):
        self.enabled, self.total, self.monitor, self.device = enabled, total, monitor, device
        self.first_round, self.warned = done + 1, False
        self.last_value: float | None = None  # the monitored metric when last evaluated, and that round
        self.last_evaluated: int | None = None
        self.round, self.phase, self.phase_clients, self.clients_done = done + 1, "", 0, 0
        self.console = Console(file=sys.stderr)
        self.interactive = enabled and self.console.is_terminal
        self.round_started = self.client_started = time.perf_counter()
        self.started, self.done_at_start = self.round_started, done
        self.statuses: list[str] = [""]  # the status at decreasing lengths; the longest that fits is shown
        self.room: dict[int, int] = {}  # the status's room by the phase text's length (a table measured once each)
        if self.interactive:
            self.bar = Progress(
                TextColumn("[bold]round"),
                MofNCompleteColumn(),
                BarColumn(bar_width=40 if self.console.width >= 140 else 10),
                TextColumn("{task.fields[phase]}"),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                console=self.console,
                transient=False,
            )
            self.task = self.bar.add_task("rounds", total=total, completed=done, status="", phase="")
            self.bar.start()

    # ------------------------------------------------------------------ inside a round
    def start_round(self, rnd: int) -> None:
        self.round, self.round_started = rnd, time.perf_counter()

    def start_phase(self, phase: str, clients: int) -> None:
        self.phase, self.phase_clients, self.clients_done = phase, clients, 0
        self.client_started = time.perf_counter()
        self._show_phase()

    def client_done(self) -> None:
        self.clients_done += 1
        if not self.warned and self.round == self.first_round and self.clients_done == 1:
            # a first guess before a long first round ends: this client's time for every task of the phase
            guess = (time.perf_counter() - self.client_started) * max(self.phase_clients, 1)
            self._warn(guess, estimated=True)
        self._show_phase()

    def _show_phase(self) -> None:
        if self.interactive:
            label = f"{self.phase} " if self.phase and self.phase != "train" else ""
            of = f"/{self.phase_clients}" if self.phase_clients else ""  # asynchronous rounds: arrivals, no total
            self._show(phase=f"{label}clients {self.clients_done}{of}")

    def _show(self, phase: str, **fields) -> None:
        """Updates the bar with the longest status that fits beside the other columns: rich would otherwise
        squeeze the round counter, elapsed time and ETA of a narrow terminal to ellipses to make room for it."""
        if len(phase) not in self.room:
            self.bar.update(self.task, phase=phase, status="")
            table = self.bar.make_tasks_table(self.bar.tasks)
            self.room[len(phase)] = (
                self.console.width - Measurement.get(self.console, self.console.options, table).maximum
            )
        status = next((text for text in self.statuses if len(text) <= self.room[len(phase)]), "")
        self.bar.update(self.task, phase=phase, status=status, **fields)

    # ------------------------------------------------------------------ after a round
    def update(self, rnd: int, metrics: dict[str, float]) -> None:
        if self.monitor in metrics:
            self.last_value, self.last_evaluated = metrics[self.monitor], rnd
        if rnd == self.first_round:
            self._warn(time.perf_counter() - self.round_started, estimated=False)
        if not self.enabled:
            return
        # a round without evaluation shows the last value with its round: the same number alone looks stuck
        when = "" if self.last_evaluated == rnd else f" (round {self.last_evaluated})"
        value = "" if self.last_value is None else f"{self.monitor} {self.last_value:.4f}"
        loss = f"{keys.TRAIN_LOSS} {metrics[keys.TRAIN_LOSS]:.4f}" if keys.TRAIN_LOSS in metrics else ""
        # the budget spent so far, with a privacy section
        spent = f"epsilon {metrics[keys.PRIVACY_EPSILON]:.3g}" if keys.PRIVACY_EPSILON in metrics else ""
        status = "  ".join(part for part in (value and value + when, loss, spent) if part)
        if self.interactive:  # a narrow terminal drops the loss first, then the budget, then shortens the value
            tail, number = self.monitor.rsplit("/", 1)[-1], value.rsplit(" ", 1)[-1]
            brief = f" (r{self.last_evaluated})" if when else ""
            with_budget = "  ".join(part for part in (value + when, spent) if part)
            forms = [status, with_budget, value + when, value + brief, f"{tail} {number}{brief}", f"{tail} {number}"]
            self.statuses = list(dict.fromkeys(forms)) if value else [status]
            self._show(phase="", completed=rnd)
            return
        elapsed = time.perf_counter() - self.started
        per_round = elapsed / max(rnd - self.done_at_start, 1)
        eta = duration(per_round * (self.total - rnd))
        # plain text to the stream itself: in Jupyter rich's console would render to the notebook's display, and a
        # log file wants one unstyled line per round
        sys.stderr.write(f"round {rnd}/{self.total}  {status}  elapsed {duration(elapsed)}  eta {eta}\n")
        sys.stderr.flush()

    def _warn(self, seconds_per_round: float, estimated: bool) -> None:
        if self.warned:
            return
        message = long_run_warning(seconds_per_round, self.total - self.first_round + 1, self.device, estimated)
        if message is not None:
            self.warned = True
            self.console.print(f"[bold yellow]note:[/] {message}", highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.interactive:
            self.bar.stop()


SHOWN_METRICS = 6  # other final metrics the end of a run names; summary.json holds them all


def run_summary(summary: dict) -> str:
    """The end of ``flrun fit`` on the terminal, from its ``summary.json``::

    quickstart seed 0: 40 rounds in 3.1 s
      global/test_acc: final 0.9889 (round 40), best 0.9917 (round 36)
      other final metrics: global/test_loss 0.04121, global/test_top_class_share 0.1034
    run folder: runs/quickstart/seed0 (every number in summary.json; --json prints it)
    """
    seconds = float(summary.get("wall_time_s") or 0.0)
    took = f"{seconds:.1f} s" if seconds < 10 else duration(seconds)
    done, planned = summary.get("rounds"), summary.get("rounds_planned")
    rounds = f"{done} rounds" if summary.get("complete") else f"{done} of {planned} rounds (--resume auto continues)"
    lines = [f"{summary.get('name')} seed {summary.get('seed')}: {rounds} in {took}"]
    monitor, final, best = summary.get("monitor"), summary.get("final") or {}, summary.get("best") or {}
    if monitor in final:
        shown = f"final {final[monitor]:.4f} (round {summary.get('final_round')})"
        if monitor in best:
            shown += f", best {best[monitor]:.4f} (round {summary.get('best_round')})"
        lines.append(f"  {monitor}: {shown}")
    else:
        lines.append("  no evaluation yet")
    others = [f"{key} {value:.4g}" for key, value in final.items() if key != monitor]
    if others:
        more = f" and {len(others) - SHOWN_METRICS} more" if len(others) > SHOWN_METRICS else ""
        lines.append(f"  other final metrics: {', '.join(others[:SHOWN_METRICS])}{more}")
    lines.append(f"run folder: {summary.get('output_dir')} (every number in summary.json; --json prints it)")
    return "\n".join(lines)
