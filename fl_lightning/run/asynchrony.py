"""Asynchronous federation on a simulated clock (FedHe's Algorithm 1 server).

Clients train concurrently at different speeds. A client's update is computed when it is dispatched
(from the server state of that moment) and delivered at its simulated arrival time; the server handles
arrivals in time order, answers each with its current state and dispatches the client again. The
difference between the server's version at arrival and at dispatch is the update's staleness.

:class:`AsynchronousSchedule` is the clock and the event queue; :class:`AsynchronousRounds` is what one
logged round does with them, called by the orchestrator's round loop in place of a synchronous round.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ..federation.errors import ConfigError
from ..federation.ledger import CommunicationLedger
from ..federation.seeding import Owner, Stream, derive_seed, seed_torch, server_phase
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, Payload
from ..federation.user_code import user_method
from .tally import RoundTally, TrainedRound

if TYPE_CHECKING:
    from ..strategies.base import Phase
    from .robustness import Faults

RunClient = Callable[[int, ClientTask, RoundTally, int], ClientUpdate | None]
"""``run_client(round, task, tally, stream)``: runs one client's task; its update (its metrics recorded in the
round's tally), None when lost (counted there)."""


@dataclass(order=True)
class Pending:
    arrival: float
    seq: int
    client_id: int = field(compare=False)
    version: int = field(compare=False)
    update: ClientUpdate | None = field(compare=False)  # None: lost (a fault); the server notices at arrival


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
        self.clients: list[ClientSpec] = []

    def setup(self, clients: list[ClientSpec], seed: int) -> None:
        self.clients = clients
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
        # a Python float, not numpy's: arrival times go into checkpoints, which hold plain data only
        return float((1.0 + self.jitter * rng.uniform()) / self.speeds[client_id])

    def push(
        self, client_id: int, update: ClientUpdate | None, rng: np.random.Generator, slowdown: float = 1.0
    ) -> None:
        self.seq += 1
        arrival = self.clock + self.duration(client_id, rng) * slowdown
        heapq.heappush(self.queue, Pending(arrival, self.seq, client_id, self.version, update))

    def pop(self) -> Pending:
        item = heapq.heappop(self.queue)
        self.clock = item.arrival
        return item

    def state_dict(self) -> dict[str, Any]:
        """Clock, version and the queue with its pending updates, as tensors and plain containers."""
        return {
            "clock": self.clock,
            "version": self.version,
            "seq": self.seq,
            "queue": [_pending_state(item) for item in self.queue],  # the heap's list order is kept
            "started": self.started,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.clock, self.version, self.seq = state["clock"], state["version"], state["seq"]
        self.queue = [_pending(item, self.clients) for item in state["queue"]]
        self.started = state["started"]


class AsynchronousRounds:
    """One logged round in asynchronous mode: ``arrivals_per_round`` arrivals in simulated-time order.

    Each arrival is aggregated alone (the strategy's ``aggregate`` gets a one-update iterator) and the
    arriving client is dispatched again from the new server state (FedHe Algorithm 1).

    Args:
        schedule: the clock, client speeds and event queue.
        phases: the strategy's phases (``phase_table``): asynchrony needs exactly one.
        clients: the population.
        ledger: counts each update's uplink when it arrives.
        seed: the run seed.
        run_client: runs one client's task (the orchestrator's: seeds the client's streams, counts the downlink,
            records the update's metrics in the round's tally).
        faults: injected faults; a straggler's duration is multiplied by ``faults.straggle_factor``.
    """

    def __init__(
        self,
        schedule: AsynchronousSchedule,
        phases: tuple[Phase, ...],
        clients: list[ClientSpec],
        ledger: CommunicationLedger,
        seed: int,
        run_client: RunClient,
        faults: Faults | None = None,
    ):
        if len(phases) > 1:
            names = ", ".join(p.name for p in phases)
            raise ConfigError(
                f"the strategy has several phases per round ({names}) and cannot run asynchronously; "
                "remove runtime.asynchronous or choose a one-phase method."
            )
        schedule.setup(clients, derive_seed(seed, 0, Owner.SERVER, Stream.SPEEDS))
        self.phase, self.schedule, self.clients = phases[0], schedule, clients
        self.ledger, self.seed, self.run_client = ledger, seed, run_client
        self.faults = faults

    def run_round(self, rnd: int, tally: RoundTally) -> TrainedRound:
        """Handles one round's arrivals, the clients' metrics recorded in ``tally``; returns how many arrivals it
        handled and the server's metrics (each aggregation's, then the round's staleness and clock)."""
        schedule = self.schedule
        if not schedule.started:
            self._start(rnd, tally)
        staleness: list[int] = []
        server_metrics: dict[str, float] = {}
        assert schedule.arrivals_per_round is not None, "set by the schedule's setup"
        for _ in range(schedule.arrivals_per_round):
            arrival = schedule.pop()
            staleness.append(schedule.version - arrival.version)
            if arrival.update is not None:  # a lost update: the server keeps its state and sends the client again
                self.ledger.record(rnd, "uplink", arrival.update.uplink)
                seed_torch(derive_seed(self.seed, schedule.seq, Owner.SERVER, server_phase(0)))
                if self.phase.aggregate is not None:  # none: the server uses nothing of the update
                    with user_method(self.phase.aggregate):
                        server_metrics.update(self.phase.aggregate(rnd, iter([arrival.update])) or {})
                schedule.version += 1
            self._dispatch(rnd, self.clients[arrival.client_id], tally)
        server_metrics.update(
            {
                "async/staleness_mean": float(np.mean(staleness)),
                "async/staleness_max": float(np.max(staleness)),
                "async/clock": schedule.clock,
            }
        )
        return TrainedRound(len(staleness), server_metrics)

    def _start(self, rnd: int, tally: RoundTally) -> None:
        """Every client (or ``concurrency`` of them, drawn at random) starts from the initial state."""
        concurrency = self.schedule.concurrency
        first = self.clients
        if concurrency is not None:
            rng = np.random.default_rng(derive_seed(self.seed, 0, Owner.SERVER, Stream.ASYNC_START))
            first = [self.clients[i] for i in np.sort(rng.choice(len(self.clients), concurrency, replace=False))]
        for client in first:
            self._dispatch(rnd, client, tally)
        self.schedule.started = True

    def _dispatch(self, rnd: int, client: ClientSpec, tally: RoundTally) -> None:
        """Sends a client the current server state and computes its update, delivered at its arrival."""
        with user_method(self.phase.configure):
            task = self.phase.configure(rnd, [client])[0]
        task.phase = self.phase.name
        stream = self.schedule.seq + 1  # tells this dispatch's random streams apart from the client's others
        update = self.run_client(rnd, task, tally, stream)
        rng = np.random.default_rng(derive_seed(self.seed, stream, client.id, Stream.ARRIVAL))
        slowdown, faults = 1.0, self.faults
        if faults is not None and faults.draw(self.seed, rnd, client.id, stream) == "straggle":
            slowdown = faults.straggle_factor
        self.schedule.push(client.id, update, rng, slowdown)


def _pending_state(item: Pending) -> dict[str, Any]:
    update = item.update
    return {
        "arrival": item.arrival,
        "seq": item.seq,
        "client_id": item.client_id,
        "version": item.version,
        "update": None
        if update is None
        else {
            "client_id": update.client.id,
            "num_samples": update.num_samples,
            "uplink": {name: _payload_state(payload) for name, payload in update.uplink.items()},
            "metrics": dict(update.metrics),
        },
    }


def _pending(state: dict[str, Any], clients: list[ClientSpec]) -> Pending:
    saved = state["update"]
    if saved is None:
        return Pending(state["arrival"], state["seq"], state["client_id"], state["version"], None)
    update = ClientUpdate(
        clients[saved["client_id"]],
        saved["num_samples"],
        {name: _payload(payload) for name, payload in saved["uplink"].items()},
        saved["metrics"],
    )
    return Pending(state["arrival"], state["seq"], state["client_id"], state["version"], update)


def _payload_state(payload: Payload) -> dict[str, Any]:
    kind = type(payload)
    if not dataclasses.is_dataclass(payload):
        raise TypeError(f"{kind.__qualname__} must be a dataclass to be kept in an asynchronous checkpoint")
    fields = {f.name: getattr(payload, f.name) for f in dataclasses.fields(payload)}
    return {"type": f"{kind.__module__}.{kind.__qualname__}", "fields": fields}


def _payload(state: dict[str, Any]) -> Payload:
    """Rebuilds a payload of a class already imported (looked up by name, never imported from the file)."""
    kinds, todo = {}, [Payload]
    while todo:
        kind = todo.pop()
        kinds[f"{kind.__module__}.{kind.__qualname__}"] = kind
        todo.extend(kind.__subclasses__())
    if state["type"] not in kinds:
        raise ConfigError(
            f"the checkpoint holds a payload of unknown type {state['type']!r}; resume with the same code."
        )
    return kinds[state["type"]](**state["fields"])
