"""The Strategy interface: the few hooks an algorithm overrides.

The orchestrator owns the round loop and calls, per round::

    tasks   = strategy.configure_round(rnd, sampled_clients)      # what each client receives
    updates = (strategy.client_update(task, ctx) for each task)   # run lazily, one client at a time
    strategy.aggregate(rnd, updates)                              # server-side math, streaming
    strategy.evaluate(evaluator)                                  # every eval_every rounds and at the end

Payloads in ``ClientTask.downlink`` and ``ClientUpdate.uplink`` are all that crosses the network, so the
communication ledger counts them without any help from the strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from ..client.context import ClientContext
from ..client.loop import LocalLoop
from ..data import FederatedData
from ..evaluation import Evaluator
from ..types import ClientSpec, ClientTask, ClientUpdate, StateDict


@dataclass
class ServerContext:
    """What a strategy may read when it sets up: the population, the data and fresh weights per role."""

    clients: list[ClientSpec]
    roles: list[str]
    data: FederatedData
    rounds: int
    seed: int
    loop: LocalLoop

    def initial_weights(self, role: str) -> StateDict:
        """The role's weights as built from the run seed (identical for every client)."""
        return {k: v.detach().clone() for k, v in self.loop.slots[role].module.model.state_dict().items()}


class Strategy:
    """Base class of federated algorithms (one algorithm per file in ``fl_lightning/strategies``).

    Subclasses list the attributes that make up the server state in ``state_attributes``; they are
    saved in checkpoints and restored on resume.
    """

    state_attributes: tuple[str, ...] = ()

    def setup(self, server: ServerContext) -> None:
        """Called once before the first round (and before a checkpoint is restored)."""
        self.server = server

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        raise NotImplementedError

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        raise NotImplementedError

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        """Consumes the round's updates (each exactly once) and updates the server state.

        Returns server-side metrics to log (may be empty).
        """
        raise NotImplementedError

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        raise NotImplementedError

    @property
    def monitor(self) -> str:
        """The metric that decides the best round (and an Optuna objective by default)."""
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.state_attributes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.state_attributes:
            setattr(self, name, state[name])
