"""FedNH: Dai, Chen, Wei, Lin, Li, "Tackling Data Heterogeneity in Federated Learning with Class Prototypes",
AAAI 2023."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.joint import fit_jointly
from ..client.steps import vmappable
from ..federation.bounds import Fraction01, Positive
from ..federation.padding import real_labels
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    StateDict,
    TensorPayload,
    load_exchanged,
)
from ..knowledge import WeightedAverage
from ..knowledge.cosine_classifier import Scale, cosine_logits
from .base import ServerContext, global_metrics
from .fedavg import FedAvg, FedAvgState


@dataclass
class FedNHState(FedAvgState):
    """FedAvg's global weights (the feature extractor travels), the class prototypes and the global scale."""

    prototypes: Tensor  # [C, D] unit rows
    scale: Tensor  # [] s, the learnable scale of the cosine logits


def prototype_update(prototypes: Tensor, counts: Tensor, means: Tensor, smoothing: float) -> Tensor:
    """FedNH's server step on the prototypes ``[C, D]`` from K uploads: per class the count-weighted mean of the
    clients' unit class means (``counts`` ``[K, C]``, ``means`` ``[K, C, D]``), normalised, then
    ``normalize(rho P_c + (1 - rho) mean_c)``; a class nobody uploaded keeps its prototype."""
    total = counts.sum(0)  # [C]
    average = F.normalize(torch.einsum("kc,kcd->cd", counts, means) / total.clamp(min=1e-12)[:, None], dim=1)
    updated = F.normalize(smoothing * prototypes + (1 - smoothing) * average, dim=1)
    return torch.where((total > 0)[:, None], updated, prototypes)


