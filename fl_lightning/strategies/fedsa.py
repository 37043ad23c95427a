"""FedSA: "FedSA: A Unified Representation Learning via Semantic Anchors for Prototype-based Federated Learning",
AAAI 2025 (the official code lokinko/FedSA)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import Fraction01, NonNegative
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, TensorPayload
from ..knowledge.class_stats import ClassStatsCollector
from ..knowledge.semantic_anchors import (
    anchor_regularisation,
    classifier_calibration,
    initial_anchors,
    margin_contrastive_loss,
    mean_nearest_distance,
)
from .base import ServerContext, Split
from .fedproto import FedProto, FedProtoState


@dataclass
class FedSAState(FedProtoState):
    """FedProto's bank of the round's prototypes and the semantic anchors."""

    anchors: Tensor  # [C, D]


class FedSA(FedProto):
    """Personal heterogeneous models trained toward semantic anchors shared by all, whatever their architecture.

    The server holds one semantic anchor per class (:func:`~fl_lightning.knowledge.semantic_anchors.initial_anchors`:
    random rows through a random projector, from the run's seed) and sends them every round (``C x D`` numbers).
    Client k keeps its own model and trains on ``CE + calibration * CE(head(A), classes) + lam * MSE(h, A_y) +
    margin_contrastive * CE(-(||h - A_c|| + gap [c = y]), y)``: the head classifies the anchors as their classes,
    each representation is pulled to its class's anchor, and the distances to the anchors, the own class's
    lengthened by the margin ``gap`` = the larger of the anchors' mean nearest-anchor distance and that of the
    client's own prototypes of its previous round (0 before it has any; none with one class). While it trains it
    averages its representations per class (training mode, before each step) and uploads them, ``S x (D + 1)``
    numbers for S classes. The server averages the round's uploads per class, uniformly (FedProto's server), and
    moves each uploaded class's anchor: ``A_c = momentum A_c + (1 - momentum) P_c``. Clients are evaluated by the
    nearest of the averaged prototypes (FedProto's inference). Every model's representation must have the same
    size D. Paper and official code: ``docs/algorithms.md``, FedSA.

    Args:
        lam: weight of the anchor regularisation (10 in the official scripts).
        margin_contrastive: weight of the margin-enhanced contrastive loss (1).
        calibration: weight of the classifier calibration (1).
        momentum: the anchors' share kept at each update (0.9999 in the official code).
        split: where personal models are evaluated: ``test`` (each client's local test split) or ``global``.
    """

    state: FedSAState

    def __init__(
        self,
        lam: NonNegative = 10.0,
        margin_contrastive: NonNegative = 1.0,
        calibration: NonNegative = 1.0,
        momentum: Fraction01 = 0.9999,
        split: Split = "test",
    ):
        super().__init__(lam, "uniform", "prototypes", split)
        self.margin_contrastive, self.calibration, self.momentum = margin_contrastive, calibration, momentum

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        anchors = initial_anchors(self.num_classes, self.feature_dim, server.seed)
        self.state = FedSAState(self.state.bank, anchors)

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        anchors = TensorPayload("semantic_anchors", {"anchors": self.state.anchors})
        return [ClientTask(c, rnd, {"semantic_anchors": anchors}) for c in clients]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        device = ctx.data_x.device
        anchors = task.received("semantic_anchors", TensorPayload).tensors["anchors"].to(device)
        local_gap = ctx.state.get("local_gap")  # the client's own prototypes' margin, from its last round
        gap = max(mean_nearest_distance(anchors), float(local_gap) if local_gap is not None else 0.0)
        collector = ClassStatsCollector(self.num_classes, {"prototypes": self.feature_dim}, device)
        step = anchor_step(ctx.on_device("anchors", anchors), gap, self.lam, self.margin_contrastive, self.calibration)
        stats = ctx.fit(role, step_fn=step, on_record=lambda record: collector.add(record[0], prototypes=record[1]))
        ctx.state["weights"] = ctx.weights(role)
        upload = collector.result("local_prototypes").compact()
        ctx.state["local_gap"] = torch.tensor(mean_nearest_distance(upload.vectors["prototypes"]))
        return ClientUpdate(
            task.client, ctx.num_examples(), {"local_prototypes": upload}, {f"{role}/loss": stats["loss"]}
        )

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        metrics = super().aggregate(rnd, updates)  # the round's prototypes, averaged per class
        bank, anchors = self.state.bank, self.state.anchors
        moved = self.momentum * anchors + (1 - self.momentum) * bank.mean().to(anchors)
        self.state.anchors = torch.where(bank.available.to(anchors.device)[:, None], moved, anchors)
        return {**metrics, "server/anchor_margin": mean_nearest_distance(self.state.anchors)}


def anchor_step(anchors: Tensor, gap: float, lam: float, margin_contrastive: float, calibration: float):
    """The client's step: cross-entropy plus the three anchor-based terms, pure (batched clients, CUDA graphs)."""

    @vmappable  # pure: the representations go out as its record
    def step(module, batch, i):
        x, y = batch
        h = module.features(x)
        loss = F.cross_entropy(module.head(h), y)
        loss = loss + calibration * classifier_calibration(module.head(anchors))
        loss = loss + lam * anchor_regularisation(h, y, anchors)
        loss = loss + margin_contrastive * margin_contrastive_loss(h, y, anchors, gap)
        return loss, (y, h)

    return step
