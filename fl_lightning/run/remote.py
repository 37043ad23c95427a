"""Clients that run in other processes: the transport a run hands each phase's tasks to, and the client side's
use of the same run.

A run whose clients live elsewhere (Flower's SuperNodes) is still one :func:`~fl_lightning.run.fit.fit` with its
one round loop: the orchestrator samples, configures, aggregates, evaluates, logs and checkpoints as always, and
only the step that turns a phase's tasks into updates goes through a :class:`ClientTransport` instead of the local
loop. A client side builds the same run from the same recipe (its data, models, strategy and client-state store)
and, instead of running rounds, hands the built orchestrator to a ``serve`` function, which runs the tasks it
receives with :meth:`FederationOrchestrator.run_client` (the code ``flrun fit`` runs each client with).

Both are set around a call of ``fit`` with :func:`remote_clients`, so ``fit``'s signature (the recipe's schema)
stays what a recipe may say.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from ..federation.types import ClientTask, ClientUpdate
from .tally import RoundTally

# the orchestrator imports this module, so it is named here by its role only (import-linter: no circles)
FederationOrchestrator = Any


class ClientTransport(Protocol):
    """Runs a phase's tasks on clients elsewhere and hands their updates back in task order.

    It records what the orchestrator's own client runner would: each task's downlink and each delivered update's
    uplink in ``orchestrator.state.ledger``, each delivered update's metrics, each lost update and each client's
    training steps in ``tally``, each trained client's state in ``orchestrator.state.client_states`` (for the
    evaluation of personal models and for checkpoints) and one ``progress.client_done()`` per task.
    """

    def updates(
        self, orchestrator: FederationOrchestrator, rnd: int, tasks: list[ClientTask], tally: RoundTally
    ) -> Iterator[ClientUpdate]: ...


@dataclass(frozen=True)
class RemoteClients:
    """How the run started inside :func:`remote_clients` reaches its clients.

    Attributes:
        transport: the server side: every phase's tasks go through it.
        serve: the client side: called with the built orchestrator instead of running rounds; what it returns is
            what ``fit`` returns.
    """

    transport: ClientTransport | None = None
    serve: Callable[[FederationOrchestrator], dict[str, Any]] | None = None


_REMOTE: contextvars.ContextVar[RemoteClients | None] = contextvars.ContextVar("remote_clients", default=None)


@contextlib.contextmanager
def remote_clients(remote: RemoteClients) -> Iterator[None]:
    """Runs of ``fit`` inside the block reach their clients as ``remote`` says."""
    token = _REMOTE.set(remote)
    try:
        yield
    finally:
        _REMOTE.reset(token)


def current_remote() -> RemoteClients | None:
    """The :class:`RemoteClients` of the enclosing :func:`remote_clients` block; None for a run of its own."""
    return _REMOTE.get()
