"""A rich progress bar: round, chosen metrics and ETA."""

from __future__ import annotations

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class RoundProgress:
    """Shows ``round k/N``, the monitored metric and the ETA; a no-op when disabled."""

    def __init__(self, enabled: bool, total: int, done: int, monitor: str):
        self.enabled = enabled
        self.monitor = monitor
        if enabled:
            self.bar = Progress(
                TextColumn("[bold]round"),
                MofNCompleteColumn(),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                transient=False,
            )
            self.task = self.bar.add_task("rounds", total=total, completed=done, status="")
            self.bar.start()

    def update(self, rnd: int, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        shown = {k: v for k, v in metrics.items() if k == self.monitor or k == "train/loss"}
        status = "  ".join(f"{k} {v:.4f}" for k, v in shown.items())
        self.bar.update(self.task, completed=rnd, status=status or self.bar.tasks[0].fields["status"])

    def close(self) -> None:
        if self.enabled:
            self.bar.stop()
