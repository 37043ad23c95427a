"""FedGen: Zhu, Hong and Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021
in HtFLlib's heterogeneous form (clients share the head only) with the official code's losses."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Literal

import torch
from torch import Tensor

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import Ge, NonNegative, NonNegativeInt, Positive, PositiveFraction, PositiveInt
from ..federation.errors import ConfigError
from ..federation.seeding import Owner, Stream, derive_seed
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    Payload,
    StateDict,
    TensorPayload,
    clone_state,
)
from ..knowledge import WeightedAverage
from ..knowledge.feature_generator import (
    FeatureGenerator,
    LabelDraw,
    diversity_loss,
    ensemble_teacher_loss,
    heads_logits,
    label_distribution,
    label_shares,
    label_weighted_teacher_loss,
    regularised_loss,
    with_generated_features,
)
from .base import PersonalModels, ServerContext, Split, Strategy

MIN_WEIGHT = 1e-4  # the official floor of the decayed regulariser weights


@dataclass
class FedGenState:
    """What FedGen's server carries from round to round (``C`` classes)."""

    head: StateDict  # the global head: the sample-weighted average of the last round's heads, named as in a model
    generator: FeatureGenerator  # the conditional generator, trained further every round
    optimizer: torch.optim.Adam  # its Adam, kept across rounds as the official server keeps it
    label_distribution: Tensor  # [C] the labels generated samples carry, from the last round's label counts
    trainings: int = 0  # rounds the generator has been trained in; before the first it is not sent


