"""What one round's clients report as they finish (:class:`RoundTally`), and what its training gave the server
(:class:`TrainedRound`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass
class RoundTally:
    """The clients' side of one round, gathered as each client finishes.

    The orchestrator makes one per round and hands it to whatever runs the round's clients (the synchronous
    phases, the asynchronous arrivals, a rank's share of a phase); the round's row is built from it.
    """

    client_metrics: dict[str, list[float]] = field(default_factory=dict)
    """Each local metric (``global/loss``), one value per update the server receives, in the order the clients
    finished (with several ranks: in task order)."""
    events: dict[str, int] = field(default_factory=dict)
    """Updates lost, by cause (``crash``, ``nan``, ``dropped_nonfinite``, ``phases_without_updates``, ...)."""
    steps: dict[str, int] = field(default_factory=dict)
    """Optimizer steps per role of every client that trained, whether or not its update arrived (the round's
    compute)."""

    def add_metrics(self, metrics: Mapping[str, float]) -> None:
        """Records the local metrics of one update the server receives."""
        for key, value in metrics.items():
            self.client_metrics.setdefault(key, []).append(value)

    def add_steps(self, steps: Mapping[str, int]) -> None:
        """Records the optimizer steps per role that one client (or one rank's share) took."""
        for role, count in steps.items():
            self.steps[role] = self.steps.get(role, 0) + count

    def count(self, event: str, times: int = 1) -> None:
        """Counts ``times`` lost updates (or empty phases) of kind ``event``."""
        self.events[event] = self.events.get(event, 0) + times


class TrainedRound(NamedTuple):
    """What one round's training gave: how many client tasks it ran and the server's metrics."""

    tasks: int
    """Client tasks of every phase (asynchronous rounds: the arrivals handled)."""
    server_metrics: dict[str, float]
    """What ``aggregate`` returned, merged over the phases (or arrivals), then the round's own (staleness)."""
