"""FML: Shen et al., "Federated Mutual Learning", arXiv 2006.16765, 2020 (Sec. 3; a baseline of paper 004)."""

from __future__ import annotations

from collections.abc import Iterator

import torch.nn.functional as F

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.joint import fit_jointly
from ..client.steps import vmappable
from ..federation.errors import ConfigError
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    StateDict,
    exchanged_keys,
    load_exchanged,
)
from ..knowledge import WeightedAverage
from ..knowledge.mutual import KL_REDUCTIONS, mutual_kl
from .base import ServerContext, Strategy, require_private_and_shared_role


class FML(Strategy):
    """Federated mutual learning: a private model and a shared meme model per client, trained together.

    Every client trains two models on each of its batches by deep mutual learning (Sec. 3):

    - private: ``alpha * CE(z_p, y) + (1 - alpha) * KL(p_meme || p_private)``
    - meme: ``beta * CE(z_m, y) + (1 - beta) * KL(p_private || p_meme)``

    The private model (any architecture, kept by the client) never leaves it; the meme model (one
    architecture for everyone) is sent down and up and averaged by FedAvg, weighted by labeled examples
    (``weighted: false`` for the plain mean). Each round: ``|meme|`` numbers each way per sampled client.

    Options where the sources differ (BASELINES.md, Sec. 11): the paper uses ``alpha = beta = 0.5``
    (default; HtFLlib's main.py defaults of 1.0 switch distillation off); the KL is the per-example KL
    (``kl_reduction: batchmean``) or HtFLlib's ``nn.KLDivLoss()`` default that divides by ``B x C``
    (``mean``). Deep mutual learning updates each model from its own loss with the other's output as a
    constant (``detach_partner: true``, default); HtFLlib backpropagates both losses through both models
    (``false``). HtFLlib also clips each model's gradient at norm 10: ``training.grad_clip_norm``.

    A tier lists the private model's role and the meme role, e.g. ``roles: [cnn_large, meme]`` (paper
    004 gives every client its CNN-1..5 as the private model and CNN-5, the smallest, as the meme).
    Personal (private) models are evaluated on each client's local test split (``split: test``, paper
    004) or the global test set; the meme model on the global test set (``<meme_role>/test_acc``).

    Args:
        meme_role: the role of the shared meme model.
        alpha: weight of the private model's cross-entropy (0.5 in the paper).
        beta: weight of the meme model's cross-entropy (0.5 in the paper).
        kl_reduction: ``batchmean`` or ``mean`` (see above).
        detach_partner: each model learns only from its own loss (deep mutual learning).
        weighted: weight the meme average by labeled examples.
        split: where the private models are evaluated: ``test`` or ``global``.
    """

    state_attributes = ("meme_weights",)

    def __init__(
        self,
        meme_role: str = "meme",
        alpha: float = 0.5,
        beta: float = 0.5,
        kl_reduction: str = "batchmean",
        detach_partner: bool = True,
        weighted: bool = True,
        split: str = "test",
    ):
        if not (0.0 <= alpha <= 1.0 and 0.0 <= beta <= 1.0):
            raise ConfigError(f"FML alpha and beta must lie in [0, 1], got alpha={alpha}, beta={beta}.")
        if kl_reduction not in KL_REDUCTIONS:
            raise ConfigError(f"FML kl_reduction must be one of {KL_REDUCTIONS}, got {kl_reduction!r}.")
        self.meme_role, self.alpha, self.beta = meme_role, alpha, beta
        self.kl_reduction, self.detach_partner, self.weighted, self.split = (
            kl_reduction,
            detach_partner,
            weighted,
            split,
        )

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        require_private_and_shared_role(server, self.meme_role, "FML", "meme")
        self.meme_weights = server.initial_weights(self.meme_role)
        self.sent_keys = exchanged_keys(server.model(self.meme_role))  # a frozen part of the meme stays home

    def private_role(self, client: ClientSpec) -> str:
        return next(r for r in client.roles if r != self.meme_role)

    def private_weights(self, client: ClientSpec, state: dict) -> StateDict:
        stored = state.get("weights")
        return stored if stored is not None else self.server.initial_weights(self.private_role(client), client.id)

    def configure_round(self, rnd: int, clients: list[ClientSpec], phase: str = "train") -> list[ClientTask]:
        meme = ModelWeights.part(self.meme_role, self.meme_weights, self.sent_keys)
        return [ClientTask(c, rnd, {self.meme_role: meme}) for c in clients]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        private, meme = self.private_role(task.client), self.meme_role
        ctx.load(private, self.private_weights(task.client, ctx.state))
        load_exchanged(ctx.load(meme).model, task.downlink[meme].state)
        alpha, beta, reduction, detach = self.alpha, self.beta, self.kl_reduction, self.detach_partner

        @vmappable  # pure: replayed from CUDA graphs (runtime.cuda_graphs)
        def step(modules, batch, i):
            x, y = batch
            z_private, z_meme = modules[private](x), modules[meme](x)
            private_loss = alpha * F.cross_entropy(z_private, y)
            meme_loss = beta * F.cross_entropy(z_meme, y)
            if alpha < 1.0:
                private_loss = private_loss + (1 - alpha) * mutual_kl(z_private, z_meme, reduction, detach)
            if beta < 1.0:
                meme_loss = meme_loss + (1 - beta) * mutual_kl(z_meme, z_private, reduction, detach)
            return {private: private_loss, meme: meme_loss}

        losses = fit_jointly(ctx, (private, meme), step)
        ctx.state["weights"] = ctx.weights(private)
        uplink = {meme: ModelWeights.part(meme, ctx.weights(meme), self.sent_keys)}
        metrics = {f"{role}/loss": loss for role, loss in losses.items()}
        return ClientUpdate(task.client, ctx.num_examples(), uplink, metrics)

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "train") -> dict[str, float]:
        average = WeightedAverage()
        for update in updates:
            average.add(update.uplink[self.meme_role].state, update.num_samples if self.weighted else 1.0)
        if average.count:
            self.meme_weights = {**self.meme_weights, **average.result()}
        return {}

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        metrics = evaluator.personalized(self.personal_weights, split=self.split)
        for name, value in evaluator.global_model(self.meme_role, self.meme_weights).items():
            metrics[f"{self.meme_role}/test_{name}"] = value
        return metrics

    def personal_weights(self, client, state) -> tuple[str, StateDict]:
        return self.private_role(client), self.private_weights(client, state)

    @property
    def monitor(self) -> str:
        return "personal/test_acc"
