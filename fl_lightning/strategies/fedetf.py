"""FedETF: Li, Shang, He, Lin, Wu, "No Fear of Classifier Biases: Neural Collapse Inspired Federated Learning
with Synthetic and Fixed Classifier", ICCV 2023."""

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
from ..federation.bounds import NonNegativeInt, Positive, PositiveInt
from ..federation.padding import real_labels
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    Role,
    StateDict,
    TensorPayload,
    load_exchanged,
)
from ..knowledge import WeightedAverage
from ..knowledge.cosine_classifier import Scale, cosine_logits
from ..knowledge.latent_alignment import simplex_etf
from ..models.base import FeatureClassifier
from .base import Phase, ServerContext, Split, global_metrics
from .fedavg import FedAvg, FedAvgState


@dataclass
class FedETFState(FedAvgState):
    """FedAvg's global weights, the fixed ETF, the global learnable scale and whether the clients personalised."""

    etf: Tensor  # [C, C] the fixed class vectors (rows, unit length)
    scale: Tensor  # [] beta, the learnable temperature, averaged like the weights
    personalized: bool


def balanced_softmax_loss(logits: Tensor, labels: Tensor, log_prior: Tensor) -> Tensor:
    """The balanced softmax cross-entropy: ``CE(logits + log n_c, y)``, ``n_c`` the client's examples of class c
    (a class it lacks counted as 1, as the official code), padded rows left out."""
    return F.cross_entropy(logits + log_prior, real_labels(labels))


