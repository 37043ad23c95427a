"""FedL2G: Zhang et al., "FedL2G: Learning to Guide Local Training in Heterogeneous Federated Learning", arXiv
2410.06490."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import NonNegative, NonNegativeInt, Positive, PositiveInt
from ..federation.errors import ConfigError
from ..federation.seeding import Owner, Stream, derive_seed
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, TensorPayload
from ..knowledge.class_stats import ClassStatistics
from ..knowledge.guidance import ClassGradientMean, GuideTarget, clipped_sgd_step, guide_gradients, guided_loss
from .base import PersonalModels, ServerContext, Split, Strategy

SERVER_LR = {"feature": 100.0, "logit": 0.1}  # HtFLlib's scripts on CIFAR-100 (-slr)


@dataclass
class FedL2GState:
    """What FedL2G's server carries from round to round."""

    vectors: Tensor  # [C, D] guiding vectors: class targets of the features (D = feature size) or logits (D = C)


class FedL2G(PersonalModels, Strategy):
    """Personal heterogeneous models guided by class vectors that the federation learns for the clients' benefit.

    The server holds a guiding vector per class, ``g`` ``[C, D]`` (N(0, 1) at the start), a target for the
    features (``target: feature``, every model's representation of size D) or the logits (``logit``, D = C).
    Each round a client receives ``g`` and:

    1. trains its own model on ``CE(z, y) + guide_weight * MSE(o, g_y)`` (``o`` its features or logits) over its
       training split less its quiz set, the first ``quiz_batches x batch_size`` examples of the split, which
       it never trains on; in the first ``warm_up_rounds`` rounds it does not train;
    2. takes the meta step (:func:`~fl_lightning.knowledge.guidance.guide_gradients`): one differentiable SGD
       step of that loss (the round's learning rate) on ``study_batches`` batches of its training part, then the
       gradient of the cross-entropy on its quiz set w.r.t. ``g``, and uploads it for the classes of the study
       batches: ``S x (D + 1)`` numbers.

    The server averages each class's gradients over the clients that sent one (0 for the others), clips the
    ``[C, D]`` gradient at norm ``server_clip`` and takes an SGD step at ``server_lr``; ``C x D`` numbers go down
    to each client. Clients are evaluated with their own models (``personal/``). Paper vs code:
    ``docs/algorithms.md``, FedL2G.

    Args:
        target: ``feature`` (FedL2G-f) or ``logit`` (FedL2G-l).
        guide_weight: the guiding loss's weight (1 in the code).
        warm_up_rounds: rounds at the start in which clients take only the meta step (HtFLlib: 50 of 2000).
        server_lr: the server's SGD rate on ``g``; None: HtFLlib's scripts' (100 for features, 0.1 for logits).
        server_clip: the norm the server clips the mean gradient to (100 in the code).
        study_batches: batches of the meta step's guided SGD step (1 in the code).
        quiz_batches: batches of the quiz set, held out of local training (1 in the code).
        split: where the clients' models are evaluated: ``test`` or ``global``.
    """

    state: FedL2GState

    def __init__(
        self,
        target: GuideTarget = "feature",
        guide_weight: NonNegative = 1.0,
        warm_up_rounds: NonNegativeInt = 0,
        server_lr: NonNegative | None = None,
        server_clip: Positive = 100.0,
        study_batches: PositiveInt = 1,
        quiz_batches: PositiveInt = 1,
        split: Split = "test",
    ):
        self.target, self.guide_weight, self.warm_up_rounds = target, guide_weight, warm_up_rounds
        self.server_lr = SERVER_LR[target] if server_lr is None else server_lr
        self.server_clip, self.split = server_clip, split
        self.study_batches, self.quiz_batches = study_batches, quiz_batches
        self.needs_split = target == "feature"  # the logit variant reads whole models' outputs only

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        if self.warm_up_rounds >= server.rounds:
            raise ConfigError(
                f"FedL2G's warm_up_rounds ({self.warm_up_rounds}) cover all {server.rounds} rounds, so no client would "
                f"ever train; lower strategy.init_args.warm_up_rounds below rounds."
            )
        self.num_classes = server.data.num_classes
        self.dim = self.guided_dim(server)
        self.quiz_size = self.quiz_batches * server.batch_size
        short = [c.id for c in server.clients if len(server.data.clients[c.id].train) <= self.quiz_size]
        if short:
            raise ConfigError(
                f"FedL2G holds out quiz_batches x batch_size = {self.quiz_size} training examples of each client as "
                f"its quiz set and trains on the rest, but clients {short[:5]} have no more than that; lower "
                f"training.batch_size or strategy.init_args.quiz_batches."
            )
        generator = torch.Generator().manual_seed(derive_seed(server.seed, 0, Owner.SERVER, Stream.CLIENT_INIT))
        self.state = FedL2GState(torch.randn(self.num_classes, self.dim, generator=generator))  # nn.Embedding's init

    def guided_dim(self, server: ServerContext) -> int:
        """D: the class count (logits), or the representation size every role shares (features)."""
        if self.target == "logit":
            return server.data.num_classes
        return server.shared_feature_dim(
            "(its feature variant) guides every model's features with one vector per class",
            "Give all builders the same representation size (e.g. hidden: 64), or use target: logit.",
        )

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        vectors = TensorPayload("guiding_vectors", {"vectors": self.state.vectors})
        return [ClientTask(c, rnd, {"guiding_vectors": vectors}) for c in clients]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        # at one address (CUDA graphs keep their key)
        vectors = ctx.on_device("guiding_vectors", task.received("guiding_vectors", TensorPayload).tensors["vectors"])
        train = ctx.indices.train
        quiz, study = train[: self.quiz_size], train[self.quiz_size :]
        metrics = {}
        if task.round > self.warm_up_rounds:
            batches = ctx.batches(indices=study, steps=ctx.local_steps(len(study)))
            metrics[f"{role}/loss"] = ctx.fit(role, step_fn=self.guided_step(vectors), batches=batches)["loss"]
            ctx.state["weights"] = ctx.weights(role)
        upload = self.meta_step(ctx, module, vectors, study, quiz)
        return ClientUpdate(task.client, len(study), {"guide_gradients": upload}, metrics)

    def meta_step(
        self, ctx: ClientContext, module: nn.Module, vectors: Tensor, study: Tensor, quiz: Tensor
    ) -> ClassStatistics:
        """The gradient of the quiz loss after one guided step w.r.t. the guiding vectors, on this round's model,
        as the rows of the classes studied (compact: ``S x (D + 1)`` numbers)."""
        study_batches = list(ctx.batches(indices=study, steps=self.study_batches))
        quiz_batches = list(ctx.batches(indices=quiz, steps=self.quiz_batches))
        module.train()
        lr = ctx.learning_rate(ctx.client.roles[0])
        gradient = guide_gradients(module, study_batches, quiz_batches, vectors, lr, self.guide_weight, self.target)
        present = torch.unique(torch.cat([y for _, y in study_batches]))
        return ClassStatistics("guide_gradients", {"gradients": gradient[present]}, present.to(torch.int32))

    def guided_step(self, vectors: Tensor):
        """The local training step: ``CE + guide_weight * MSE(o, g_y)`` (pure: batched clients, CUDA graphs)."""
        weight, logit = self.guide_weight, self.target == "logit"  # values, not the strategy, in the closure

        @vmappable
        def step(module, batch, i):
            x, y = batch
            if logit:
                logits = module(x)
                return guided_loss(logits, logits, y, vectors, weight)
            features = module.features(x)
            return guided_loss(features, module.head(features), y, vectors, weight)

        return step

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        mean = ClassGradientMean(self.num_classes, self.dim)
        for update in updates:
            upload = update.sent("guide_gradients", ClassStatistics)
            mean.add(upload.labels, upload.vectors["gradients"])
        vectors = self.state.vectors
        self.state.vectors = clipped_sgd_step(vectors, mean.mean(), self.server_lr, self.server_clip)
        return {"server/classes_guided": float((mean.counts > 0).sum())}
