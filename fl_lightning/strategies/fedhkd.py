"""FedHKD: Chen and Vikalo, "The Best of Both Worlds: Accurate Global and Personalized Models through Federated
Learning with Data-Free Hyper-Knowledge Distillation", ICLR 2023 (Sec. 3)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.steps import vmappable
from ..federation.bounds import Fraction01, NonNegative, Positive
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    Payload,
    Role,
    StateDict,
    load_exchanged,
)
from ..knowledge import WeightedAverage
from ..knowledge.banks import ClassBank
from ..knowledge.class_stats import ClassStatistics
from ..knowledge.hyper_knowledge import (
    Distance,
    local_hyper_knowledge,
    privacy_noise,
    representation_loss,
    soft_prediction_loss,
    soft_predictions,
)
from .base import PersonalModels, SentWeights, ServerContext, Split, Strategy, global_metrics


@dataclass
class FedHKDState:
    """What FedHKD's server carries from round to round."""

    global_weights: dict[Role, StateDict]  # per role, the averaged model (empty without share_weights)
    representations: Tensor  # [C, D] H_j, the global mean representation of each class
    soft_predictions: Tensor  # [C, C] Q_j, the global mean soft prediction of each class
    available: Tensor  # [C] bool, classes some client has uploaded hyper-knowledge of