class FedETF(FedAvg):
    """FedAvg over a model that classifies against a fixed simplex ETF, then local fine-tuning.

    The model's ``head`` is FedETF's projection layer: its C outputs are L2-normalised and compared with the
    C class vectors of a fixed simplex ETF (unit rows at pairwise cosine ``-1/(C - 1)``, drawn once from the
    run's seed and sent with the model), scaled by a learnable temperature beta (``scale_init``); the
    projection's width is therefore C, the official code's configuration for its LeNet. Each sampled client
    trains the model and beta on the balanced softmax loss (its class counts' logarithms added to the logits);
    the server averages both weighted by examples. In the last round a second phase, ``personalize``, sends the
    global model to every client, which trains it as in a round and then alternates ``finetune_cycles`` times:
    ``finetune_epochs`` passes of cross-entropy training its own copy of the ETF alone (SGD at ``etf_lr``), then
    as many training the projection alone (SGD at ``projection_lr`` with the recipe's momentum and weight
    decay). The global model is evaluated on the global test set as ``<role>/test_*``, the personalised ones
    from then on on each client's local ``split`` as ``personal/test_*``; both predict the class whose vector
    is nearest in cosine (run as the model with its head multiplied by the ETF, the same argmax; the reported
    loss is that model's, without beta). The method is defined for one architecture (one role). Where it
    follows the paper and where the official code: ``docs/algorithms.md``, FedETF.

    Args:
        scale_init: beta's initial value (1 in the official LeNet, 10 in its CIFAR CNN).
        finetune_cycles: alternations of the personalisation (20 in the official code; 0: none).
        finetune_epochs: passes over the client's training data in each half of a cycle (3 in the code).
        etf_lr: SGD learning rate of the ETF copy's fine-tuning (0.1 in the code).
        projection_lr: SGD learning rate of the projection's fine-tuning (0.05 in the code).
        split: the local split the personalised models are evaluated on.
        (roles, weighted: as FedAvg)
    """

    central_privacy = False  # its own aggregate averages the model and the scale without the noised sum

    state: FedETFState
    needs_split = True  # the projection is read apart from the features

    def __init__(
        self,
        scale_init: Positive = 1.0,
        finetune_cycles: NonNegativeInt = 20,
        finetune_epochs: PositiveInt = 3,
        etf_lr: Positive = 0.1,
        projection_lr: Positive = 0.05,
        split: Split = "test",
        roles: list[str] | None = None,
        weighted: bool = True,
    ):
        super().__init__(roles, weighted)
        self.scale_init, self.finetune_cycles, self.finetune_epochs = scale_init, finetune_cycles, finetune_epochs
        self.etf_lr, self.projection_lr, self.split = etf_lr, projection_lr, split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_architecture()
        self.num_classes = server.data.num_classes
        generator = torch.Generator().manual_seed(server.seed)
        etf = simplex_etf(self.num_classes, generator)
        self.state = FedETFState(self.state.global_weights, etf, torch.tensor(float(self.scale_init)), False)

    def phases(self) -> tuple[Phase, ...]:
        return (
            Phase("train", self.configure_round, self.client_update, self.aggregate),
            Phase("personalize", self.configure_personalization, self.personalize, self.personalized),
        )

    # ------------------------------------------------------------------ training
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        return [self._task(c, rnd) for c in super().configure_round(rnd, clients)]

    def _task(self, task: ClientTask, rnd: int) -> ClientTask:
        etf = TensorPayload("etf", {"etf": self.state.etf, "scale": self.state.scale})
        return ClientTask(task.client, rnd, {**task.downlink, "etf": etf})

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role, model, scale, loss = self._train_global(task, ctx)
        uplink = {
            role: self.outgoing(role, model.state_dict(), copy=True),
            "scale": TensorPayload("scale", {"scale": scale.scale.detach().clone()}),
        }
        return ClientUpdate(task.client, ctx.num_examples("train"), uplink, {f"{role}/loss": loss})

    def _train_global(self, task: ClientTask, ctx: ClientContext) -> tuple[Role, FeatureClassifier, Scale, float]:
        """Loads the received model and beta and trains both on the balanced softmax loss (a round's training)."""
        role = task.client.roles[0]
        module = ctx.load(role)
        load_exchanged(module.model, task.received(role, ModelWeights).state)
        received = task.received("etf", TensorPayload).tensors
        etf = ctx.on_device("etf", received["etf"])
        scale = cast(Scale, ctx.helper("etf_scale", Scale(), {"scale": received["scale"]}))
        log_prior = self._log_prior(ctx, self.num_classes)

        @vmappable  # pure (CUDA graphs replay it); beta trains beside the model, so clients train one at a time
        def step(modules, batch, i):
            x, y = batch
            model = modules[role].model
            logits = cosine_logits(model.head(model.features(x)), etf, scale.scale)
            return {role: balanced_softmax_loss(logits, y, log_prior)}

        losses = fit_jointly(ctx, (role,), step, helpers=[scale])
        return role, module.model, scale, losses[role]

    @staticmethod
    def _log_prior(ctx: ClientContext, num_classes: int) -> Tensor:
        """``log n_c`` of the client's training labels, a class it lacks counted as 1 (the official code)."""
        counts = torch.bincount(ctx.data_y[ctx.indices.train], minlength=num_classes).clamp(min=1)
        return ctx.on_device("log_prior", counts.float().log())

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        role = self.roles[0]
        weights, scale = WeightedAverage(), WeightedAverage()
        for update in updates:
            weight = update.num_samples if self.weighted else 1.0
            weights.add(update.sent(role, ModelWeights).state, weight)
            scale.add(update.sent("scale", TensorPayload).tensors, weight)
        if weights.count:
            self.state.global_weights[role] = {**self.state.global_weights[role], **weights.result()}
            self.state.scale = scale.result()["scale"].cpu()
        return {"etf/scale": float(self.state.scale)}

    # ------------------------------------------------------------------ personalisation
    def configure_personalization(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        if rnd != self.server.rounds or self.finetune_cycles == 0:
            return []
        tasks = super().configure_round(rnd, list(self.server.clients))
        return [self._task(t, rnd) for t in tasks]  # every client, as the code personalises all

    def personalize(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role, model, scale, _ = self._train_global(task, ctx)
        beta = scale.scale.detach().clone()  # frozen while fine-tuning, as every named parameter in the code
        etf = task.received("etf", TensorPayload).tensors["etf"].to(beta.device).clone().requires_grad_(True)
        steps = ctx.epoch_steps(ctx.num_examples("train")) * self.finetune_epochs
        momentum, decay = self._recipe_momentum_and_decay(ctx, role)
        for _ in range(self.finetune_cycles):  # fresh optimizers each half-cycle, as the code's
            self._finetune(ctx, role, model, etf, beta, steps, torch.optim.SGD([etf], lr=self.etf_lr), train_etf=True)
            head = model.head
            projection = torch.optim.SGD(
                head.parameters(), lr=self.projection_lr, momentum=momentum, weight_decay=decay
            )
            self._finetune(ctx, role, model, etf, beta, steps, projection, train_etf=False)
        weights = ctx.weights(role)
        etf = etf.detach() * beta.sign()  # the argmax of beta * cos(p, etf_c) is that of p . sign(beta) etf_c
        weights["head.weight"], weights["head.bias"] = etf @ weights["head.weight"], etf @ weights["head.bias"]
        ctx.state["weights"] = weights
        return ClientUpdate(task.client, ctx.num_examples("train"), {})

    def _finetune(self, ctx, role, model, etf, beta, steps, optimizer, train_etf: bool) -> None:
        """``steps`` cross-entropy steps of ``optimizer``, moving the ETF copy alone or the projection alone."""
        model.train()
        ctx.count_steps(role, steps)
        for x, y in ctx.batches("train", steps=steps):
            optimizer.zero_grad(set_to_none=True)
            with torch.no_grad():
                h = model.features(x)
            if train_etf:
                with torch.no_grad():
                    projected = model.head(h)
                logits = cosine_logits(projected, etf, beta)
            else:
                logits = cosine_logits(model.head(h), etf.detach(), beta)
            F.cross_entropy(logits, y).backward()
            optimizer.step()

    @staticmethod
    def _recipe_momentum_and_decay(ctx: ClientContext, role: Role) -> tuple[float, float]:
        """The recipe optimizer's momentum and weight decay (the code's projection fine-tuning uses the run's)."""
        group = ctx.slot(role).optimizer.param_groups[0]
        return float(group.get("momentum", 0.0)), float(group.get("weight_decay", 0.0))

    def personalized(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        for _ in updates:  # the personalised models stay on the clients
            self.state.personalized = True
        return {}

    # ------------------------------------------------------------------ evaluation
    def folded(self, weights: StateDict) -> StateDict:
        """The model with its head multiplied by the (sign of beta times the) ETF: its argmax is FedETF's."""
        etf = self.state.etf.to(weights["head.weight"].device) * self.state.scale.sign()
        return {**weights, "head.weight": etf @ weights["head.weight"], "head.bias": etf @ weights["head.bias"]}

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        metrics = global_metrics(evaluator, {r: self.folded(w) for r, w in self.state.global_weights.items()})
        if self.state.personalized:
            metrics |= evaluator.personalized(self._personal_weights, split=self.split)
        return metrics

    def _personal_weights(self, client: ClientSpec, state: dict) -> tuple[Role, StateDict]:
        role = client.roles[0]
        return role, self.server.own_weights(client, state.get("weights"), role)
