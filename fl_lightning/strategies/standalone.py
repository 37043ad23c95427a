"""Standalone ("Private") baseline: every client trains its own model on its own data, nothing is exchanged."""

from __future__ import annotations

from ..client.context import ClientContext
from ..federation.types import ClientSpec, ClientTask, ClientUpdate
from .base import PersonalModels, Phase, ServerContext, Split, Strategy


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

    def phases(self) -> tuple[Phase, ...]:
        return (Phase("train", self.configure_round, self.client_update),)  # no aggregate: nothing reaches the server

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        return [ClientTask(c, rnd) for c in clients]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = self.load_own(task, ctx)[0]
        return self.keep_own(task, ctx, {}, {f"{role}/loss": ctx.fit(role)["loss"]})
