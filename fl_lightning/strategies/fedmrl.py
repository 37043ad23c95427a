"""FedMRL: Yi et al., "Federated Model Heterogeneous Matryoshka Representation Learning", NeurIPS 2024."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.joint import fit_jointly
from ..client.steps import vmappable
from ..federation.errors import ConfigError
from ..federation.seeding import Stream, derive_seed
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    StateDict,
    clone_state,
    load_exchanged,
)
from ..knowledge import WeightedAverage
from ..knowledge.matryoshka import FusedModel, fuse, matryoshka_losses, projector
from .base import PersonalModels, SentWeights, ServerContext, Split, Strategy, global_metrics

PROJECTOR_INIT = 1  # the step part of a client's projector seed (its model's is 0): two streams of one client


@dataclass
class FedMRLState:
    """What FedMRL's server carries from round to round."""

    small_weights: StateDict  # the global small homogeneous model


class FedMRL(PersonalModels, Strategy):
    """A shared small model beside each client's own, their representations fused, Matryoshka heads.

    Every client trains, on each batch, its own model (any architecture, never sent), a copy of the shared
    small model (one architecture, representation size ``d1``) and its own projector (``d1 + d2 -> d2``, kept
    on the client across rounds): the projector fuses the two representations, ``fused = P [r_small ‖ r_own]``;
    the own head reads all ``d2`` dimensions of ``fused``, the small model's head the first ``d1``; the loss is
    the sum of the two cross-entropies (:mod:`~fl_lightning.knowledge.matryoshka`). Only the small model
    travels, ``|small|`` numbers each way per client, and the server averages it. A tier lists the client's
    own role and the small role, e.g. ``roles: [cnn_large, small]``.

    A client's model is its own head on the fused representation (``personal/``); the global small model is
    evaluated alone on the global test set (``<small_role>/test_acc``). Paper, official code and HtFLlib:
    ``docs/algorithms.md``, FedMRL.

    Args:
        small_role: the role of the shared small model.
        weighted: weight the small model's average by labeled examples (the official code), or not (HtFLlib).
        evaluate_small: the small model inside a client's fused model when evaluated: the client's copy after
            its last local training (``local``, the official code), or the current global one (``global``,
            HtFLlib).
        split: where the clients' models are evaluated: ``test`` or ``global``.
    """

    needs_split = True  # reads the models' features and heads apart

    state: FedMRLState

    def __init__(
        self,
        small_role: str = "small",
        weighted: bool = True,
        evaluate_small: Literal["local", "global"] = "local",
        split: Split = "test",
    ):
        self.small_role, self.weighted, self.evaluate_small, self.split = small_role, weighted, evaluate_small, split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_private_and_shared_role(self.small_role, "small")
        self.global_dim = server.feature_dim(self.small_role)
        local_roles = sorted({self.personal_role(c) for c in server.clients})
        too_small = {r: server.feature_dim(r) for r in local_roles if server.feature_dim(r) < self.global_dim}
        if too_small:
            raise ConfigError(
                f"FedMRL's small model reads the first d1 = {self.global_dim} dimensions of the fused representation, "
                f"whose size is each client model's own, but roles {too_small} (their sizes) are smaller; give the "
                f"small model a representation no larger than every client model's (e.g. hidden: 32)."
            )
        self.state = FedMRLState(server.initial_weights(self.small_role))
        self.outgoing = SentWeights(server, [self.small_role])  # a frozen part of the small model stays home
        small = server.model(self.small_role)
        self.fused_models = {
            role: FusedModel(small, server.model(role), self.projector_of(role).to(_device(server.model(role))))
            for role in local_roles
        }

    def personal_role(self, client: ClientSpec) -> str:
        """The client's own model: its role other than the small one."""
        return next(r for r in client.roles if r != self.small_role)

    def projector_of(self, role: str, client_id: int | None = None) -> nn.Linear:
        """A projector for the clients of ``role``; with ``client_id``, that client's initial one (seeded from its
        id, without touching torch's global generator)."""
        with torch.random.fork_rng(devices=[]):
            if client_id is not None:
                torch.manual_seed(derive_seed(self.server.seed, PROJECTOR_INIT, client_id, Stream.CLIENT_INIT))
            return projector(self.global_dim, self.server.feature_dim(role))

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        small = self.outgoing(self.small_role, self.state.small_weights)
        return [ClientTask(c, rnd, {self.small_role: small}) for c in clients]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        local, weights = self.personal_weights(task.client, ctx.state)
        small, global_dim = self.small_role, self.global_dim
        ctx.load(local, weights)
        load_exchanged(ctx.load(small).model, task.received(small, ModelWeights).state)
        fusion = ctx.helper("projector", self.projector_of(local, task.client.id), ctx.state.get("projector"))

        @vmappable  # pure: replayed from CUDA graphs (runtime.cuda_graphs)
        def step(modules, batch, i):
            x, y = batch
            fused = fuse(fusion, modules[small].features(x), modules[local].features(x))
            local_loss, global_loss = matryoshka_losses(fused, y, modules[local].head, modules[small].head, global_dim)
            return {local: local_loss, small: global_loss}

        losses = fit_jointly(ctx, (local, small), step, helpers=[fusion])
        ctx.state["weights"] = ctx.weights(local)
        ctx.state["projector"] = clone_state(fusion.state_dict())  # personal: it persists across rounds
        trained_small = ctx.weights(small)
        if self.evaluate_small == "local":
            ctx.state["small"] = trained_small
        metrics = {f"{role}/loss": loss for role, loss in losses.items()}
        return ClientUpdate(task.client, ctx.num_examples(), {small: self.outgoing(small, trained_small)}, metrics)

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        average = WeightedAverage()
        for update in updates:
            weights = update.sent(self.small_role, ModelWeights).state
            average.add(weights, update.num_samples if self.weighted else 1.0)
        if average.count:
            self.state.small_weights = {**self.state.small_weights, **average.result()}
        return {}

    def fused_weights(self, client: ClientSpec, state: dict) -> tuple[str, StateDict]:
        """The weights of the client's fused model (its own model, projector and small model), under its own
        role's name (:attr:`fused_models`)."""
        role, local = self.personal_weights(client, state)
        small = self.state.small_weights
        if self.evaluate_small == "local" and "small" in state:
            small = state["small"]
        projection = state.get("projector")
        if projection is None:
            projection = self.projector_of(role, client.id).state_dict()
        parts = {"global_model": small, "local_model": local, "projector": projection}
        return role, {f"{part}.{k}": v for part, weights in parts.items() for k, v in weights.items()}

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        """The clients' fused models (``personal/``) and the global small model alone on the global test set."""
        personal = evaluator.personalized(self.fused_weights, split=self.split, models=self.fused_models)
        return {**personal, **global_metrics(evaluator, {self.small_role: self.state.small_weights})}


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device
