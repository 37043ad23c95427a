"""Asynchronous federation on a simulated clock (FedHe's Algorithm 1 server).

Clients train concurrently at different speeds. A client's update is computed when it is dispatched
(from the server state of that moment) and delivered at its simulated arrival time; the server handles
arrivals in time order, answers each with its current state and dispatches the client again. The
difference between the server's version at arrival and at dispatch is the update's staleness.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError
from .types import ClientSpec, ClientUpdate


@dataclass(order=True)
class Pending:
    arrival: float
    seq: int
    client_id: int = field(compare=False)
    version: int = field(compare=False)
    update: ClientUpdate = field(compare=False)


class AsynchronousSchedule:
    """How clients run in asynchronous mode.

    Args:
        arrivals_per_round: server updates per logged round (default: the number of clients), so that
            ``rounds``, ``eval_every`` and checkpoints keep their meaning.
        speed_range: each client's speed is drawn uniformly from this range (seeded).
        tier_speeds: a fixed speed per tier, e.g. ``{weak: 0.25, strong: 1.0}``; overrides speed_range.
        jitter: a local update takes ``(1 + jitter * U(0, 1)) / speed`` time units.
        concurrency: clients training at the same time (default: all), drawn at random at the start;
            each arrival re-dispatches the arriving client.
    """

    def __init__(
        self,
        arrivals_per_round: int | None = None,
        speed_range: tuple[float, float] = (0.2, 1.0),
        tier_speeds: dict[str, float] | None = None,
        jitter: float = 0.5,
        concurrency: int | None = None,
    ):
        if min(speed_range) <= 0 or speed_range[0] > speed_range[1]:
            raise ConfigError(f"speed_range must be two positive numbers low <= high, got {list(speed_range)}.")
        self.arrivals_per_round = arrivals_per_round
        self.speed_range, self.tier_speeds = speed_range, tier_speeds or {}
        self.jitter, self.concurrency = jitter, concurrency
        self.clock, self.version, self.seq = 0.0, 0, 0
        self.queue: list[Pending] = []
        self.started = False

    def setup(self, clients: list[ClientSpec], seed: int) -> None:
        rng = np.random.default_rng(seed)
        drawn = rng.uniform(*self.speed_range, size=len(clients))
        self.speeds = np.array([self.tier_speeds.get(c.tier, s) for c, s in zip(clients, drawn)])
        unknown = set(self.tier_speeds) - {c.tier for c in clients}
        if unknown:
            raise ConfigError(f"tier_speeds names unknown tier(s) {sorted(unknown)}.")
        if self.arrivals_per_round is None:
            self.arrivals_per_round = len(clients)
        if self.concurrency is not None and not 1 <= self.concurrency <= len(clients):
            raise ConfigError(f"concurrency must be between 1 and {len(clients)}, got {self.concurrency}.")

    def duration(self, client_id: int, rng: np.random.Generator) -> float:
        return (1.0 + self.jitter * rng.uniform()) / self.speeds[client_id]

    def push(self, client_id: int, update: ClientUpdate, rng: np.random.Generator) -> None:
        self.seq += 1
        heapq.heappush(
            self.queue, Pending(self.clock + self.duration(client_id, rng), self.seq, client_id, self.version, update)
        )

    def pop(self) -> Pending:
        item = heapq.heappop(self.queue)
        self.clock = item.arrival
        return item

    def state_dict(self) -> dict:
        return {
            "clock": self.clock,
            "version": self.version,
            "seq": self.seq,
            "queue": self.queue,
            "started": self.started,
        }

    def load_state_dict(self, state: dict) -> None:
        self.clock, self.version, self.seq = state["clock"], state["version"], state["seq"]
        self.queue, self.started = state["queue"], state["started"]
