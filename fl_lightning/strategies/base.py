"""The Strategy interface: the few hooks an algorithm overrides.

The orchestrator owns the round loop and calls, per round::

    for phase in strategy.phases:                                     # usually just ("train",)
        tasks   = strategy.configure_round(rnd, sampled_clients, phase)   # what each client receives
        updates = (strategy.client_update(task, ctx) for each task)       # lazily, one client at a time
        strategy.aggregate(rnd, updates, phase)                           # server-side math, streaming
    strategy.evaluate(evaluator)                                      # every eval_every rounds and at the end

A round has several phases when the server must aggregate between two client steps (paper 001: the
auxiliary model is averaged before strong clients distill from it).

Payloads in ``ClientTask.downlink`` and ``ClientUpdate.uplink`` are all that crosses the network, so the
communication ledger counts them without any help from the strategy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

from ..client.context import ClientContext
from ..client.loop import LocalLoop
from ..data import FederatedData
from ..errors import ConfigError
from ..evaluation import Evaluator
from ..seeding import Stream, derive_seed
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

    def initial_weights(self, role: str, client_id: int | None = None) -> StateDict:
        """The role's initial weights: the run's global initialisation, or a client's own one.

        A client's own initialisation (personalized methods, where every client starts from its own
        random model as in FedHe's and Felo's code) is built once from a seed derived from the client id.
        """
        if client_id is None:
            return {k: v.detach().clone() for k, v in self.loop.slots[role].module.model.state_dict().items()}
        return self.loop.fresh_weights(role, derive_seed(self.seed, 0, client_id, Stream.CLIENT_INIT))

    def own_weights(self, client: ClientSpec, stored: StateDict | None) -> StateDict:
        """A personalized client's stored weights, or its own initial ones before its first round."""
        return stored if stored is not None else self.initial_weights(client.roles[0], client.id)

    def require_one_role_per_client(self, method: str) -> None:
        several = [c.id for c in self.clients if len(c.roles) != 1]
        if several:
            raise ConfigError(
                f"{method} gives every client exactly one model; each tier must list one role "
                f"(clients {several[:5]} list several)."
            )


class Strategy:
    """Base class of federated algorithms (one algorithm per file in ``fl_lightning/strategies``).

    Subclasses list the attributes that make up the server state in ``state_attributes``; they are
    saved in checkpoints and restored on resume.
    """

    state_attributes: tuple[str, ...] = ()
    phases: tuple[str, ...] = ("train",)

    def setup(self, server: ServerContext) -> None:
        """Called once before the first round (and before a checkpoint is restored)."""
        self.server = server

    def configure_round(self, rnd: int, clients: list[ClientSpec], phase: str = "train") -> list[ClientTask]:
        """The tasks of ``phase``: usually one per sampled client, but a strategy may address any client
        of ``self.server.clients`` (paper 001's strong clients join every round)."""
        raise NotImplementedError

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        raise NotImplementedError

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "train") -> dict[str, float]:
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
        """The server state as tensors and plain containers only (checkpoints load with weights_only)."""
        return {name: _export(getattr(self, name)) for name in self.state_attributes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name in self.state_attributes:
            setattr(self, name, _restore(getattr(self, name, None), state[name]))


def _export(value: Any) -> Any:
    """Objects with a ``state_dict`` (banks, server optimizers, a CVAE) are saved as that dict."""
    if callable(getattr(value, "state_dict", None)):
        return value.state_dict()
    if isinstance(value, dict):
        return {k: _export(v) for k, v in value.items()}
    return value


def _restore(current: Any, saved: Any) -> Any:
    """Loads ``saved`` into the object that ``setup`` built, or returns it when it is plain data."""
    if callable(getattr(current, "load_state_dict", None)):
        current.load_state_dict(saved)
        return current
    if isinstance(current, dict) and isinstance(saved, dict):
        if any(callable(getattr(v, "load_state_dict", None)) for v in current.values()):
            return {k: _restore(current.get(k), v) for k, v in saved.items()}
    return saved
