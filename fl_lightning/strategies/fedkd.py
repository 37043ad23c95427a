"""FedKD: Wu et al., "Communication-efficient federated learning via knowledge distillation", Nature
Communications 13, 2032 (2022) (Methods: adaptive mutual distillation, dynamic gradient approximation;
a baseline of paper 004)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

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
    clone_state,
    load_exchanged,
)
from ..knowledge import WeightedAverage
from ..knowledge.compression import LowRankUpdate, compress, energy_threshold
from ..knowledge.mutual import KLReduction, hidden_map, hidden_state_loss, mutual_kl
from .base import PersonalModels, SentWeights, ServerContext, Split, Strategy, global_metrics


def adaptive_mutual_losses(
    mentor: tuple[Tensor, Tensor],
    mentee: tuple[Tensor, Tensor],
    y: Tensor,
    mapping: nn.Module,
    adaptive: bool = True,
    reduction: KLReduction = "batchmean",
    detach: bool = False,
) -> tuple[Tensor, Tensor]:
    """The mentor's and the mentee's losses of one batch (Methods, adaptive mutual distillation).

    ``L_t = CE_t + (KL(p_s || p_t) + MSE(H_t, W_h H_s)) / (CE_t + CE_s)`` and
    ``L_s = CE_s + (KL(p_t || p_s) + MSE(H_t, W_h H_s)) / (CE_t + CE_s)``: the distillation is weaker
    while the two models' predictions are poor. ``adaptive: false`` drops the denominator. With
    ``detach`` each loss treats the other model's outputs and the denominator as constants.

    Args:
        mentor: its representations ``H_t`` ``[B, D_t]`` and logits ``[B, C]``.
        mentee: its representations ``H_s`` ``[B, D_s]`` and logits.
        y: labels ``[B]``.
        mapping: ``W_h``, from ``D_s`` to ``D_t``.
    """
    (h_t, z_t), (h_s, z_s) = mentor, mentee
    ce_t, ce_s = F.cross_entropy(z_t, y), F.cross_entropy(z_s, y)
    denominator: Tensor | float = 1.0
    if adaptive:
        denominator = (ce_t + ce_s).detach() if detach else ce_t + ce_s
    const_t, const_s = (h_t.detach(), h_s.detach()) if detach else (h_t, h_s)
    mentor_loss = (
        ce_t + (mutual_kl(z_t, z_s, reduction, detach) + hidden_state_loss(h_t, const_s, mapping)) / denominator
    )
    mentee_loss = (
        ce_s + (mutual_kl(z_s, z_t, reduction, detach) + hidden_state_loss(const_t, h_s, mapping)) / denominator
    )
    return mentor_loss, mentee_loss


@dataclass
class FedKDState:
    """What FedKD's server carries from round to round."""

    mentee_weights: StateDict  # the global mentee
    last_update: dict = field(default_factory=dict)  # the last round's compressed mean update (svd), as plain state
    last_trained: list[int] = field(default_factory=list)  # the clients that trained in the last round


