"""FedProto: Tan et al., "FedProto: Federated Prototype Learning across Heterogeneous Clients", AAAI 2022
(Sec. 3-4, Algorithm 1; a baseline of paper 004)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import NonNegative
from ..federation.padding import class_index, real_rows
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, StateDict
from ..knowledge.banks import ClassBank
from ..knowledge.class_stats import ClassStatistics, ClassStatsCollector
from .base import PersonalModels, ServerContext, Split, Strategy

ABSENT_CLASS_LOGIT = -1e9  # a class without a global prototype is never the nearest one


def prototype_loss(features: Tensor, labels: Tensor, prototypes: Tensor, available: Tensor) -> Tensor:
    """The prototype regulariser: squared distance of each representation to its class's global prototype.

    Summed over the samples whose class has a prototype and divided by ``B x D`` (every element of the
    batch): the official code's ``MSELoss`` against a copy of the batch whose rows are replaced by the
    prototype where one exists (rows without one contribute 0 but count in the mean). In a padded batch
    (batched clients in lockstep) the padded rows are left out and B counts the real rows.

    Args:
        features: ``[B, D]`` representations.
        labels: ``[B]`` classes.
        prototypes: ``[C, D]`` global prototypes.
        available: ``[C]`` bool, classes that have a global prototype.
    """
    # fixed shapes, no branch on a tensor (batched clients, CUDA graphs): absent classes' rows count 0
    classes, rows = class_index(labels), real_rows()
    squared = (features - prototypes[classes]).pow(2)
    covered = available[classes][:, None]
    if rows is not None:
        covered = covered & rows[:, None]
    total = torch.where(covered, squared, torch.zeros_like(squared)).sum()
    return total / (features.numel() if rows is None else rows.sum() * features.shape[1])


def prototype_head(prototypes: Tensor, available: Tensor) -> dict[str, Tensor]:
    """A linear head that classifies by the nearest prototype (L2): ``W = 2 P``, ``b = -||P_c||^2``.

    ``argmin_c ||h - P_c||^2 = argmax_c (2 P_c . h - ||P_c||^2)`` because ``||h||^2`` is the same for every
    class, so nearest-prototype inference runs as an ordinary head and the evaluator needs no special
    case; the cross-entropy of these logits is that of ``softmax(-||h - P_c||^2)``. Classes without a
    prototype get the bias ``ABSENT_CLASS_LOGIT`` and are never predicted.
    """
    weight = 2.0 * prototypes * available[:, None]
    bias = torch.where(
        available, -prototypes.pow(2).sum(1), torch.full_like(available, ABSENT_CLASS_LOGIT, dtype=prototypes.dtype)
    )
    return {"weight": weight, "bias": bias}


@dataclass
class FedProtoState:
    """What FedProto's server keeps between rounds."""

    bank: ClassBank  # the last round's uploaded prototypes per class: the global prototypes are their mean


