"""FedPAC: Xu, Tong and Huang, "Personalized Federated Learning with Feature Alignment and Classifier Collaboration",
ICLR 2023 (the official code JianXu95/FedPAC)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..federation.bounds import NonNegative, NonNegativeInt
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    Payload,
    Role,
    StateDict,
    TensorPayload,
)
from ..knowledge import WeightedAverage
from ..knowledge.banks import ClassBank
from ..knowledge.class_stats import ClassStatistics, class_means
from ..knowledge.classifier_collaboration import (
    FeatureStatistics,
    collaboration_matrix,
    head_weights,
    simplex_quadratic,
)
from .base import PersonalModels, SentWeights, ServerContext, Split, Strategy
from .fedproto import dense_prototypes, prototype_loss

HEAD = "head."  # the classifier's keys in a model's state dict


@dataclass
class FedPACState:
    """What FedPAC's server carries from round to round."""

    bodies: dict[Role, StateDict]  # per role, the averaged feature extractor (every key but the head's)
    prototypes: Tensor  # [C, D] the last round's global prototypes
    available: Tensor  # [C] bool, classes that have one
    heads: dict[int, StateDict]  # per client, the combined head it receives next time it is sampled


class FedPAC(PersonalModels, Strategy):
    """Shared feature extractors aligned to global prototypes, personal heads combined across clients.

    Each round a client loads the global feature extractor of its role and its own head (the
    combination the server made for it last time, or its own), computes its feature statistics ``V`` and ``h``
    (``knowledge/classifier_collaboration.py``) and, before training, its class prototypes; then trains in two
    stages: the head alone for ``head_epochs`` epochs (the features detached), then the extractor alone (the
    head frozen) on ``CE + lam * MSE(f(x), c_y)``, ``c_y`` the global prototype of y (its own pre-training one
    where no global one exists; cross-entropy alone in round 1). It keeps the trained model (its personalized
    one) and uploads the model, its class prototypes (eval mode, after training) with their counts, ``V`` and
    ``h``. The server averages each role's extractors by training examples, each class's prototypes by class
    counts, and for each uploader i solves ``min alpha^T (diag(V) + D_i) alpha`` over the simplex and combines the
    uploaded heads with those weights (``collaborate: false`` keeps every head its own).

    Across architectures (one role per architecture, every representation the same size D and every head one
    ``nn.Linear`` D -> C) the extractors are averaged per role, and the prototypes and the heads are shared by
    all: they are what crosses architectures. Paper, official code and PFLlib: ``docs/algorithms.md``, FedPAC.

    Args:
        lam: lambda, weight of the feature alignment (1 in the official code).
        head_epochs: epochs of the head-only stage (1 in the official code).
        collaborate: combine the heads (the official ``agg_g``); ``false``: every client keeps its own head.
        min_weight: combination weights at or below it are dropped and the rest renormalised (1e-3).
        split: where personal models are evaluated: ``test`` (each client's local test split) or ``global``.
    """

    name = "FedPAC"
    needs_split = True  # reads the models' features and head apart

    state: FedPACState

    def __init__(
        self,
        lam: NonNegative = 1.0,
        head_epochs: NonNegativeInt = 1,
        collaborate: bool = True,
        min_weight: NonNegative = 1e-3,
        split: Split = "test",
    ):
        self.lam, self.head_epochs, self.collaborate = lam, head_epochs, collaborate
        self.min_weight, self.split = min_weight, split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        feature_dim = server.shared_feature_dim(
            "aligns every model's representations to shared prototypes and combines their heads",
            "Give all builders the same representation size (e.g. hidden: 64).",
        )
        server.require_linear_heads(
            "trains the extractor with the head frozen and combines the heads of all clients",
            "Use builders whose head is one linear layer.",
        )
        self.num_classes, self.feature_dim = server.data.num_classes, feature_dim
        device = server.data.x.device
        initial = {role: server.initial_weights(role) for role in server.roles}  # the seeded models, at setup
        bodies = {role: _body(weights) for role, weights in initial.items()}
        # every client's first head: its role's initial one (the official code starts every client from one model);
        # kept here because the role's instance holds whatever the last client loaded once training starts
        self.initial_heads = {
            role: {k: v for k, v in weights.items() if k.startswith(HEAD)} for role, weights in initial.items()
        }
        self.outgoing = SentWeights(server, server.roles)
        self.state = FedPACState(
            bodies,
            torch.zeros(self.num_classes, feature_dim, device=device),
            torch.zeros(self.num_classes, dtype=torch.bool, device=device),
            {},
        )

    def load_state_dict(self, saved: dict) -> None:
        """The saved state; the clients' heads, which setup cannot build (it knows no client's head yet), are moved
        to the run's device as the rest (checkpoints load on the CPU)."""
        super().load_state_dict(saved)
        device = self.state.prototypes.device
        self.state.heads = {c: {k: v.to(device) for k, v in head.items()} for c, head in self.state.heads.items()}

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        state = self.state
        shared: dict[str, Payload] = {}
        if state.available.any():
            padded = ClassStatistics.padded("global_prototypes", {"prototypes": state.prototypes}, state.available)
            shared["global_prototypes"] = padded.compact()
        tasks = []
        for client in clients:
            downlink = {**shared, "body": ModelWeights("body", state.bodies[client.roles[0]])}
            if client.id in state.heads:
                downlink["head"] = ModelWeights("head", state.heads[client.id])
            tasks.append(ClientTask(client, rnd, downlink))
        return tasks

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        own = ctx.state.get("weights") or self.initial_heads[role]  # its trained model, or the initial head
        weights = {**own, **task.received("body", ModelWeights).state}
        if "head" in task.downlink:
            weights.update({HEAD + k: v for k, v in task.received("head", ModelWeights).state.items()})
        module = ctx.load(role, weights)
        device = ctx.data_x.device
        variance, h = self.feature_statistics(module, ctx)
        before = self.prototypes(module, ctx)  # the targets of classes without a global prototype
        stats = {"loss": 0.0}
        if self.head_epochs:
            steps = self.head_epochs * ctx.epoch_steps(len(ctx.indices.train))
            stats = ctx.fit(role, step_fn=head_step, steps=steps)
        step = None
        if "global_prototypes" in task.downlink and self.lam:
            received = task.received("global_prototypes", ClassStatistics)
            targets, available = dense_prototypes(received, self.num_classes, device)
            own_targets, own_available = dense_prototypes(before, self.num_classes, device)
            targets = torch.where(available[:, None], targets, own_targets)
            step = aligned_step(self.lam, targets, available | own_available)
        stats = ctx.fit(role, step_fn=step or aligned_step(0.0, None, None))
        ctx.state["weights"] = ctx.weights(role)
        after = self.prototypes(module, ctx)
        counts = torch.bincount(ctx.data_y[ctx.indices.train], minlength=self.num_classes)
        after.vectors["counts"] = counts[after.labels.long()].float()[:, None]
        uplink: dict[str, Payload] = {
            "model": self.outgoing(role, module.model.state_dict(), copy=True),
            "local_prototypes": after,
            "statistics": TensorPayload("feature_statistics", {"v": torch.tensor([variance], device=device), "h": h}),
        }
        return ClientUpdate(task.client, ctx.num_examples(), uplink, {f"{role}/loss": stats["loss"]})

    def feature_statistics(self, module, ctx: ClientContext) -> tuple[float, Tensor]:
        """``V`` and ``h`` of the model as loaded (eval mode, over the training data)."""
        module.eval()
        collector = FeatureStatistics(self.num_classes, self.feature_dim, ctx.data_x.device)
        idx = ctx.indices.train
        with torch.no_grad():
            for start in range(0, len(idx), ctx.eval_batch_size):
                chosen = idx[start : start + ctx.eval_batch_size]
                collector.add(module.features(ctx.data_x[chosen]), ctx.data_y[chosen])
        return collector.result()

    def prototypes(self, module, ctx: ClientContext) -> ClassStatistics:
        """The client's class prototypes (compact), eval mode over its training data."""
        module.eval()
        dims = ("prototypes", self.feature_dim)
        idx = ctx.indices.train
        return class_means(
            module.features, ctx.data_x, ctx.data_y, idx, ctx.eval_batch_size, dims, self.num_classes, "prototypes"
        )

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        state, device = self.state, self.state.prototypes.device
        bank = ClassBank(self.num_classes, self.feature_dim, device)
        bodies = {role: WeightedAverage() for role in state.bodies}
        clients, heads, variances, hs = [], [], [], []
        for update in updates:
            role = update.client.roles[0]
            model = update.sent("model", ModelWeights).state
            bodies[role].add(_body(model), update.num_samples)
            upload = update.sent("local_prototypes", ClassStatistics)
            labels = upload.labels.long().to(device)
            vectors = torch.zeros(self.num_classes, self.feature_dim, device=device)
            vectors[labels] = upload.vectors["prototypes"].detach().to(device)
            present = torch.zeros(self.num_classes, dtype=torch.bool, device=device)
            present[labels] = True
            counts = torch.zeros(self.num_classes, dtype=torch.float64, device=device)
            counts[labels] = upload.vectors["counts"][:, 0].to(device, torch.float64)
            bank.add(vectors, present, counts)  # weighted by the class counts (the official code)
            statistics = update.sent("statistics", TensorPayload).tensors
            clients.append(update.client.id)
            heads.append({k[len(HEAD) :]: v.detach() for k, v in model.items() if k.startswith(HEAD)})
            variances.append(statistics["v"].reshape(()).double().cpu())
            hs.append(statistics["h"].detach().double().cpu())
        if not clients:
            return {}
        for role, average in bodies.items():
            if average.count:
                state.bodies[role] = average.result()
        state.prototypes, state.available = bank.mean(), bank.available  # this round's uploads only
        if not self.collaborate:
            return {}
        v, h = torch.stack(variances), torch.stack(hs)
        own = []
        for i, client in enumerate(clients):
            alpha = head_weights(simplex_quadratic(collaboration_matrix(i, v, h)), self.min_weight)
            state.heads[client] = {k: combine([head[k] for head in heads], alpha) for k in heads[i]}
            own.append(float(alpha[i]))
        return {"server/own_head_weight": sum(own) / len(own)}