class FedNH(FedAvg):
    """Class prototypes spread uniformly at the start and moved by the clients' class means: FedAvg of the
    feature extractor whose classifier is the prototypes.

    The logits are ``s * cos(h, P_c)``: the model's representation ``h`` (its ``features``) normalised against C
    unit prototypes ``P`` (rows of an orthogonal initialisation from the run's seed, as the official code's
    default), scaled by a learnable ``s`` (``scale_init``; ``learn_scale: false`` fixes it). Each sampled client
    trains the extractor and ``s`` on cross-entropy with ``P`` fixed, then uploads the extractor, ``s`` and, per
    class it holds, its example count and the normalised mean of its normalised representations (eval mode).
    The server averages the extractors and ``s`` (uniformly by default, as the official code's server step of
    rate 1) and moves each uploaded class's prototype: the count-weighted mean of the clients' class means,
    normalised, then ``P_c = normalize(smoothing P_c + (1 - smoothing) mean_c)``. The model's own ``head`` is
    not trained or sent; the global model is evaluated as the extractor with the prototypes as its head (the
    same argmax; the reported loss is without ``s``). The method is defined for one architecture (one role).
    Where it follows the paper and the official code: ``docs/algorithms.md``, FedNH.

    Args:
        smoothing: rho, the weight of the old prototype (0.9).
        scale_init: the initial scale s.
        learn_scale: train s with the extractor (the official default) or keep it at ``scale_init``.
        (roles: as FedAvg; weighted: average by examples instead of uniformly)
    """

    central_privacy = False  # the prototypes are smoothed towards count-weighted class means, not a noised sum

    state: FedNHState
    needs_split = True  # the representation is read apart from the head

    def __init__(
        self,
        smoothing: Fraction01 = 0.9,
        scale_init: Positive = 1.0,
        learn_scale: bool = True,
        roles: list[str] | None = None,
        weighted: bool = False,
    ):
        super().__init__(roles, weighted)
        self.smoothing, self.scale_init, self.learn_scale = smoothing, scale_init, learn_scale

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_architecture()
        self.num_classes = server.data.num_classes
        generator = torch.Generator().manual_seed(server.seed)
        prototypes = torch.empty(self.num_classes, server.feature_dim(self.roles[0]))
        torch.nn.init.orthogonal_(prototypes, generator=generator)  # unit rows, orthogonal when C <= D
        self.state = FedNHState(
            self.state.global_weights, F.normalize(prototypes, dim=1), torch.tensor(self.scale_init)
        )

    def extractor(self, weights: StateDict) -> StateDict:
        """The part of the model that travels: the exchanged weights without the unused head."""
        return {k: v for k, v in weights.items() if not k.startswith("head.")}

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        role = self.roles[0]
        sent = self.outgoing(role, self.state.global_weights[role])
        extractor = ModelWeights(role, self.extractor(sent.state))
        knowledge = TensorPayload("prototypes", {"prototypes": self.state.prototypes, "scale": self.state.scale})
        return [ClientTask(c, rnd, {role: extractor, "prototypes": knowledge}) for c in clients if role in c.roles]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role)
        load_exchanged(module.model, task.received(role, ModelWeights).state)
        received = task.received("prototypes", TensorPayload).tensors
        prototypes = ctx.on_device("prototypes", received["prototypes"])
        scale = cast(Scale, ctx.helper("fednh_scale", Scale(), {"scale": received["scale"]}))
        scale.scale.requires_grad_(self.learn_scale)

        @vmappable  # pure (CUDA graphs replay it); s trains beside the model, so clients train one at a time
        def step(modules, batch, i):
            x, y = batch
            logits = cosine_logits(modules[role].model.features(x), prototypes, scale.scale)
            return {role: F.cross_entropy(logits, real_labels(y))}

        loss = fit_jointly(ctx, (role,), step, helpers=[scale])[role]
        model = module.model
        model.eval()
        idx = ctx.indices.train
        num_classes = self.num_classes
        with torch.no_grad():
            embedded = torch.cat(
                [
                    F.normalize(model.features(ctx.data_x[idx[s : s + ctx.eval_batch_size]]), dim=1)
                    for s in range(0, len(idx), ctx.eval_batch_size)
                ]
            )
            labels = ctx.data_y[idx]
            counts = torch.bincount(labels, minlength=num_classes)
            sums = torch.zeros(num_classes, embedded.shape[1], device=embedded.device).index_add_(0, labels, embedded)
        held = torch.nonzero(counts).flatten()
        uplink = {
            role: ModelWeights(role, self.extractor(self.outgoing(role, model.state_dict(), copy=True).state)),
            "scale": TensorPayload("scale", {"scale": scale.scale.detach().clone()}),
            "class_means": TensorPayload(
                "class_means",
                {"labels": held, "counts": counts[held].float(), "means": F.normalize(sums[held], dim=1)},
            ),
        }
        return ClientUpdate(task.client, ctx.num_examples("train"), uplink, {f"{role}/loss": loss})

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        role = self.roles[0]
        num_classes, dim = self.state.prototypes.shape
        weights, scale = WeightedAverage(), WeightedAverage()
        counts, means = [], []
        for update in updates:
            weight = update.num_samples if self.weighted else 1.0
            weights.add(update.sent(role, ModelWeights).state, weight)
            scale.add(update.sent("scale", TensorPayload).tensors, weight)
            sent = update.sent("class_means", TensorPayload).tensors
            labels = sent["labels"].cpu()
            count, mean = torch.zeros(num_classes), torch.zeros(num_classes, dim)
            count[labels], mean[labels] = sent["counts"].cpu(), sent["means"].cpu()
            counts.append(count)
            means.append(mean)
        if not counts:
            return {}
        self.state.global_weights[role] = {**self.state.global_weights[role], **weights.result()}
        self.state.scale = scale.result()["scale"].cpu()
        self.state.prototypes = prototype_update(
            self.state.prototypes, torch.stack(counts), torch.stack(means), self.smoothing
        )
        return {"prototypes/scale": float(self.state.scale)}

    def folded(self, weights: StateDict) -> StateDict:
        """The model with the prototypes (times the sign of s) as its head: its argmax is FedNH's."""
        head = self.state.prototypes.to(weights["head.weight"].device) * self.state.scale.sign()
        return {**weights, "head.weight": head, "head.bias": torch.zeros_like(weights["head.bias"])}

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        return global_metrics(evaluator, {r: self.folded(w) for r, w in self.state.global_weights.items()})