class FedHKD(PersonalModels, Strategy):
    """FedAvg with data-free hyper-knowledge distillation: class means of representations and soft predictions.

    Each round a client loads its role's global model, trains it on ``CE + lam * mean_j
    ||Q(G(H_j), T) - Q_j|| + gamma * mean_i ||R(x_i) - H_{y_i}||`` (the paper's local objective; cross-entropy
    alone until hyper-knowledge exists), keeps the trained model as its personalized one, and uploads the model and its
    hyper-knowledge: for each class j it holds, the mean representation ``h_j`` (plus Gaussian noise of scale
    ``sigma * 2 zeta_j / n_j``, the paper's privacy mechanism), the mean soft prediction ``q_j = mean
    softmax(G(R(x)) / T)`` (eval mode over its training data, after training) and its count ``n_j``:
    ``S x (D + C + 1)`` numbers with the labels. The server averages each role's models (FedAvg) and each class's
    hyper-knowledge weighted by the counts, keeps a class nobody uploaded this round at its last value,
    and sends the ``R`` known classes (``R x (D + C)`` numbers with the labels) and the role's model.

    Across architectures (one role per architecture, every representation the same size D) each role's model is
    averaged over its clients and the hyper-knowledge is shared by all: it is the only knowledge that crosses
    architectures. ``share_weights: false`` keeps every client's model its own (the hyper-knowledge alone
    travels). Paper, official code and FL-bench: ``docs/algorithms.md``, FedHKD.

    Args:
        lam: lambda, weight of the soft-prediction term (0.05 in the official code).
        gamma: gamma, weight of the representation term (0.05).
        temperature: T of the soft predictions (0.5).
        sigma: the privacy noise's multiplier of the sensitivity ``2 zeta_j / n_j`` (0: no noise).
        threshold: nu, a class is uploaded only if it holds at least this share of the client's examples (0:
            every class it holds, as the official code).
        distance: ``paper`` (the L2 norms of the paper's objective) or ``official`` (the code's KL divergence and MSE).
        share_weights: average each role's models (the paper); ``false``: personal models only.
        weighted: average models by training examples (FedAvg); ``false``: uniformly (the official code).
        split: where the personalized models are evaluated: ``test`` (each client's local test split, as the
            paper's personalized accuracy) or ``global``.
    """

    name = "FedHKD"
    needs_split = True  # reads the models' features and head apart

    state: FedHKDState

    def __init__(
        self,
        lam: NonNegative = 0.05,
        gamma: NonNegative = 0.05,
        temperature: Positive = 0.5,
        sigma: NonNegative = 0.0,
        threshold: Fraction01 = 0.0,
        distance: Distance = "paper",
        share_weights: bool = True,
        weighted: bool = True,
        split: Split = "test",
    ):
        self.lam, self.gamma, self.temperature, self.sigma = lam, gamma, temperature, sigma
        self.threshold, self.distance, self.share_weights = threshold, distance, share_weights
        self.weighted, self.split = weighted, split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        feature_dim = server.shared_feature_dim(
            "shares mean representations across models",
            "Give all builders the same representation size (e.g. hidden: 64).",
        )
        self.num_classes, self.feature_dim = server.data.num_classes, feature_dim
        device = server.data.x.device
        weights = {role: server.initial_weights(role) for role in server.roles} if self.share_weights else {}
        self.state = FedHKDState(
            weights,
            torch.zeros(self.num_classes, feature_dim, device=device),
            torch.zeros(self.num_classes, self.num_classes, device=device),
            torch.zeros(self.num_classes, dtype=torch.bool, device=device),
        )
        self.outgoing = SentWeights(server, server.roles)

    # ------------------------------------------------------------------ server -> client
    def global_hyper_knowledge(self) -> ClassStatistics:
        """The classes that have hyper-knowledge, compact: ``R x (D + C)`` numbers and R labels."""
        state = self.state
        vectors = {"representations": state.representations, "soft_predictions": state.soft_predictions}
        return ClassStatistics.padded("global_hyper_knowledge", vectors, state.available).compact()

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        knowledge: dict[str, Payload] = (
            {"hyper_knowledge": self.global_hyper_knowledge()} if self.state.available.any() else {}
        )
        tasks = []
        for client in clients:
            downlink: dict[str, Payload] = dict(knowledge)
            if self.share_weights:
                role = client.roles[0]
                downlink["weights"] = self.outgoing(role, self.state.global_weights[role])
            tasks.append(ClientTask(client, rnd, downlink))
        return tasks

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        if self.share_weights:
            module = ctx.load(role)
            load_exchanged(module.model, task.received("weights", ModelWeights).state)
        else:
            module = ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        step = None  # cross-entropy alone until hyper-knowledge exists (the official code's first round)
        if "hyper_knowledge" in task.downlink and (self.lam or self.gamma):
            received = task.received("hyper_knowledge", ClassStatistics)
            means, soft, available = self.dense(received, ctx.data_x.device)
            # at one address per name (CUDA graphs keep their key)
            means, soft = ctx.on_device("representations", means), ctx.on_device("soft_predictions", soft)
            available = ctx.on_device("has", available)
            step = distillation_step(self.lam, self.gamma, self.temperature, self.distance, means, soft, available)
        stats = ctx.fit(role, step_fn=step)
        ctx.state["weights"] = ctx.weights(role)  # the personalized model: the locally trained one
        uplink: dict[str, Payload] = {"hyper_knowledge": self.hyper_knowledge(module, ctx)}
        if self.share_weights:
            uplink["weights"] = self.outgoing(role, module.model.state_dict(), copy=True)
        return ClientUpdate(task.client, ctx.num_examples(), uplink, {f"{role}/loss": stats["loss"]})

    def hyper_knowledge(self, module, ctx: ClientContext) -> ClassStatistics:
        """The client's upload: per class it holds (at least ``threshold`` of its examples) the mean representation
        with its privacy noise, the mean soft prediction and the count (compact)."""
        module.eval()
        idx = ctx.indices.train
        local = local_hyper_knowledge(
            module, ctx.data_x, ctx.data_y, idx, ctx.eval_batch_size, self.num_classes, self.temperature
        )
        counts = local["counts"]
        present = (counts > 0) & (counts >= self.threshold * len(idx))
        representations = local["representations"]
        if self.sigma:
            noise = privacy_noise(representations, local["max_norms"], counts, self.sigma, ctx.generator)
            representations = representations + noise * present[:, None]
        vectors = {
            "representations": representations,
            "soft_predictions": local["soft_predictions"],
            "counts": counts[:, None].float(),
        }
        return ClassStatistics.padded("hyper_knowledge", vectors, present).compact()

    def dense(self, received: ClassStatistics, device) -> tuple[Tensor, Tensor, Tensor]:
        """``[C, D]`` representations, ``[C, C]`` soft predictions and ``[C]`` availability from a compact payload."""
        labels = received.labels.long().to(device)
        means = torch.zeros(self.num_classes, self.feature_dim, device=device)
        soft = torch.zeros(self.num_classes, self.num_classes, device=device)
        available = torch.zeros(self.num_classes, dtype=torch.bool, device=device)
        means[labels] = received.vectors["representations"].to(device)
        soft[labels] = received.vectors["soft_predictions"].to(device)
        available[labels] = True
        return means, soft, available

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        state, device = self.state, self.state.representations.device
        banks = {
            "representations": ClassBank(self.num_classes, self.feature_dim, device),
            "soft_predictions": ClassBank(self.num_classes, self.num_classes, device),
        }
        averages = {role: WeightedAverage() for role in state.global_weights}
        for update in updates:
            upload = update.sent("hyper_knowledge", ClassStatistics)
            labels = upload.labels.long().to(device)
            present = torch.zeros(self.num_classes, dtype=torch.bool, device=device)
            present[labels] = True
            counts = torch.zeros(self.num_classes, dtype=torch.float64, device=device)
            counts[labels] = upload.vectors["counts"][:, 0].to(device, torch.float64)
            for name, bank in banks.items():  # weighted by each client's count of the class (the paper)
                rows = upload.vectors[name].detach().to(device)
                vectors = torch.zeros(self.num_classes, rows.shape[1], dtype=rows.dtype, device=device)
                vectors[labels] = rows
                bank.add(vectors, present, counts)
            if self.share_weights:
                role = update.client.roles[0]
                averages[role].add(
                    update.sent("weights", ModelWeights).state, update.num_samples if self.weighted else 1
                )
        fresh = banks["representations"].available
        state.representations = torch.where(fresh[:, None], banks["representations"].mean(), state.representations)
        state.soft_predictions = torch.where(fresh[:, None], banks["soft_predictions"].mean(), state.soft_predictions)
        state.available = state.available | fresh
        for role, average in averages.items():
            if average.count:
                state.global_weights[role] = {**state.global_weights[role], **average.result()}
        return {"server/classes_with_knowledge": float(state.available.sum())}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        """The personalized models (``personal/...``) and, with ``share_weights``, each role's global model."""
        metrics = evaluator.personalized(self.personal_weights, split=self.split)
        return {**metrics, **global_metrics(evaluator, self.state.global_weights)}


def distillation_step(
    lam: float, gamma: float, temperature: float, distance: Distance, means: Tensor, soft: Tensor, available: Tensor
):
    """The client's step, the paper's objective: ``CE + lam * soft-prediction term + gamma * representation term``, pure
    (batched clients, CUDA graphs)."""

    @vmappable
    def step(module, batch, i):
        x, y = batch
        h = module.features(x)
        loss = F.cross_entropy(module.head(h), y)
        head_soft = soft_predictions(module.head(means), temperature)  # G applied to every global H_j
        loss = loss + lam * soft_prediction_loss(head_soft, soft, available, distance)
        return loss + gamma * representation_loss(h, y, means, available, distance)

    return step
