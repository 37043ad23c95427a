"""FPL: Huang et al., "Rethinking Federated Learning with Domain Shift: A Prototype View", CVPR 2023 (the
official code WenkeHuang/RethinkFL)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import NonNegative, Positive
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, TensorPayload, load_exchanged
from ..knowledge import WeightedAverage
from ..knowledge.class_stats import ClassStatistics, ClassStatsCollector
from ..knowledge.clustered_prototypes import clustered_prototypes, fpl_loss, unbiased_prototypes
from .base import ServerContext
from .fedavg import FedAvg, FedAvgState


@dataclass
class FPLState(FedAvgState):
    """FedAvg's global weights per role and the last round's cluster prototypes."""

    clusters: Tensor  # [M, D] the cluster prototypes of every class
    cluster_labels: Tensor  # [M] their classes


class FPL(FedAvg):
    """FedAvg whose clients also learn against clustered class prototypes (federated prototype learning).

    Each sampled client loads its role's global model and trains on ``CE + contrastive * L_CPCL + consistency *
    L_UPCL`` (:func:`~fl_lightning.knowledge.clustered_prototypes.fpl_loss`): ``L_CPCL`` the InfoNCE of the
    representation's cosine similarities (temperature ``tau``) with the cluster prototypes, those of its own class
    the positives and every other class's the negatives; ``L_UPCL`` the squared distance (averaged over D) to its
    class's unbiased prototype, the mean of that class's cluster prototypes. Round 1, before any prototype exists,
    is cross-entropy alone. While it trains the client averages per class its training-mode representations of
    the last local epoch (before each step) and uploads the model and these prototypes (``S x (D + 1)`` numbers
    for S classes). The server averages each role's models (FedAvg) and, per class, clusters the round's uploaded
    prototypes by FINCH (cosine distance, its last partition) and sends each cluster's mean with its class
    (``M x (D + 1)`` numbers); the global models are evaluated.

    Across architectures (one role per architecture, every representation the same size D) each role's model is
    averaged over its clients and the cluster prototypes are shared by all: they are what crosses architectures
    (the paper trains one architecture). Paper and official code: ``docs/algorithms.md``, FPL.

    Args:
        tau: the contrastive temperature (0.02 in the official code).
        contrastive: weight of ``L_CPCL`` (1 in the paper and the official code).
        consistency: weight of ``L_UPCL`` (1).
        (roles, weighted: as FedAvg; ``weighted: true`` is the official code's averaging by examples)
    """

    central_privacy = False  # the prototypes are clustered, not a noised sum

    state: FPLState
    needs_split = True  # reads the models' features and head apart

    def __init__(
        self,
        tau: Positive = 0.02,
        contrastive: NonNegative = 1.0,
        consistency: NonNegative = 1.0,
        roles: list[str] | None = None,
        weighted: bool = True,
    ):
        super().__init__(roles, weighted)
        self.tau, self.contrastive, self.consistency = tau, contrastive, consistency

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        feature_dim = server.shared_feature_dim(
            "clusters every model's class prototypes together",
            "Give all builders the same representation size (e.g. hidden: 64).",
        )
        self.num_classes, self.feature_dim = server.data.num_classes, feature_dim
        self.state = FPLState(self.state.global_weights, torch.zeros(0, feature_dim), torch.zeros(0, dtype=torch.long))

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        tasks = super().configure_round(rnd, clients)
        if len(self.state.clusters):
            clusters = TensorPayload(
                "cluster_prototypes",
                {"prototypes": self.state.clusters, "labels": self.state.cluster_labels.to(torch.int32)},
            )
            tasks = [replace(task, downlink={**task.downlink, "cluster_prototypes": clusters}) for task in tasks]
        return tasks

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role)
        load_exchanged(module.model, task.received(role, ModelWeights).state)
        device = ctx.data_x.device
        step = ce_step  # cross-entropy alone before the first prototypes (the official code's 0 x CE)
        if "cluster_prototypes" in task.downlink and (self.contrastive or self.consistency):
            received = task.received("cluster_prototypes", TensorPayload).tensors
            clusters, labels = received["prototypes"].to(device), received["labels"].to(device).long()
            unbiased, available = unbiased_prototypes(clusters, labels, self.num_classes)
            step = self.local_step(
                ctx.on_device("clusters", clusters),
                ctx.on_device("cluster_labels", labels),
                ctx.on_device("unbiased", unbiased),
                ctx.on_device("has", available),
            )
        records: list[tuple] = []
        stats = ctx.fit(role, step_fn=step, on_record=records.append)
        # the last local epoch's steps (the official code's prototypes): their training-mode representations
        last = records[-epoch_length(ctx) :]
        collector = ClassStatsCollector(self.num_classes, {"prototypes": self.feature_dim}, device)
        for y, h in last:
            collector.add(y, prototypes=h.detach().float())
        uplink = {
            role: self.outgoing(role, module.model.state_dict(), copy=True),
            "local_prototypes": collector.result("local_prototypes").compact(),
        }
        return ClientUpdate(task.client, ctx.num_examples("train"), uplink, {f"{role}/loss": stats["loss"]})

    def local_step(self, clusters: Tensor, labels: Tensor, unbiased: Tensor, available: Tensor):
        """The client's step against the received prototypes, pure (batched clients, CUDA graphs)."""
        tau, contrastive, consistency = self.tau, self.contrastive, self.consistency  # values in the closure

        @vmappable  # pure: the representations go out as its record
        def step(module, batch, i):
            x, y = batch
            h = module.features(x)
            loss = F.cross_entropy(module.head(h), y)
            loss = loss + fpl_loss(h, y, clusters, labels, unbiased, available, tau, contrastive, consistency)
            return loss, (y, h)

        return step

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        averages = {role: WeightedAverage() for role in self.roles}
        rows, labels = [], []
        for update in updates:
            role = update.client.roles[0]
            averages[role].add(update.sent(role, ModelWeights).state, update.num_samples if self.weighted else 1.0)
            upload = update.sent("local_prototypes", ClassStatistics)
            rows.append(upload.vectors["prototypes"].detach().float().cpu())
            labels.append(upload.labels.long().cpu())
        for role, average in averages.items():
            if average.count:  # a frozen part, never sent, stays
                self.state.global_weights[role] = {**self.state.global_weights[role], **average.result()}
        if not rows:
            return {}
        clusters, cluster_labels = clustered_prototypes(torch.cat(rows), torch.cat(labels), self.num_classes)
        self.state.clusters, self.state.cluster_labels = clusters, cluster_labels  # this round's uploads only
        classes = len(torch.unique(cluster_labels))
        return {"server/classes_with_prototype": float(classes), "server/clusters_per_class": len(clusters) / classes}


def epoch_length(ctx: ClientContext) -> int:
    """The steps of one pass over the client's training split, as its batches are drawn (``drop_last``: full batches
    only, at least one)."""
    n = ctx.num_examples()
    return max(1, n // ctx.batch_size) if ctx.loop.training.drop_last else ctx.epoch_steps(n)


@vmappable
def ce_step(module, batch, i):
    """Round 1's step: cross-entropy, the representations recorded for the prototypes."""
    x, y = batch
    h = module.features(x)
    return F.cross_entropy(module.head(h), y), (y, h)
