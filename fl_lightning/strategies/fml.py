"""FML: Shen et al., "Federated Mutual Learning", arXiv 2006.16765, 2020 (Sec. 3; a baseline of paper 004)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch.nn.functional as F

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.joint import fit_jointly
from ..client.steps import vmappable
from ..federation.bounds import Fraction01
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, StateDict, load_exchanged
from ..knowledge import WeightedAverage
from ..knowledge.mutual import KLReduction, mutual_kl
from .base import PersonalModels, SentWeights, ServerContext, Split, Strategy, global_metrics


@dataclass
class FMLState:
    """What FML's server carries from round to round."""

    meme_weights: StateDict  # the global meme model


class FML(PersonalModels, Strategy):
    """Federated mutual learning: a private model and a shared meme model per client, trained together.

    Every client trains two models on each of its batches by deep mutual learning (Sec. 3):

    - private: ``alpha * CE(z_p, y) + (1 - alpha) * KL(p_meme || p_private)``
    - meme: ``beta * CE(z_m, y) + (1 - beta) * KL(p_private || p_meme)``

    The private model (any architecture) never leaves the client; the meme model (one architecture for
    everyone) is sent down and up and averaged by FedAvg: ``|meme|`` numbers each way per sampled client.
    A tier lists the private model's role and the meme role, e.g. ``roles: [cnn_large, meme]``. Private
    models are evaluated as ``personal/``, the meme model on the global test set (``<meme_role>/test_acc``).
    Where the options follow the paper or HtFLlib: ``docs/algorithms.md``, FML.

    Args:
        meme_role: the role of the shared meme model.
        alpha: weight of the private model's cross-entropy (0.5 in the paper).
        beta: weight of the meme model's cross-entropy (0.5 in the paper).
        kl_reduction: the KL per example (``batchmean``) or divided by ``B x C`` (``mean``, HtFLlib).
        detach_partner: each model learns only from its own loss (deep mutual learning); ``false``
            backpropagates both losses through both models (HtFLlib).
        weighted: weight the meme average by labeled examples.
        split: where the private models are evaluated: ``test`` or ``global``.
    """

    state: FMLState

    def __init__(
        self,
        meme_role: str = "meme",
        alpha: Fraction01 = 0.5,
        beta: Fraction01 = 0.5,
        kl_reduction: KLReduction = "batchmean",
        detach_partner: bool = True,
        weighted: bool = True,
        split: Split = "test",
    ):
        self.meme_role, self.alpha, self.beta = meme_role, alpha, beta
        self.kl_reduction, self.detach_partner, self.weighted, self.split = (
            kl_reduction,
            detach_partner,
            weighted,
            split,
        )

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_private_and_shared_role(self.meme_role, "meme")
        self.state = FMLState(server.initial_weights(self.meme_role))
        self.outgoing = SentWeights(server, [self.meme_role])  # a frozen part of the meme stays home

    def personal_role(self, client: ClientSpec) -> str:
        """The client's private model: its role other than the meme."""
        return next(r for r in client.roles if r != self.meme_role)

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        meme = self.outgoing(self.meme_role, self.state.meme_weights)
        return [ClientTask(c, rnd, {self.meme_role: meme}) for c in clients]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        private, weights = self.personal_weights(task.client, ctx.state)
        meme = self.meme_role
        ctx.load(private, weights)
        load_exchanged(ctx.load(meme).model, task.received(meme, ModelWeights).state)
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
        uplink = {meme: self.outgoing(meme, ctx.weights(meme))}
        metrics = {f"{role}/loss": loss for role, loss in losses.items()}
        return ClientUpdate(task.client, ctx.num_examples(), uplink, metrics)

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        average = WeightedAverage()
        for update in updates:
            average.add(update.sent(self.meme_role, ModelWeights).state, update.num_samples if self.weighted else 1.0)
        if average.count:
            self.state.meme_weights = {**self.state.meme_weights, **average.result()}
        return {}

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        """The private models (``personal/``) and the meme model on the global test set."""
        return {**super().evaluate(evaluator), **global_metrics(evaluator, {self.meme_role: self.state.meme_weights})}
