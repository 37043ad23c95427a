"""FedTGP: Zhang et al., "FedTGP: Trainable Global Prototypes with Adaptive-Margin-Enhanced Contrastive Learning
for Data and Model Heterogeneity in Federated Learning", AAAI 2024 (as the official code, which HtFLlib ships)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import NonNegative, NonNegativeInt, Positive, PositiveInt
from ..federation.seeding import Owner, Stream, derive_seed
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, StateDict
from ..knowledge.banks import ClassBank
from ..knowledge.class_stats import ClassStatistics, class_means
from ..knowledge.trainable_prototypes import TrainablePrototypes, adaptive_margin, margin_contrastive_loss
from .base import PersonalModels, ServerContext, Split, Strategy
from .fedproto import dense_prototypes, prototype_head, prototype_loss


@dataclass
class FedTGPState:
    """What FedTGP's server carries from round to round."""

    network: TrainablePrototypes  # the trainable global prototypes, trained further every round
    prototypes: Tensor | None = None  # [C, D] the network's prototypes after the last round; None before the first


class FedTGP(PersonalModels, Strategy):
    """Personal heterogeneous models guided by global prototypes that the server trains.

    Client k keeps its own model. Each round it receives the C global prototypes ``P_c`` (none in the
    first round), trains on ``CE(head(h), y) + lam * MSE(h, P_y)`` (the FedProto regulariser
    :func:`~fl_lightning.strategies.fedproto.prototype_loss`), then uploads the mean representation of each
    class it holds, computed in eval mode over its training data (``S x (D + 1)`` numbers with the labels).
    The server trains a persistent :class:`~fl_lightning.knowledge.trainable_prototypes.TrainablePrototypes`
    on the round's uploads for ``server_epochs`` epochs of SGD (``server_lr``, batches of
    ``server_batch_size`` uploaded prototypes) with the adaptive-margin contrastive loss, and
    sends its C prototypes (``C x (D + 1)`` numbers). Every model's representation must have the same size.

    Inference is by the nearest global prototype (``inference: prototypes``, the official code), run as a
    linear head, or by each client's own head (``local_head``); before the first prototypes exist the own
    head is used. Paper, official code and HtFLlib: ``docs/algorithms.md``, FedTGP.

    Args:
        lam: lambda, weight of the prototype regulariser (HtFLlib's default 1; its scripts use 10).
        margin_threshold: tau, the cap of the adaptive margin (100).
        server_epochs: epochs over the round's uploaded prototypes (100 in HtFLlib, 1000 in the official code).
        server_lr: the server's SGD learning rate (both codes use the clients' learning rate).
        server_batch_size: uploaded prototypes per server step (both codes: the clients' batch size).
        hidden_dim: hidden width of the prototype network (the feature size when None, as the code).
        inference: ``prototypes`` (nearest global prototype) or ``local_head``.
        split: where personal models are evaluated: ``test`` (each client's local test split) or ``global``.
    """

    name = "FedTGP"
    needs_split = True  # reads the models' features and head apart

    state: FedTGPState

    def __init__(
        self,
        lam: NonNegative = 1.0,
        margin_threshold: NonNegative = 100.0,
        server_epochs: NonNegativeInt = 100,
        server_lr: Positive = 0.01,
        server_batch_size: PositiveInt = 10,
        hidden_dim: PositiveInt | None = None,  # null: the feature size
        inference: Literal["prototypes", "local_head"] = "prototypes",
        split: Split = "test",
    ):
        self.lam, self.margin_threshold, self.server_epochs = lam, margin_threshold, server_epochs
        self.server_lr, self.server_batch_size, self.hidden_dim = server_lr, server_batch_size, hidden_dim
        self.inference, self.split = inference, split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        feature_dim = server.shared_feature_dim(
            "trains one prototype per class for every model's representation",
            "Give all builders the same representation size (e.g. hidden: 64).",
        )
        if self.inference == "prototypes":
            server.require_prototype_inference()
        self.num_classes, self.feature_dim = server.data.num_classes, feature_dim
        with torch.random.fork_rng(devices=[]):  # the server's own initialisation, from the run's seed alone
            torch.manual_seed(derive_seed(server.seed, 0, Owner.SERVER, Stream.CLIENT_INIT))
            network = TrainablePrototypes(self.num_classes, self.feature_dim, self.hidden_dim)
        self.state = FedTGPState(network.to(server.data.x.device))

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        prototypes = self.state.prototypes
        if prototypes is None:
            return [ClientTask(c, rnd) for c in clients]
        every = torch.ones(self.num_classes, dtype=torch.bool, device=prototypes.device)
        sent = ClassStatistics.padded("global_prototypes", {"prototypes": prototypes}, every)
        return [ClientTask(c, rnd, {"global_prototypes": sent}) for c in clients]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        step = None  # the first round: cross-entropy alone
        if "global_prototypes" in task.downlink and self.lam:
            received = task.received("global_prototypes", ClassStatistics)
            prototypes, available = dense_prototypes(received, self.num_classes, ctx.data_x.device)
            # at one address per name (CUDA graphs keep their key)
            prototypes, available = ctx.on_device("prototypes", prototypes), ctx.on_device("has", available)
            step = regularised_step(self.lam, prototypes, available)
        stats = ctx.fit(role, step_fn=step)
        ctx.state["weights"] = ctx.weights(role)
        module.eval()
        upload = class_means(
            module.features,
            ctx.data_x,
            ctx.data_y,
            ctx.indices.train,
            ctx.eval_batch_size,
            ("prototypes", self.feature_dim),
            self.num_classes,
            "local_prototypes",
        )
        return ClientUpdate(
            task.client, ctx.num_examples(), {"local_prototypes": upload}, {f"{role}/loss": stats["loss"]}
        )

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        device = self.state.network.embedding.weight.device
        bank, rows, labels = ClassBank(self.num_classes, self.feature_dim, device), [], []
        for update in updates:
            upload = update.sent("local_prototypes", ClassStatistics)
            bank.add_statistics(upload, "prototypes")
            rows.append(upload.vectors["prototypes"].detach().to(device))
            labels.append(upload.labels.long().to(device))
        if not rows:
            return {}
        margin = adaptive_margin(bank.mean(), bank.available, self.margin_threshold)
        loss = self.train_prototypes(torch.cat(rows).float(), torch.cat(labels), margin)
        with torch.no_grad():
            self.state.network.eval()
            self.state.prototypes = self.state.network().detach().clone()
        return {"server/prototype_loss": loss, "server/margin": margin}

    def train_prototypes(self, rows: Tensor, labels: Tensor, margin: float) -> float:
        """``server_epochs`` epochs of a new SGD over the uploaded prototypes ``rows`` ``[N, D]`` (shuffled,
        the last batch of an epoch smaller); the mean loss."""
        network = self.state.network
        optimizer = torch.optim.SGD(network.parameters(), lr=self.server_lr)
        generator = self.server.round_generator()
        network.train()
        total, steps = 0.0, 0
        for _ in range(self.server_epochs):
            order = torch.randperm(len(rows), generator=generator).to(rows.device)
            for start in range(0, len(rows), self.server_batch_size):
                chosen = order[start : start + self.server_batch_size]
                loss = margin_contrastive_loss(rows[chosen], labels[chosen], network(), margin)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total, steps = total + loss.item(), steps + 1
        return total / max(steps, 1)

    # ------------------------------------------------------------------ evaluation
    def personal_weights(self, client: ClientSpec, state: dict) -> tuple[str, StateDict]:
        """The client's model; with prototype inference its head is the nearest-global-prototype one."""
        role, weights = super().personal_weights(client, state)
        prototypes = self.state.prototypes
        if self.inference == "prototypes" and prototypes is not None:
            device = weights["head.weight"].device
            every = torch.ones(len(prototypes), dtype=torch.bool, device=device)
            head = prototype_head(prototypes.to(device), every)
            weights = {**weights, **{f"head.{k}": v.to(weights[f"head.{k}"].dtype) for k, v in head.items()}}
        return role, weights


def regularised_step(lam: float, prototypes: Tensor, available: Tensor):
    """The client's step: ``CE(head(h), y) + lam * prototype_loss(h, y)``, pure (batched clients, CUDA graphs)."""

    @vmappable
    def step(module, batch, i):
        x, y = batch
        h = module.features(x)
        return F.cross_entropy(module.head(h), y) + lam * prototype_loss(h, y, prototypes, available)

    return step