class FedKD(PersonalModels, Strategy):
    """A local mentor and a shared mentee per client, adaptive mutual distillation, compressed updates.

    Each client trains its mentor (any architecture, kept local) and a copy of the shared mentee (one
    architecture for all) on the same batches with :func:`adaptive_mutual_losses`; ``W_h`` maps the
    mentee's representation to the mentor's size and stays on the client, trained with a fresh optimizer
    of the recipe's kind each round. Only the mentee's **update** (trained minus received weights) goes
    up; the server averages the updates and applies the mean to the global mentee.

    With ``compression: svd`` (dynamic gradient approximation) each update matrix travels as its truncated
    SVD at the energy threshold ``T(r)`` rising from ``energy_start`` to ``energy_end`` over the rounds
    (:mod:`~fl_lightning.knowledge.compression`); the server compresses the mean again and applies what it
    sends. A client that trained in the previous round receives only that compressed update, any other
    the full mentee. ``compression: none`` sends the full mentee down and the dense update up.

    A tier lists the mentor's role and the mentee role, e.g. ``roles: [cnn_large, mentee]``. Mentors are
    evaluated as ``personal/``, the mentee on the global test set. Where the options follow the official
    code or HtFLlib: ``docs/algorithms.md``, FedKD.

    Args:
        mentee_role: the role of the shared mentee.
        adaptive: divide the distillation losses by ``CE_t + CE_s``.
        kl_reduction: the KL per example (``batchmean``) or divided by ``B x C`` (``mean``, both codes).
        detach_partner: each loss trains only its own model (both codes: ``false``).
        compression: ``none`` or ``svd``.
        energy_start: T at the start (0.95 in the code).
        energy_end: T in the last round (0.98 in the code).
        weighted: weight the update average by labeled examples (the official code: uniform).
        split: where the mentors are evaluated: ``test`` or ``global``.
    """

    needs_split = True  # reads the models' features and head apart

    state: FedKDState

    def __init__(
        self,
        mentee_role: str = "mentee",
        adaptive: bool = True,
        kl_reduction: KLReduction = "batchmean",
        detach_partner: bool = False,
        compression: Literal["none", "svd"] = "none",
        energy_start: float = 0.95,
        energy_end: float = 0.98,
        weighted: bool = False,
        split: Split = "test",
    ):
        if not 0.0 < energy_start <= energy_end <= 1.0:
            raise ConfigError(f"FedKD needs 0 < energy_start <= energy_end <= 1, got {energy_start} and {energy_end}.")
        self.mentee_role, self.adaptive, self.kl_reduction = mentee_role, adaptive, kl_reduction
        self.detach_partner, self.compression, self.weighted, self.split = detach_partner, compression, weighted, split
        self.energy_start, self.energy_end = energy_start, energy_end

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_private_and_shared_role(self.mentee_role, "mentee")
        self.state = FedKDState(server.initial_weights(self.mentee_role))
        self.outgoing = SentWeights(server, [self.mentee_role])  # a frozen part of the mentee stays home

    def personal_role(self, client: ClientSpec) -> str:
        """The client's mentor: its role other than the mentee."""
        return next(r for r in client.roles if r != self.mentee_role)

    def energy(self, rnd: int) -> float | None:
        if self.compression == "none":
            return None
        return energy_threshold(rnd, self.server.rounds, self.energy_start, self.energy_end)

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        state = self.state
        full = {self.mentee_role: self.outgoing(self.mentee_role, state.mentee_weights)}
        if not state.last_update:
            return [ClientTask(c, rnd, full) for c in clients]
        update = {"mentee_update": LowRankUpdate.from_state(state.last_update)}
        return [ClientTask(c, rnd, update if c.id in state.last_trained else full) for c in clients]

    # ------------------------------------------------------------------ client
    def received_mentee(self, task: ClientTask, ctx: ClientContext) -> StateDict:
        """The mentee the client holds: the full weights, or its last one plus the compressed update."""
        if self.mentee_role in task.downlink:
            return task.received(self.mentee_role, ModelWeights).state
        delta = task.received("mentee_update", LowRankUpdate).reconstruct()
        # the update is restored on the CPU when a run resumes; the client's last mentee is on its device
        return {k: v + delta[k].to(v.device) if k in delta else v for k, v in ctx.state["mentee_base"].items()}

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        mentor, mentor_weights = self.personal_weights(task.client, ctx.state)
        mentee = self.mentee_role
        base = self.received_mentee(task, ctx)
        if self.compression == "svd":
            ctx.state["mentee_base"] = base
        ctx.load(mentor, mentor_weights)
        load_exchanged(ctx.load(mentee).model, base)
        mapping = self.client_hidden_map(task.client, ctx)
        adaptive, reduction, detach = self.adaptive, self.kl_reduction, self.detach_partner

        @vmappable  # pure: replayed from CUDA graphs (runtime.cuda_graphs)
        def step(modules, batch, i):
            x, y = batch
            h_t, h_s = modules[mentor].features(x), modules[mentee].features(x)
            losses = adaptive_mutual_losses(
                (h_t, modules[mentor].head(h_t)),
                (h_s, modules[mentee].head(h_s)),
                y,
                mapping,
                adaptive,
                reduction,
                detach,
            )
            return dict(zip((mentor, mentee), losses))

        losses = fit_jointly(ctx, (mentor, mentee), step, helpers=[mapping])
        ctx.state["weights"] = ctx.weights(mentor)
        ctx.state["hidden_map"] = clone_state(mapping.state_dict())
        trained = ctx.weights(mentee)
        delta = {k: trained[k] - base[k].to(trained[k].device) for k in base if trained[k].is_floating_point()}
        uplink = {"mentee_update": compress("mentee_update", delta, self.energy(task.round))}
        metrics = {f"{role}/loss": loss for role, loss in losses.items()}
        return ClientUpdate(task.client, ctx.num_examples(), uplink, metrics)

    def client_hidden_map(self, client: ClientSpec, ctx: ClientContext) -> nn.Module:
        """The client's ``W_h`` (new on its first round, from torch's per-client-update generator), in the
        one instance of its shape (``ctx.helper``)."""
        # drawn every round, the client's first included, so that the random stream after it stays the same
        fresh = hidden_map(
            self.server.feature_dim(self.mentee_role), self.server.feature_dim(self.personal_role(client))
        )
        return ctx.helper("hidden_map", fresh, ctx.state.get("hidden_map"))

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        average, trained = WeightedAverage(), []
        for update in updates:
            delta = update.sent("mentee_update", LowRankUpdate).reconstruct()
            average.add(delta, update.num_samples if self.weighted else 1.0)
            trained.append(update.client.id)
        if not average.count:
            return {}
        mean = average.result()
        if self.compression == "svd":
            sent = compress("mentee_update", mean, self.energy(rnd))
            mean = sent.reconstruct()  # what the clients will apply, so the server applies exactly that
            self.state.last_update = sent.state_dict()
        self.state.mentee_weights = {k: v + mean[k] if k in mean else v for k, v in self.state.mentee_weights.items()}
        self.state.last_trained = trained
        energy = self.energy(rnd)
        return {} if energy is None else {"server/energy": energy}

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        """The mentors (``personal/``) and the mentee on the global test set."""
        mentee = {self.mentee_role: self.state.mentee_weights}
        return {**super().evaluate(evaluator), **global_metrics(evaluator, mentee)}
