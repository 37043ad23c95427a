"""On-device KD with a small auxiliary model: Lim, Jo, Zhang, Lee (paper 001), Section 3.2, eq. 1-2."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.steps import vmappable
from ..federation.bounds import NonNegative, NonNegativeInt, Positive
from ..federation.errors import ConfigError
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, Role, StateDict, load_exchanged
from ..knowledge import WeightedAverage
from ..knowledge.distillation import kd_kl_loss, ramp_up
from .base import Phase, SentWeights, ServerContext, Strategy, global_metrics


@dataclass
class OnDeviceKDState:
    """What on-device KD carries from round to round."""

    global_weights: dict[Role, StateDict]  # the auxiliary and the target model


class OnDeviceKD(Strategy):
    """Weak clients train a small auxiliary model; strong clients also distill it into a large target.

    Phase ``auxiliary`` (eq. 1): every sampled client runs the local steps on the auxiliary model with
    its labeled data; the server averages them. Phase ``target`` (eq. 2): strong clients (the tiers that
    list ``target_role``) receive the new auxiliary model and the target model, run the local steps of
    cross-entropy on the target with their labeled data, then the same number of distillation steps on
    their unlabeled data with loss ``w(r) * T^2 * KL(softmax(aux/T) || softmax(target/T))``, ``w(r)``
    ramping up as ``kd_weight * exp(-5 (1 - r/R)^2)`` over the first ``ramp_rounds`` rounds; the server
    averages the targets. Models travel without their frozen parts, as in FedAvg. The defaults follow
    the official code where it departs from the paper: ``docs/algorithms.md``, On-device KD.

    Args:
        aux_role: role of the auxiliary (small) model, trained by every tier.
        target_role: role of the target (large) model, trained by the strong tier.
        temperature: T (3 in the paper).
        kd_weight: lambda, the KL weight after the ramp-up (0.5 for CIFAR-10, 1 elsewhere).
        ramp_rounds: rounds of ramp-up (300 of 400 for CIFAR-10, 80 for IMDB / Speech Commands); 0: none.
        kd_mode: ``sequential`` CE and KD steps (code) or ``joint``, their sum in each step (eq. 2).
        teacher_mode: ``train`` (code: batch statistics) or ``eval`` (running statistics).
        all_strong_every_round: strong clients join every round (code) or only when sampled.
        weighted: weight averages by labeled examples instead of uniformly (code).
    """

    state: OnDeviceKDState

    def __init__(
        self,
        aux_role: str = "aux",
        target_role: str = "target",
        temperature: Positive = 3.0,
        kd_weight: NonNegative = 0.5,
        ramp_rounds: NonNegativeInt = 0,
        kd_mode: Literal["sequential", "joint"] = "sequential",
        teacher_mode: Literal["train", "eval"] = "train",
        all_strong_every_round: bool = True,
        weighted: bool = False,
    ):
        self.aux_role, self.target_role = aux_role, target_role
        self.temperature, self.kd_weight, self.ramp_rounds = temperature, kd_weight, ramp_rounds
        self.kd_mode, self.teacher_mode = kd_mode, teacher_mode
        self.all_strong_every_round, self.weighted = all_strong_every_round, weighted
        self._round_kd_weight: torch.Tensor | None = None

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        missing = [role for role in (self.aux_role, self.target_role) if role not in server.roles]
        if missing:
            raise ConfigError(
                f"OnDeviceKD needs the model roles {self.aux_role!r} (the auxiliary model every client trains) and "
                f"{self.target_role!r} (the strong clients' target), but the tiers train {server.roles}; add "
                f"{' and '.join(map(repr, missing))} to the recipe, e.g. {self._recipe_snippet()}, or name roles the "
                "tiers train with strategy.init_args.aux_role / target_role."
            )
        self.strong = [c for c in server.clients if self.target_role in c.roles]
        if not self.strong:
            raise ConfigError(
                f"no tier trains {self.target_role!r}: OnDeviceKD's strong clients train it with {self.aux_role!r}; "
                f"give a tier both roles, e.g. {self._recipe_snippet()}."
            )
        roles = (self.aux_role, self.target_role)
        self.state = OnDeviceKDState({r: server.initial_weights(r) for r in roles})
        self.outgoing = SentWeights(server, roles)

    def _recipe_snippet(self) -> str:
        """The two roles and two tiers as a recipe writes them (recipes/digits_ondevice_kd.yaml)."""
        aux, target = self.aux_role, self.target_role
        return (
            f"`models: {{{aux}: {{builder: digits_cnn, args: {{width: 0.25}}}}, {target}: {{builder: digits_cnn}}}}` "
            f"with `population: {{tiers: [{{name: strong, roles: [{aux}, {target}], count: 4}}, "
            f"{{name: weak, roles: [{aux}]}}]}}` (as in recipes/digits_ondevice_kd.yaml)"
        )

    def receive(self, ctx: ClientContext, task: ClientTask, role: str):
        """Loads the received ``role`` weights over the client's instance (its frozen part stays); the module."""
        module = ctx.load(role)
        load_exchanged(module.model, task.received(role, ModelWeights).state)
        return module

    def phases(self) -> tuple[Phase, ...]:
        return (
            Phase("auxiliary", self.configure_auxiliary, self.train_auxiliary, self.aggregate_auxiliary),
            Phase("target", self.configure_target, self.distill_target, self.aggregate_target),
        )

    # ------------------------------------------------------------------ auxiliary: every client, averaged
    def configure_auxiliary(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        aux = self.outgoing(self.aux_role, self.state.global_weights[self.aux_role])
        return [ClientTask(c, rnd, {self.aux_role: aux}) for c in clients if self.aux_role in c.roles]

    def train_auxiliary(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        aux = self.receive(ctx, task, self.aux_role)
        loss = ctx.fit(self.aux_role)["loss"]
        return ClientUpdate(
            task.client,
            ctx.num_examples(),
            {self.aux_role: self.outgoing(self.aux_role, aux.model.state_dict(), copy=True)},
            {f"{self.aux_role}/loss": loss},
        )

    def aggregate_auxiliary(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        self.average_into(self.aux_role, updates)
        return {}

    # ------------------------------------------------------------------ target: strong clients distil
    def configure_target(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        aux = self.outgoing(self.aux_role, self.state.global_weights[self.aux_role])
        strong = self.strong if self.all_strong_every_round else [c for c in clients if self.target_role in c.roles]
        target = self.outgoing(self.target_role, self.state.global_weights[self.target_role])
        return [ClientTask(c, rnd, {self.aux_role: aux, self.target_role: target}) for c in strong]

    def distill_target(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        teacher = self.receive(ctx, task, self.aux_role)
        teacher.train(self.teacher_mode == "train")
        target = self.receive(ctx, task, self.target_role)
        weight = self._kd_weight_on(ctx.data_x.device, ramp_up(task.round - 1, self.kd_weight, self.ramp_rounds))
        temperature = self.temperature  # a local, not `self`: a CUDA graph's key then holds only what the step reads

        @vmappable  # pure: clients of the target phase can train batched (client/batched/)
        def kd_step(module, batch, i):
            x = batch[0]
            # a target only: no graph through the teacher (its training-mode statistics still move)
            with torch.no_grad():
                with_teacher = teacher(x)
            return weight * kd_kl_loss(module(x), with_teacher, temperature)

        metrics = {}
        if self.kd_mode == "sequential":
            metrics[f"{self.target_role}/loss"] = ctx.fit(self.target_role)["loss"]
            if ctx.num_examples("unlabeled"):
                metrics[f"{self.target_role}/kd_loss"] = ctx.fit(self.target_role, "unlabeled", kd_step)["loss"]
        else:
            unlabeled = ctx.batches("unlabeled", steps=ctx.local_steps())

            def joint_step(module, batch, i):
                x, y = batch
                return F.cross_entropy(module(x), y) + kd_step(module, next(unlabeled), i)

            metrics[f"{self.target_role}/loss"] = ctx.fit(self.target_role, step_fn=joint_step)["loss"]
        uplink = {self.target_role: self.outgoing(self.target_role, target.model.state_dict(), copy=True)}
        return ClientUpdate(task.client, ctx.num_examples(), uplink, metrics)

    def _kd_weight_on(self, device: torch.device, value: float) -> torch.Tensor:
        """The round's KD weight in one device tensor, refilled each round rather than a new float: a CUDA graph
        of the KD step (runtime.cuda_graphs) reads the tensor where it lies, so the 300-round ramp does not
        capture new graphs every round. A float32 scalar times the loss, as the float was (bit-identical)."""
        if self._round_kd_weight is None or self._round_kd_weight.device != device:
            self._round_kd_weight = torch.zeros((), device=device)
        return self._round_kd_weight.fill_(value)

    def aggregate_target(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        self.average_into(self.target_role, updates)
        return {"server/kd_weight": ramp_up(rnd - 1, self.kd_weight, self.ramp_rounds)}

    def average_into(self, role: str, updates: Iterator[ClientUpdate]) -> None:
        """The global ``role`` weights become the (weighted) average of the updates' (none: they stay)."""
        average = WeightedAverage()
        for update in updates:
            average.add(update.sent(role, ModelWeights).state, update.num_samples if self.weighted else 1.0)
        if average.count:
            weights = self.state.global_weights
            weights[role] = {**weights[role], **average.result()}

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        return global_metrics(evaluator, self.state.global_weights)

    @property
    def monitor(self) -> str:
        return f"{self.target_role}/test_acc"
