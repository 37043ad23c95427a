"""A phase's clients split across ranks, with the numbers of one process (``distributed.ranks`` connects the ranks).

Every rank samples and configures the same tasks; each trains its share (:func:`shard`), then every
rank receives every update and hands them to ``aggregate`` in task order, so the server state stays
identical on all ranks. What else one process would hold after the phase is exchanged with the updates:

- the states of the clients trained elsewhere (a client may land on another rank next round);
- the client metrics, rebuilt in task order from the updates (floating-point means depend on order);
- the traffic ledger, replayed in task order (a download per task, an upload per delivered update);
- the fault and divergence event counts;
- with ``optimizer_state: shared_per_phase``, the optimizer state of each role that the phase's last client
  training it left behind (the state every client of the next phase starts from);
- torch's global generator: in one process ``aggregate`` pulls the updates as the clients run, so what it
  draws after receiving update i continues the generator of client i (after the last client: the last
  that trained). Each rank records its generator after each client and every rank restores those states
  as it hands the updates on, so server-side randomness (FedDF's distillation dropout, VELO's batches)
  draws the same numbers as in one process (with the sequential executor; the batched one records the
  generator after each chunk of clients, and each rank's chunks differ);
- an error: a client that diverges (or fails) on one rank stops every rank with the same message;
- a fingerprint of the server state each rank held before the phase: every rank repeats the server's work,
  so a nondeterministic kernel (or another GPU model) on one rank would make its state drift and its clients
  train from another model; a difference stops the run with a message saying so (:func:`fingerprint`).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ..distributed import ranks as ranks_module
from ..distributed.messages import pack, unpack
from ..federation.errors import ConfigError
from ..federation.ledger import CommunicationLedger
from ..federation.types import ClientTask, ClientUpdate
from .robustness import Diverged
from .state import RunState
from .tally import RoundTally

if TYPE_CHECKING:
    from ..client.loop import LocalLoop
    from ..tracking import RoundProgress

RunShare = Callable[[int, list[ClientTask], RoundTally], Iterator[ClientUpdate]]


@dataclass
class _Sent:
    """An update as another rank receives it: its own message, unpacked only when it is handed to ``aggregate``
    (unpacked with the phase's record, every update of the phase would sit on the device at once), with what
    the phase's bookkeeping needs before that: its payloads' sizes and its metrics."""

    message: torch.Tensor
    sizes: dict[str, int]
    metrics: dict[str, float]

    @classmethod
    def of(cls, update: ClientUpdate) -> _Sent:
        return cls(pack(update), _sizes(update), update.metrics)


def _sizes(update: ClientUpdate | _Sent) -> dict[str, int]:
    return update.sizes if isinstance(update, _Sent) else {name: p.nbytes for name, p in update.uplink.items()}


def check_same_server(records: list[dict[str, Any]], rnd: int) -> None:
    """Stops every rank (each sees the same records) when a rank's server state differs from rank 0's."""
    drifted = [rank for rank, record in enumerate(records) if record["server"] != records[0]["server"]]
    if drifted:
        raise RuntimeError(
            f"round {rnd}: the server state of rank(s) {drifted} differs from rank 0's. Every rank repeats the "
            "server's work, so a nondeterministic kernel or another GPU model made it drift, and the ranks' "
            "clients would train from different models. Use identical GPUs with runtime.deterministic true, or "
            "resume from the last checkpoint with --runtime.devices 1."
        )


def shard(tasks: list[ClientTask], rank: int, world: int) -> list[int]:
    """The task positions ``rank`` trains: round-robin, but all tasks of one client on the same rank, in order
    (a client's second task starts from the state its first one left)."""
    owner: dict[int, int] = {}
    for task in tasks:
        owner.setdefault(task.client.id, len(owner) % world)
    return [p for p, task in enumerate(tasks) if owner[task.client.id] == rank]


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(value: Any) -> str:
    """A digest of a (nested) server state that changes with any bit of it and is the same on every device.

    Each tensor's bits are summed as integers where it lives (exact, so independent of summation order and
    device; one reduction per tensor and a single transfer for all), and the sums go into a SHA-256 with the
    structure (dict keys sorted), shapes, dtypes and plain values. Compensating changes of two elements are
    not seen: a drift between ranks changes many at once.
    """
    parts: list[str] = []
    sums: list[torch.Tensor] = []

    def walk(item: Any, path: str) -> None:
        if isinstance(item, torch.Tensor):
            parts.append(f"{path}:{item.dtype}:{tuple(item.shape)}")
            if item.layout == torch.strided and not item.is_quantized and item.device.type != "meta" and item.numel():
                flat = item.detach().reshape(-1)
                if flat.is_complex():
                    flat = torch.view_as_real(flat).reshape(-1)
                sums.append(flat.view(_BITS[flat.element_size()]).sum(dtype=torch.int64))
        elif isinstance(item, dict):  # keys sorted: a dict filled from a set of names differs in order per process
            for key, inner in sorted(item.items(), key=lambda kv: repr(kv[0])):
                walk(inner, f"{path}/{key!r}")
        elif isinstance(item, (set, frozenset)):
            parts.append(f"{path}={sorted(map(repr, item))}")
        elif isinstance(item, (list, tuple)):
            for i, inner in enumerate(item):
                walk(inner, f"{path}/{i}")
        else:
            parts.append(f"{path}={item!r}")

    walk(value, "")
    values: list[int] = [0] * len(sums)
    by_device: dict[torch.device, list[int]] = {}
    for i, total in enumerate(sums):
        by_device.setdefault(total.device, []).append(i)
    for at in by_device.values():  # one transfer per device, not one per tensor
        for i, total in zip(at, torch.stack([sums[i] for i in at]).tolist()):
            values[i] = total
    return hashlib.sha256("\n".join([*parts, repr(values)]).encode()).hexdigest()


def _generators(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _restore(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu.cpu())
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda.cpu(), device)


class ShardedPhases:
    """Runs each phase's share of this rank and merges every rank's results (see the module docstring).

    Args:
        ranks: this process's ranks (``ranks.current()``), more than one.
        state: the run's state (client states and ledger), identical on every rank.
        loop: the local loop (its optimizers, for ``optimizer_state: shared_per_phase``).
        crashed: whether a task's client crashes before training (an injected fault): it leaves the
            global generator as it was, so it never is the "last client that trained".
        server_state: the strategy's server state (``strategy.state_dict``), compared between ranks each phase.
    """

    def __init__(
        self,
        ranks: ranks_module.Ranks,
        state: RunState,
        loop: LocalLoop,
        crashed: Callable[[int, ClientTask], bool],
        server_state: Callable[[], Any] = dict,
    ):
        self.ranks, self.state, self.loop, self.crashed = ranks, state, loop, crashed
        self.server_state = server_state
        self._error: Exception | None = None

    def updates(
        self,
        rnd: int,
        tasks: list[ClientTask],
        run_share: RunShare,
        tally: RoundTally,
        progress: RoundProgress,
    ) -> Iterator[ClientUpdate]:
        """Every rank's updates of the phase in task order; ``tally`` records what one process would: every
        delivered update's metrics, in task order, and every rank's lost updates and training steps.

        Args:
            rnd: the round.
            tasks: the phase's tasks (the same on every rank).
            run_share: the orchestrator's client runner (``_client_updates(rnd, tasks, tally)``).
            tally: the round's tally.
            progress: the progress bar (advanced for the clients of the other ranks too).
        """
        mine = shard(tasks, self.ranks.rank, self.ranks.world)
        server = fingerprint(self.server_state())  # before the phase: the state its tasks were configured from
        share = RoundTally()  # this rank's lost updates and steps; its metrics are rebuilt in task order below
        record = self._run(rnd, tasks, mine, run_share, share)
        record["server"] = server
        record["trained"] = self.state.shares.take()  # the clients this rank trained: summary.json's ranks block
        records = ranks_module.exchange(record)
        for rank, other in enumerate(records):
            self.state.shares.add(rank, other["trained"])
        self._raise_first_error(records)
        check_same_server(records, rnd)
        merged = self._merge(rnd, tasks, records)
        for rank in [self.ranks.rank] + [r for r in range(len(records)) if r != self.ranks.rank]:  # this rank first
            for key, count in records[rank]["events"].items():
                tally.count(key, count)
            tally.add_steps(records[rank]["steps"])
        for _, update, _ in merged:
            tally.add_metrics(update.metrics)
        for _ in range(len(tasks) - len(mine)):
            progress.client_done()
        device, delivered = self.ranks.device, -1
        for position, update, generators in merged:
            _restore(generators, device)  # as if this update's client had just trained here
            # another rank's update reaches this device only now: one at a time, as one process streams them
            yield update if isinstance(update, ClientUpdate) else unpack(update.message, device)
            delivered = position
        last = max(records, key=lambda r: r["last_trained"])
        if last["last_trained"] > delivered:  # clients after the last update trained (their updates were lost)
            _restore(last["end_generators"], device)

    def _run(
        self,
        rnd: int,
        tasks: list[ClientTask],
        mine: list[int],
        run_share: RunShare,
        share: RoundTally,
    ) -> dict[str, Any]:
        """Trains this rank's share (its lost updates and steps counted in ``share``); returns what the other ranks
        need of it."""
        device = self.ranks.device
        ledger, self.state.ledger = self.state.ledger, CommunicationLedger()  # replayed for all ranks in _merge
        positions, updates, generators, error = [], [], [], None
        try:
            pending = iter(mine)
            for update in run_share(rnd, [tasks[p] for p in mine], share):
                position = next(p for p in pending if tasks[p].client.id == update.client.id)
                positions.append(position)
                updates.append(update)
                generators.append(_generators(device))
        except Exception as err:  # noqa: BLE001 - every rank must reach the exchange, then all stop with it
            # the failing task: the first after the last delivered update that trains (a crash never fails);
            # a lower bound when other updates were lost in between, which decides which rank's error wins
            after = [p for p in mine if p > (positions[-1] if positions else -1) and not self.crashed(rnd, tasks[p])]
            error = {
                "rank": self.ranks.rank,
                "position": after[0] if after else len(tasks),
                "diverged": isinstance(err, Diverged),
                "config": isinstance(err, ConfigError),
                "message": str(err),
                "round": getattr(err, "round", rnd),
            }
            self._error = err  # re-raised here with its traceback; the others get its message
        finally:
            self.state.ledger = ledger
        self._own_updates = updates
        trained = [p for p in mine if not self.crashed(rnd, tasks[p])]
        client_states = self.state.client_states
        return {
            "positions": positions,
            # on CPU the host's memory is the device's: one message for the phase costs less (2 ranks: 1.85x vs 1.81x)
            "updates": updates if device.type == "cpu" else [_Sent.of(update) for update in updates],
            "generators": generators,
            "last_trained": trained[-1] if trained else -1,
            "end_generators": _generators(device),
            "states": {tasks[p].client.id: client_states.get(tasks[p].client.id) for p in mine},
            "events": dict(share.events),
            "steps": dict(share.steps),
            "optimizers": {
                role: self.loop.slots[role].optimizer.state_dict()
                for role, owner in self._last_trainers(rnd, tasks).items()
                if owner == self.ranks.rank
            },
            "error": error,
        }

    def _last_trainers(self, rnd: int, tasks: list[ClientTask]) -> dict[str, int]:
        """For ``shared_per_phase``: per role, the rank of the phase's last client that trains it (not crashed).

        That client's optimizer state is what one process would carry into the next phase.
        """
        if self.loop.training.optimizer_state != "shared_per_phase":
            return {}
        owners = {p: r for r in range(self.ranks.world) for p in shard(tasks, r, self.ranks.world)}
        last: dict[str, int] = {}
        for position, task in enumerate(tasks):
            if not self.crashed(rnd, task):
                last.update(dict.fromkeys(task.client.roles, owners[position]))
        return last

    def _raise_first_error(self, records: list[dict[str, Any]]) -> None:
        """Stops every rank with the error of the first failing task in task order, as one process would."""
        errors = [r["error"] for r in records if r["error"] is not None]
        if not errors:
            return
        first = min(errors, key=lambda e: (e["position"], e["rank"]))
        if first["rank"] == self.ranks.rank and self._error is not None:
            raise self._error
        if first["diverged"]:
            raise Diverged(first["message"], first["round"])
        if first["config"]:
            raise ConfigError(first["message"])
        raise RuntimeError(f"rank {first['rank']} failed: {first['message']}")

    def _merge(
        self,
        rnd: int,
        tasks: list[ClientTask],
        records: list[dict[str, Any]],
    ) -> list[tuple[int, ClientUpdate, Any]]:
        """Takes the other ranks' client states and optimizer states and replays the ledger in task order; returns
        every delivered update as (task position, update, the generators after its client), in task order."""
        client_states = self.state.client_states
        for rank, record in enumerate(records):
            if rank == self.ranks.rank:
                record["updates"] = self._own_updates  # the objects themselves, not their messages
                continue
            for client_id, client_state in record["states"].items():
                client_states.close(client_id, client_state or {})  # no state: the client has none
            for role, optimizer_state in record["optimizers"].items():
                self.loop.slots[role].optimizer.load_state_dict(optimizer_state)
        merged = sorted(
            (
                (position, update, generators)
                for record in records
                for position, update, generators in zip(record["positions"], record["updates"], record["generators"])
            ),
            key=lambda item: item[0],
        )
        delivered = {position: update for position, update, _ in merged}
        for position, task in enumerate(tasks):
            self.state.ledger.record(rnd, "downlink", task.downlink)
            if position in delivered:
                self.state.ledger.record_sizes(rnd, "uplink", _sizes(delivered[position]))
        return merged
