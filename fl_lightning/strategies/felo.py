"""Felo: Chan & Ngai, heterogeneous federated learning with mid-level features and logits (paper 003)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.steps import vmappable
from ..federation.errors import ConfigError
from ..federation.padding import class_index
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, exchanged_keys, load_exchanged
from ..knowledge import WeightedAverage
from ..knowledge.banks import ClassBank
from ..knowledge.class_stats import ClassStatistics, ClassStatsCollector
from ..knowledge.distillation import logit_distance_rows, masked_row_mean
from .base import ServerContext, Strategy


class Felo(Strategy):
    """Heterogeneous clients exchange per-class mean features and logits; same architectures average weights.

    Client: trains on ``CE + alpha * (MSE(f, f_s[y]) + D(z, z_s[y]))`` (eq. 1), where ``f`` is the
    mid-level feature (the model's ``features`` output), ``z`` the logits and ``f_s``, ``z_s`` the
    server's class vectors; D is the KL divergence (paper) or the MSE on logits (official code's
    default). While training it sums features and logits per class (training-mode forward, before each
    step) and uploads their class means with the labels. Server: averages the class vectors it
    received (``ClassBank``) and, as Sec. 3.1.2 describes, averages weights only among clients of the
    same architecture (one role per architecture); ``average_weights: false`` keeps personal models
    as the official code does. Averaged weights travel as their trainable part only
    (:func:`~fl_lightning.federation.types.exchanged_keys`): a frozen backbone is neither sent nor counted.

    Every role must have the same feature dimension, since features of different architectures are
    compared directly.

    Downlink: one ``class_knowledge`` payload, per class the logits and (when the server has class
    features) the features, with labels marking the classes it has them for. Velo's server may have
    logits of classes it has no feature for (before its CVAE is trained, or when a class has left its
    feature store); then the features travel in a second ``class_features`` payload with their own
    labels, and before any feature exists none are sent.

    Args:
        alpha: weight of the feature + logit terms (0.5 in the code).
        logit_loss: ``kl`` (paper) or ``mse`` (code default).
        average_weights: FedAvg per architecture (paper) or personal models (code).
        warmup_rounds: cross-entropy only for these rounds (the code starts at 5% of the run).
        forget: each round, old class vectors are down-weighted by ``1 - forget`` (0 keeps the
            all-time average; the code keeps a FIFO of recent uploads).
        loss_average: ``batch`` averages the feature and logit terms over the whole batch, as eq. 1's
            ``1/|D~_k|`` sum (a sample of a class the server has no vector for adds nothing to a term but
            counts in its average); ``available`` over the samples that have the server vector only
            (this code before: a larger weight while the server knows few classes).
    """

    needs_split = True  # reads the models' features and head apart

    state_attributes = ("global_weights", "logit_bank", "feature_bank")

    def __init__(
        self,
        alpha: float = 0.5,
        logit_loss: str = "kl",
        average_weights: bool = True,
        warmup_rounds: int = 0,
        forget: float = 0.0,
        loss_average: str = "batch",
    ):
        if logit_loss not in ("kl", "mse"):
            raise ConfigError(f"{type(self).__name__} logit_loss must be kl or mse, got {logit_loss!r}.")
        if loss_average not in ("batch", "available"):
            raise ConfigError(f"{type(self).__name__} loss_average must be batch or available, got {loss_average!r}.")
        if not (alpha >= 0 and warmup_rounds >= 0 and 0 <= forget <= 1):
            raise ConfigError(
                f"{type(self).__name__} needs alpha >= 0, warmup_rounds >= 0 and 0 <= forget <= 1; got alpha={alpha}, "
                f"warmup_rounds={warmup_rounds}, forget={forget}."
            )
        self.alpha, self.logit_loss, self.average_weights = alpha, logit_loss, average_weights
        self.warmup_rounds, self.forget, self.loss_average = warmup_rounds, forget, loss_average

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client(type(self).__name__)
        dims = {r: server.feature_dim(r) for r in server.roles}
        if len(set(dims.values())) != 1:
            raise ConfigError(
                f"{type(self).__name__} compares features across architectures, so every role needs the "
                f"same feature dimension; got {dims}. Set the builders' feature sizes equal."
            )
        self.feature_dim = next(iter(dims.values()))
        self.num_classes = server.data.num_classes
        self.logit_bank = ClassBank(self.num_classes, self.num_classes)
        self.feature_bank = ClassBank(self.num_classes, self.feature_dim)
        self.global_weights = {r: server.initial_weights(r) for r in server.roles} if self.average_weights else {}
        self.sent_keys = {r: exchanged_keys(server.model(r)) for r in server.roles}  # a frozen part stays home

    # ------------------------------------------------------------------ server -> client
    def server_features(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Class features sent to clients and which classes have one; ``None``: no feature source yet (Velo)."""
        return self.feature_bank.mean(), self.feature_bank.available

    def knowledge_downlink(self) -> dict[str, ClassStatistics]:
        """The class logits and features, each with the classes the server has it for (see the class doc)."""
        logits, have_logits = self.logit_bank.mean(), self.logit_bank.available
        features = self.server_features()
        if features is None:
            return {"class_knowledge": ClassStatistics.padded("class_knowledge", {"logits": logits}, have_logits)}
        features, have_features = features
        if torch.equal(have_features, have_logits):
            vectors = {"features": features, "logits": logits}
            return {"class_knowledge": ClassStatistics.padded("class_knowledge", vectors, have_logits)}
        return {
            "class_knowledge": ClassStatistics.padded("class_knowledge", {"logits": logits}, have_logits),
            "class_features": ClassStatistics.padded("class_features", {"features": features}, have_features),
        }

    def configure_round(self, rnd: int, clients: list[ClientSpec], phase: str = "train") -> list[ClientTask]:
        knowledge = self.knowledge_downlink()
        tasks = []
        for c in clients:
            downlink = dict(knowledge)
            if self.average_weights:
                role = c.roles[0]
                downlink["weights"] = ModelWeights.part(role, self.global_weights[role], self.sent_keys[role])
            tasks.append(ClientTask(c, rnd, downlink))
        return tasks

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        if self.average_weights:
            load_exchanged(ctx.load(role).model, task.downlink["weights"].state)
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
        uplink = {"class_knowledge": collector.result("class_knowledge")}
        if self.average_weights:
            uplink["weights"] = ModelWeights.part(role, ctx.weights(role), self.sent_keys[role])
        else:
            ctx.state["weights"] = ctx.weights(role)
        return ClientUpdate(task.client, ctx.num_examples(), uplink, {f"{role}/loss": stats["loss"]})

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "train") -> dict[str, float]:
        if self.forget:
            for bank in (self.logit_bank, self.feature_bank):
                bank.sums *= 1 - self.forget
                bank.counts *= 1 - self.forget
        averages: dict[str, WeightedAverage] = {}
        for update in updates:
            knowledge = update.uplink["class_knowledge"]
            self.logit_bank.add_statistics(knowledge, "logits")
            self.feature_bank.add_statistics(knowledge, "features")
            self.receive_features(knowledge.vectors["features"], knowledge.present)
            if self.average_weights:
                role = update.client.roles[0]
                averages.setdefault(role, WeightedAverage()).add(update.uplink["weights"].state, update.num_samples)
        for role, average in averages.items():
            self.global_weights[role] = {**self.global_weights[role], **average.result()}
        return self.server_step(rnd)

    def receive_features(self, features: torch.Tensor, present: torch.Tensor) -> None:
        """Hook for Velo, which keeps every received class feature to train its CVAE."""

    def server_step(self, rnd: int) -> dict[str, float]:
        """Hook for Velo's CVAE training; Felo has nothing more to do."""
        return {}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        if not self.average_weights:
            return evaluator.personalized(self.personal_weights, split="global")
        metrics, per_client = {}, []
        by_role = {r: evaluator.global_model(r, w) for r, w in self.global_weights.items()}
        for role, result in by_role.items():
            metrics.update({f"{role}/test_{k}": v for k, v in result.items()})
        for client in self.server.clients:
            per_client.append(by_role[client.roles[0]]["acc"])
        metrics["personal/test_acc"] = float(sum(per_client) / len(per_client))
        metrics["personal/test_acc_std"] = float(torch.tensor(per_client).std(unbiased=False))
        return metrics

    def personal_weights(self, client, state):
        return client.roles[0], self.server.own_weights(client, state.get("weights"))

    @property
    def monitor(self) -> str:
        return "personal/test_acc"


def received_targets(downlink: dict) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
    """``(features [C, D], have_features [C]), (logits [C, C], have_logits [C])`` from a Felo / Velo downlink.

    Classes without a feature (none at all when the server sent no features) have ``have_features`` false.
    """
    knowledge = downlink["class_knowledge"]
    logits, have_logits = knowledge.vectors["logits"], knowledge.present
    if "features" in knowledge.vectors:
        return (knowledge.vectors["features"], have_logits), (logits, have_logits)
    if "class_features" in downlink:
        features = downlink["class_features"]
        return (features.vectors["features"], features.present), (logits, have_logits)
    return (logits.new_zeros(len(have_logits), 0), torch.zeros_like(have_logits)), (logits, have_logits)
