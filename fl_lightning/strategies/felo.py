"""Felo: Chan & Ngai, heterogeneous federated learning with mid-level features and logits (paper 003)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.steps import vmappable
from ..federation.bounds import Fraction01, NonNegative, NonNegativeInt
from ..federation.padding import class_index
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    Payload,
    Role,
    StateDict,
    load_exchanged,
    payload_of,
)
from ..knowledge import WeightedAverage
from ..knowledge.banks import ClassBank
from ..knowledge.class_stats import ClassStatistics, ClassStatsCollector
from ..knowledge.distillation import logit_distance_rows, masked_row_mean
from .base import PersonalModels, SentWeights, ServerContext, Strategy, global_metrics


@dataclass
class FeloState:
    """What Felo's server carries from round to round."""

    global_weights: dict[Role, StateDict]  # per architecture (role), its averaged model; empty for personal models
    logit_bank: ClassBank  # per class, the sum and count of the received mean logits
    feature_bank: ClassBank  # per class, the sum and count of the received mean features


class Felo(PersonalModels, Strategy):
    """Heterogeneous clients exchange per-class mean features and logits; same architectures average weights.

    Client: trains on ``CE + alpha * (MSE(f, f_s[y]) + D(z, z_s[y]))`` (eq. 1), ``f`` the mid-level feature
    (the model's ``features`` output), ``z`` the logits, ``f_s`` and ``z_s`` the server's class vectors and
    D the KL divergence or the MSE on logits (``logit_loss``). While it trains it sums features and logits
    per class (training-mode forward, before each step) and uploads their class means with the labels.
    Server: averages the received class vectors per class (``ClassBank``) and, with ``average_weights``,
    the weights of the clients of each architecture (one role per architecture, Sec. 3.1.2); weights
    travel without a frozen part. Every role must have the same feature dimension.

    Downlink: one ``class_knowledge`` payload, per class the logits and the features, labels marking the
    classes the server has them for. When the server has logits of classes it has no feature for (Velo,
    before its CVAE trains or when a class has left its feature store) the features travel in a second
    ``class_features`` payload with their own labels, and before any feature exists none are sent.
    Where the defaults follow the paper and the official code: ``docs/algorithms.md``, Felo.

    Args:
        alpha: weight of the feature + logit terms (0.5 in the code).
        logit_loss: ``kl`` (paper) or ``mse`` (the code's default).
        average_weights: FedAvg per architecture (paper) or personal models (code).
        warmup_rounds: cross-entropy only for these rounds (the code starts at 5% of the run).
        forget: each round, old class vectors are down-weighted by ``1 - forget`` (0 keeps the all-time
            average; the code keeps a FIFO of recent uploads).
        loss_average: ``batch`` averages the feature and logit terms over the whole batch, as eq. 1 (a
            sample of a class the server has no vector for adds nothing but counts); ``available`` over the
            samples that have the server's vector only.
    """

    needs_split = True  # reads the models' features and head apart

    state: FeloState

    def __init__(
        self,
        alpha: NonNegative = 0.5,
        logit_loss: Literal["kl", "mse"] = "kl",
        average_weights: bool = True,
        warmup_rounds: NonNegativeInt = 0,
        forget: Fraction01 = 0.0,
        loss_average: Literal["batch", "available"] = "batch",
    ):
        self.alpha, self.logit_loss, self.average_weights = alpha, logit_loss, average_weights
        self.warmup_rounds, self.forget, self.loss_average = warmup_rounds, forget, loss_average

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        self.feature_dim = server.shared_feature_dim(
            "compares features across architectures", "Set the builders' feature sizes equal."
        )
        self.num_classes = server.data.num_classes
        self.state = FeloState(
            {r: server.initial_weights(r) for r in server.roles} if self.average_weights else {},
            ClassBank(self.num_classes, self.num_classes),
            ClassBank(self.num_classes, self.feature_dim),
        )
        self.outgoing = SentWeights(server, server.roles)  # a frozen part stays home

    # ------------------------------------------------------------------ server -> client
    def server_features(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Class features sent to clients and which classes have one; ``None``: no feature source yet (Velo)."""
        return self.state.feature_bank.mean(), self.state.feature_bank.available

    def knowledge_downlink(self) -> dict[str, ClassStatistics]:
        """The class logits and features, each with the classes the server has it for (see the class doc)."""
        logits, have_logits = self.state.logit_bank.mean(), self.state.logit_bank.available
        sent_features = self.server_features()
        if sent_features is None:
            return {"class_knowledge": ClassStatistics.padded("class_knowledge", {"logits": logits}, have_logits)}
        features, have_features = sent_features
        if torch.equal(have_features, have_logits):
            vectors = {"features": features, "logits": logits}
            return {"class_knowledge": ClassStatistics.padded("class_knowledge", vectors, have_logits)}
        return {
            "class_knowledge": ClassStatistics.padded("class_knowledge", {"logits": logits}, have_logits),
            "class_features": ClassStatistics.padded("class_features", {"features": features}, have_features),
        }

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        knowledge = self.knowledge_downlink()
        tasks = []
        for c in clients:
            downlink: dict[str, Payload] = dict(knowledge)
            if self.average_weights:
                role = c.roles[0]
                downlink["weights"] = self.outgoing(role, self.state.global_weights[role])
            tasks.append(ClientTask(c, rnd, downlink))
        return tasks

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        if self.average_weights:
            load_exchanged(ctx.load(role).model, task.received("weights", ModelWeights).state)
        else:
            ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        # the server's class knowledge lives on the CPU; the step indexes it with labels on the client's device
        device = ctx.data_x.device
        (server_f, have_f), (server_z, have_z) = received_targets(task.downlink)
        server_f, have_f, server_z, have_z = (
            ctx.on_device(name, t)
            for name, t in zip(("server_f", "have_f", "server_z", "have_z"), (server_f, have_f, server_z, have_z))
        )
        any_features, any_logits = bool(have_f.any()), bool(have_z.any())
        use = task.round > self.warmup_rounds and (any_logits or any_features)
        dims = {"features": self.feature_dim, "logits": self.num_classes}
        collector = ClassStatsCollector(self.num_classes, dims, device)
        # the step closes over these values, not over the strategy, whose server state (global weights,
        # Velo's stored features) is new every round and would make a new CUDA-graph key every fit
        alpha, loss_average, logit_loss = self.alpha, self.loss_average, self.logit_loss

        @vmappable  # pure: the outputs it observes go out as its record, so clients can train batched
        def step(module, batch, i):
            x, y = batch
            f = module.features(x)
            z = module.head(f)
            loss = F.cross_entropy(z, y)  # ignores a padded row's label PAD (batched clients in lockstep)
            if use:  # each term over the samples whose class the server has it for (an absent term is 0)
                terms, c = [], class_index(y)
                if any_features:  # Velo sends none before its CVAE first trains
                    feature_rows = (f.float() - server_f[c].float()).pow(2).mean(1)
                    terms.append(masked_row_mean(feature_rows, have_f[c], loss_average))
                if any_logits:
                    logit_rows = logit_distance_rows(z, server_z[c], logit_loss)
                    terms.append(masked_row_mean(logit_rows, have_z[c], loss_average))
                loss = loss + alpha * sum(terms[1:], terms[0])
            return loss, (y, f, z)  # training-mode outputs, before the step

        def collect(record):
            collector.add(record[0], features=record[1], logits=record[2])

        stats = ctx.fit(role, step_fn=step, on_record=collect)
        uplink: dict[str, Payload] = {"class_knowledge": collector.result("class_knowledge")}
        if self.average_weights:
            uplink["weights"] = self.outgoing(role, ctx.weights(role))
        else:
            ctx.state["weights"] = ctx.weights(role)
        return ClientUpdate(task.client, ctx.num_examples(), uplink, {f"{role}/loss": stats["loss"]})

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        state = self.state
        if self.forget:
            for bank in (state.logit_bank, state.feature_bank):
                bank.sums *= 1 - self.forget
                bank.counts *= 1 - self.forget
        averages: dict[str, WeightedAverage] = {}
        for update in updates:
            knowledge = update.sent("class_knowledge", ClassStatistics)
            state.logit_bank.add_statistics(knowledge, "logits")
            state.feature_bank.add_statistics(knowledge, "features")
            self.receive_features(knowledge.vectors["features"], knowledge.present)
            if self.average_weights:
                role = update.client.roles[0]
                averages.setdefault(role, WeightedAverage()).add(
                    update.sent("weights", ModelWeights).state, update.num_samples
                )
        for role, average in averages.items():
            state.global_weights[role] = {**state.global_weights[role], **average.result()}
        return self.server_step(rnd)

    def receive_features(self, features: torch.Tensor, present: torch.Tensor) -> None:
        """Hook for Velo, which keeps every received class feature to train its CVAE."""

    def server_step(self, rnd: int) -> dict[str, float]:
        """Hook for Velo's CVAE training; Felo has nothing more to do."""
        return {}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        """Personal models as every personalized method; averaged ones per architecture, each client scored
        with its architecture's model (``personal/test_acc`` the mean over the clients)."""
        if not self.average_weights:
            return super().evaluate(evaluator)
        metrics = global_metrics(evaluator, self.state.global_weights)
        per_client = [metrics[f"{client.roles[0]}/test_acc"] for client in self.server.clients]
        metrics["personal/test_acc"] = float(sum(per_client) / len(per_client))
        metrics["personal/test_acc_std"] = float(torch.tensor(per_client).std(unbiased=False))
        return metrics


def received_targets(
    downlink: Mapping[str, Payload],
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(features [C, D], have_features [C]), (logits [C, C], have_logits [C])`` from a Felo / Velo downlink.

    Classes without a feature (none at all when the server sent no features) have ``have_features`` false.
    """
    knowledge = payload_of(downlink, "class_knowledge", ClassStatistics)
    logits, have_logits = knowledge.vectors["logits"], knowledge.present
    if "features" in knowledge.vectors:
        return (knowledge.vectors["features"], have_logits), (logits, have_logits)
    if "class_features" in downlink:
        features = payload_of(downlink, "class_features", ClassStatistics)
        return (features.vectors["features"], features.present), (logits, have_logits)
    return (logits.new_zeros(len(have_logits), 0), torch.zeros_like(have_logits)), (logits, have_logits)