class FedGen(PersonalModels, Strategy):
    """Heterogeneous extractors sharing one head, regularised by features a server-trained generator makes.

    Client k loads the global head onto its own extractor and trains the whole model on
    ``CE(f(x), y) + alpha_t CE(h(G(eps, y_hat)), y_hat) + beta_t KL(softmax(h(G(eps', y))) || f(x))`` (the
    official code's loss), one generated feature per real example, ``y_hat`` drawn from the
    server's label distribution, ``alpha_t = max(1e-4, alpha * decay^(t-1))`` in round t (``beta_t`` alike).
    The first round has no trained generator and trains on cross-entropy alone. It keeps its model and
    uploads its head (``D x C + C`` numbers for a linear head) and its label counts (``C`` int32).

    The server averages the heads weighted by examples and then takes ``generator_steps`` Adam steps on the
    generator (batches of ``generator_batch_size`` labels drawn from the distribution; persistent Adam, its
    rate decayed by ``decay`` per training) on ``teacher`` loss of the uploaded heads plus ``diversity``
    times the diversity term. It sends the head to every sampled client and, once trained, the
    generator (its weights and batch-norm statistics) and the label distribution (``C`` floats). Every
    head must have the same shapes. Paper, official code and HtFLlib: ``docs/algorithms.md``, FedGen.

    Args:
        alpha: weight of the generated samples' cross-entropy (10 in the official MNIST set-up; HtFLlib 1).
        beta: weight of the KL term (10 official; 0 drops it, as HtFLlib).
        decay: per-round decay of alpha, beta and the generator's learning rate (0.98 official; 1 keeps them).
        teacher: ``label_weighted``, each head's cross-entropy weighted by its client's share of the label
            (official code); ``ensemble``, the cross-entropy of the heads' logits averaged by example shares
            (HtFLlib).
        labels: ``uniform`` over the labels some client holds (official) or in proportion to their counts (HtFLlib).
        diversity: eta, weight of the diversity term (1 official; 0 HtFLlib).
        generator_steps: the server's Adam steps on the generator per round (50 official; HtFLlib 100).
        generator_batch_size: labels per server step (32 official, the clients' batch size; HtFLlib 10).
        generator_lr: the server's Adam learning rate (3e-4 official for MNIST).
        generator_weight_decay: its weight decay (1e-2 official; HtFLlib 0).
        noise_dim: size of the generator's noise (32 official for MNIST).
        hidden_dim: width of the generator's hidden layer (256 official for MNIST).
        evaluate_with: ``global``, each client's extractor under the current global head (HtFLlib writes it
            into every client before evaluating); ``local``, the model as the client last trained it.
        split: where personal models are evaluated: ``test`` (each client's local test split) or ``global``.
    """

    name = "FedGen"
    needs_split = True  # the head is shared apart from the extractor

    state: FedGenState

    def __init__(
        self,
        alpha: NonNegative = 10.0,
        beta: NonNegative = 10.0,
        decay: PositiveFraction = 0.98,
        teacher: Literal["label_weighted", "ensemble"] = "label_weighted",
        labels: LabelDraw = "uniform",
        diversity: NonNegative = 1.0,
        generator_steps: NonNegativeInt = 50,
        generator_batch_size: Annotated[int, Ge(2)] = 32,  # its batch norm needs two rows
        generator_lr: Positive = 3e-4,
        generator_weight_decay: NonNegative = 1e-2,
        noise_dim: PositiveInt = 32,
        hidden_dim: PositiveInt = 256,
        evaluate_with: Literal["global", "local"] = "global",
        split: Split = "test",
    ):
        self.alpha, self.beta, self.decay, self.diversity = alpha, beta, decay, diversity
        self.teacher, self.labels = teacher, labels
        self.generator_steps, self.generator_batch_size = generator_steps, generator_batch_size
        self.generator_lr, self.generator_weight_decay = generator_lr, generator_weight_decay
        self.noise_dim, self.hidden_dim = noise_dim, hidden_dim
        self.evaluate_with, self.split = evaluate_with, split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        heads = {r: {k: tuple(v.shape) for k, v in server.model(r).head.state_dict().items()} for r in server.roles}
        if len({tuple(h.items()) for h in heads.values()}) != 1:
            raise ConfigError(
                f"FedGen averages the heads of every model and trains one generator for them, so every role's head "
                f"must have the same parameters and shapes; got {heads}. Give the builders the same representation "
                "size and head."
            )
        first, device = server.roles[0], server.data.x.device
        self.num_classes, self.feature_dim = server.data.num_classes, server.feature_dim(first)
        self.head_template = copy.deepcopy(server.model(first).head).eval()  # the heads' structure, for any weights
        initial = server.initial_weights(first)
        self.head_keys = [k for k in initial if k.startswith("head.")]
        with torch.random.fork_rng(devices=[]):  # the server's own initialisation, from the run's seed alone
            torch.manual_seed(derive_seed(server.seed, 0, Owner.SERVER, Stream.CLIENT_INIT))
            generator = FeatureGenerator(self.num_classes, self.feature_dim, self.noise_dim, self.hidden_dim)
        generator = generator.to(device)
        self.client_generator = copy.deepcopy(generator).eval()  # clients generate in eval mode, any weights
        optimizer = torch.optim.Adam(
            generator.parameters(), lr=self.generator_lr, weight_decay=self.generator_weight_decay
        )
        distribution = torch.zeros(self.num_classes, device=device)
        self.state = FedGenState({k: initial[k] for k in self.head_keys}, generator, optimizer, distribution)

    def regulariser_weights(self, rnd: int) -> tuple[float, float]:
        """``alpha_t`` and ``beta_t`` of round ``rnd`` (the official ``exp_lr_scheduler`` of the 0-based round)."""
        factor = self.decay ** (rnd - 1)
        alpha, beta = (max(MIN_WEIGHT, w * factor) if w else 0.0 for w in (self.alpha, self.beta))
        return alpha, beta

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        state = self.state
        downlink: dict[str, Payload] = {"head": ModelWeights("head", state.head)}
        if state.trainings:  # a generator is sent once it has been trained
            downlink["generator"] = ModelWeights("generator", clone_state(state.generator.state_dict()))
            downlink["label_distribution"] = TensorPayload("label_distribution", {"p": state.label_distribution})
        return [ClientTask(c, rnd, dict(downlink)) for c in clients]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        local = self.server.own_weights(task.client, ctx.state.get("weights"))
        ctx.load(role, {**local, **task.received("head", ModelWeights).state})
        step, batches = None, None  # the first round: cross-entropy alone
        if "generator" in task.downlink:
            alpha, beta = self.regulariser_weights(task.round)
            generator = copy.deepcopy(self.client_generator)  # this client's own copy: a paused fit keeps it
            generator.load_state_dict(task.received("generator", ModelWeights).state)

            @torch.no_grad()
            def generate(noise: Tensor, labels: Tensor) -> Tensor:
                return generator(noise, labels)

            # the client's own stream of generated labels and noise, from its round's stream
            draws = torch.Generator().manual_seed(int(torch.randint(2**62, (), generator=ctx.generator)))
            distribution = task.received("label_distribution", TensorPayload).tensors["p"].double().cpu()
            batches = with_generated_features(ctx.batches(), generate, distribution, self.noise_dim, draws, beta > 0)
            step = regularised_step(alpha, beta)
        stats = ctx.fit(role, step_fn=step, batches=batches)
        trained = ctx.weights(role)
        ctx.state["weights"] = trained
        labels = ctx.data_y[ctx.indices.train]
        uplink = {
            "head": ModelWeights("head", {k: trained[k] for k in self.head_keys}),
            "label_counts": TensorPayload(
                "label_counts", {"counts": labels.bincount(minlength=self.num_classes).int()}
            ),
        }
        return ClientUpdate(task.client, ctx.num_examples(), uplink, {f"{role}/loss": stats["loss"]})

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        average, heads, counts, examples = WeightedAverage(), [], [], []
        for update in updates:
            head = update.sent("head", ModelWeights).state
            average.add(head, update.num_samples)
            heads.append({k.removeprefix("head."): v.detach() for k, v in head.items()})
            counts.append(update.sent("label_counts", TensorPayload).tensors["counts"].cpu())
            examples.append(update.num_samples)
        if not heads:
            return {}
        self.state.head = average.result()
        stacked = {k: torch.stack([head[k] for head in heads]) for k in heads[0]}  # [K, ...] per tensor
        loss = self.train_generator(stacked, torch.stack(counts).double(), torch.tensor(examples, dtype=torch.float64))
        return {"server/generator_loss": loss}

    def train_generator(self, heads: StateDict, counts: Tensor, examples: Tensor) -> float:
        """``generator_steps`` Adam steps on the teacher and diversity losses of the K uploaded ``heads`` (each
        tensor stacked ``[K, ...]``), their label ``counts`` ``[K, C]`` and ``examples`` ``[K]``; the mean loss.
        Sets the label distribution."""
        state, device = self.state, self.state.label_distribution.device
        distribution = label_distribution(counts.sum(0), self.labels)
        shares = label_shares(counts).to(device) if self.teacher == "label_weighted" else None
        for group in state.optimizer.param_groups:  # the official ExponentialLR, stepped once per training
            group["lr"] = self.generator_lr * self.decay**state.trainings
        rng, generator = self.server.round_generator(), state.generator
        generator.train()
        total = 0.0
        for _ in range(self.generator_steps):
            labels = torch.multinomial(distribution, self.generator_batch_size, replacement=True, generator=rng)
            noise = torch.rand(self.generator_batch_size, self.noise_dim, generator=rng).to(device)
            labels = labels.to(device)
            features = generator(noise, labels)
            logits = heads_logits(self.head_template, heads, features)
            if shares is not None:
                loss = label_weighted_teacher_loss(logits, labels, shares)
            else:
                loss = ensemble_teacher_loss(logits, labels, (examples / examples.sum()).to(device))
            if self.diversity:
                loss = loss + self.diversity * diversity_loss(noise, features)
            state.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            state.optimizer.step()
            total += loss.item()
        state.trainings += 1
        state.label_distribution = distribution.float().to(device)
        return total / max(self.generator_steps, 1)

    # ------------------------------------------------------------------ evaluation
    def personal_weights(self, client: ClientSpec, state: dict) -> tuple[str, StateDict]:
        """The client's own model, under the current global head with ``evaluate_with: global``."""
        role, weights = super().personal_weights(client, state)
        if self.evaluate_with == "global":
            weights = {**weights, **self.state.head}
        return role, weights


def regularised_step(alpha: float, beta: float):
    """The client's step on a batch ``(x, y, G(y_hat), y_hat[, G(y)])``: pure (batched clients, CUDA graphs)."""

    @vmappable
    def step(module, batch, i):
        x, y, generated, generated_labels, *for_labels = batch
        logits = module.head(module.features(x))
        head_on_labels = module.head(for_labels[0]) if for_labels else None
        return regularised_loss(logits, y, module.head(generated), generated_labels, alpha, beta, head_on_labels)

    return step