class FedProto(PersonalModels, Strategy):
    """Personal heterogeneous models that exchange per-class mean representations (prototypes).

    Client k keeps its own model (features then head). Each round it receives the global prototypes
    ``P_c`` and trains on ``CE(head(h), y) + lam * R(h, P_y)`` (Sec. 4), ``R`` the squared L2 distance to
    the class's global prototype (:func:`prototype_loss`). While it trains it sums its representations
    per class (training-mode forward, before each step) and uploads the class means of the ``S`` classes
    it holds with their labels (``S x (D + 1)`` numbers). The server averages each round's uploads per
    class (uniformly, or weighted by class counts) and sends the ``R`` classes that have a global
    prototype (``R x (D + 1)`` numbers). Every model's representation must have the same size D.

    Inference is by the nearest global prototype (``inference: prototypes``), run as a linear head
    (:func:`prototype_head`), or by each client's own head (``local_head``); before the first prototypes
    exist the own head is used. Which weighting the paper and the official code use:
    ``docs/algorithms.md``, FedProto.

    Args:
        lam: lambda, weight of the prototype regulariser (1 in the official scripts).
        weighting: ``uniform`` (official code) or ``samples`` (paper: weighted by class counts, which
            travel with the upload).
        inference: ``prototypes`` (nearest global prototype) or ``local_head``.
        split: where personal models are evaluated: ``test`` (each client's local test split, paper 004
            and the FedProto paper) or ``global``.
    """

    needs_split = True  # reads the models' features and head apart

    state: FedProtoState
    central_privacy = True

    def __init__(
        self,
        lam: NonNegative = 1.0,
        weighting: Literal["uniform", "samples"] = "uniform",
        inference: Literal["prototypes", "local_head"] = "prototypes",
        split: Split = "test",
    ):
        self.lam, self.weighting, self.inference, self.split = lam, weighting, inference, split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        feature_dim = server.shared_feature_dim(
            "averages representations across models",
            "Give all builders the same representation size (e.g. hidden: 64).",
        )
        if self.inference == "prototypes":
            server.require_prototype_inference()
        self.num_classes, self.feature_dim = server.data.num_classes, feature_dim
        self.state = FedProtoState(ClassBank(self.num_classes, self.feature_dim))

    # ------------------------------------------------------------------ server -> client
    def global_prototypes(self) -> ClassStatistics:
        """The global prototypes of the classes that have one (compact: ``R x (D + 1)`` numbers)."""
        bank = self.state.bank
        padded = ClassStatistics.padded("global_prototypes", {"prototypes": bank.mean()}, bank.available)
        return padded.compact()

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        prototypes = self.global_prototypes()
        return [ClientTask(c, rnd, {"global_prototypes": prototypes}) for c in clients]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        device = ctx.data_x.device
        received = task.received("global_prototypes", ClassStatistics)
        prototypes, available = dense_prototypes(received, self.num_classes, device)
        # at one address per name (CUDA graphs keep their key)
        prototypes, available = ctx.on_device("prototypes", prototypes), ctx.on_device("has", available)
        collector = ClassStatsCollector(self.num_classes, {"prototypes": self.feature_dim}, device)
        lam = self.lam  # a value, not the strategy, in the closure

        @vmappable  # pure: the representations go out as its record
        def step(module, batch, i):
            x, y = batch
            h = module.features(x)
            loss = F.cross_entropy(module.head(h), y)
            if lam:
                loss = loss + lam * prototype_loss(h, y, prototypes, available)
            return loss, (y, h)  # training-mode representations, before the step

        stats = ctx.fit(role, step_fn=step, on_record=lambda record: collector.add(record[0], prototypes=record[1]))
        ctx.state["weights"] = ctx.weights(role)
        upload = collector.result("local_prototypes")
        if self.weighting == "samples":  # the class counts travel with the prototypes
            upload.vectors["counts"] = collector.counts[:, None].float()
        return ClientUpdate(
            task.client, ctx.num_examples(), {"local_prototypes": upload.compact()}, {f"{role}/loss": stats["loss"]}
        )

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        bank = self.state.bank = ClassBank(self.num_classes, self.feature_dim)  # this round's uploads only
        for update in updates:
            upload = update.sent("local_prototypes", ClassStatistics)
            labels = upload.labels.long().cpu()
            vectors = torch.zeros(self.num_classes, self.feature_dim)
            vectors[labels] = upload.vectors["prototypes"].detach().cpu()
            present = torch.zeros(self.num_classes, dtype=torch.bool)
            present[labels] = True
            weights = None
            if self.weighting == "samples":
                weights = torch.zeros(self.num_classes, dtype=torch.float64)
                weights[labels] = upload.vectors["counts"][:, 0].detach().cpu().double()
            bank.add(vectors, present, weights)
        if self.server.central_noise is not None:  # central privacy: the noised sums over the expected uploads
            noised, expected = self.server.private_sum({"sums": bank.sums}, self.server.clients)
            bank.sums, bank.counts = noised["sums"], torch.full_like(bank.counts, expected)
        return {"server/classes_with_prototype": float(bank.available.sum())}

    # ------------------------------------------------------------------ evaluation
    def personal_weights(self, client: ClientSpec, state: dict) -> tuple[str, StateDict]:
        """The client's model; with prototype inference its head is the nearest-prototype one."""
        role, weights = super().personal_weights(client, state)
        bank = self.state.bank
        if self.inference == "prototypes" and bank.available.any():
            device = weights["head.weight"].device
            head = prototype_head(bank.mean().to(device), bank.available.to(device))
            weights = {**weights, **{f"head.{k}": v.to(weights[f"head.{k}"].dtype) for k, v in head.items()}}
        return role, weights


def dense_prototypes(received: ClassStatistics, num_classes: int, device) -> tuple[Tensor, Tensor]:
    """``[C, D]`` prototypes and ``[C]`` availability from a compact payload (zeros where absent)."""
    rows, labels = received.vectors["prototypes"], received.labels.long()
    prototypes = torch.zeros(num_classes, rows.shape[1], device=device)
    available = torch.zeros(num_classes, dtype=torch.bool, device=device)
    prototypes[labels.to(device)] = rows.to(device)
    available[labels.to(device)] = True
    return prototypes, available
