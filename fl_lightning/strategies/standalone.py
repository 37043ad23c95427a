"""Standalone ("Private") baseline: every client trains its own model on its own data, nothing is exchanged."""

from __future__ import annotations

from collections.abc import Iterator

from ..client.context import ClientContext
from ..federation.types import ClientSpec, ClientTask, ClientUpdate
from .base import PersonalModels, ServerContext, Split, Strategy


class Standalone(PersonalModels, Strategy):
    """Local training only (FedHe's "Private" baseline, FedGH's "Standalone").

    Sampled clients train their own persistent model; no payload crosses the network, so the ledger
    stays at zero. The server keeps no state.

    Args:
        split: where personal models are evaluated: the ``global`` test set or each client's local
            ``test`` (or ``val``) split.
    """

    def __init__(self, split: Split = "global"):
        self.split = split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()

    def configure_round(self, rnd: int, clients: list[ClientSpec], phase: str = "train") -> list[ClientTask]:
        return [ClientTask(c, rnd) for c in clients]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        loss = ctx.fit(role)["loss"]
        ctx.state["weights"] = ctx.weights(role)
        return ClientUpdate(task.client, ctx.num_examples(), {}, {f"{role}/loss": loss})

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "train") -> dict[str, float]:
        for _ in updates:  # nothing reaches the server
            pass
        return {}