def combine(tensors: list[Tensor], alpha: Tensor) -> Tensor:
    """``sum_j alpha_j tensors_j`` in float64, in the tensors' dtype."""
    total = torch.zeros_like(tensors[0], dtype=torch.float64)
    for weight, tensor in zip(alpha.tolist(), tensors):
        total += weight * tensor.double()
    return total.to(tensors[0].dtype)


def _body(weights: StateDict) -> StateDict:
    """A model's weights without its head: the feature extractor that is averaged."""
    return {k: v for k, v in weights.items() if not k.startswith(HEAD)}


def head_step(module, batch, i):
    """The first stage: the head alone (the features detached, so the extractor gets no gradient and its
    optimizer skips it). Not marked pure: vmapped or replayed, the extractor would get zero gradients instead,
    which weight decay and momentum would still move."""
    x, y = batch
    return F.cross_entropy(module.head(module.features(x).detach()), y)


def aligned_step(lam: float, targets: Tensor | None, available: Tensor | None):
    """The second stage: the extractor alone (the head's weights detached) on ``CE + lam * MSE(f(x), c_y)``,
    the official ``MSELoss`` against the class's target (rows without one count 0). Not marked pure (see
    :func:`head_step`)."""

    def step(module, batch, i):
        x, y = batch
        h = module.features(x)
        head = module.model.head
        loss = F.cross_entropy(F.linear(h, head.weight.detach(), head.bias.detach()), y)
        if lam and targets is not None and available is not None:
            loss = loss + lam * prototype_loss(h, y, targets, available)
        return loss

    return step
