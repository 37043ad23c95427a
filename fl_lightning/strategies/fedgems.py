"""FedGEMS: Cheng et al., "FedGEMS: Federated Learning of Larger Server Models via Selective Knowledge Fusion",
arXiv:2110.11027, 2021 (Sec. 3.3-3.4, eq. 1-6, Algorithm 1). The losses follow the paper's equations; the
round's order follows AIJack's implementation (``aijack/collaborative/fedgems``: server, client and API),
whose KL form is an option (``kl_form: aijack``), and paper 001's set-up (Appendix 6.3, Table 13)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.steps import vmappable
from ..federation.bounds import Fraction01, NonNegativeInt, Positive, PositiveInt
from ..federation.padding import padded_loss, real_labels
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, StateDict, TensorPayload
from ..knowledge.public_set import (
    eval_logits,
    target_batches,
)
from ..knowledge.server_optim import ServerOptimizer, server_optimizer
from .base import PersonalModels, Phase, ServerContext, Split, Strategy, global_metrics


def selective_fusion(client_logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The clients' fused knowledge per public example, from the clients that predict it correctly.

    Client k's weight on example i is ``softmax_k(1 / H(softmax(z_ki)))`` over the clients whose
    prediction is right (the most confident, lowest entropy, weigh most); wrong clients are masked out.

    Args:
        client_logits: ``[K, N, C]``, K clients' logits on N public examples.
        labels: ``[N]``.

    Returns:
        The fused logits ``[N, C]`` and ``[N]`` whether any client was right (no knowledge otherwise).
    """
    probs = F.softmax(client_logits.double(), dim=2)
    entropy = -(probs * probs.clamp(min=1e-30).log()).sum(dim=2)  # [K, N]
    correct = client_logits.argmax(dim=2) == labels[None, :]
    score = torch.where(correct, 1.0 / entropy.clamp(min=1e-12), torch.full_like(entropy, float("-inf")))
    any_correct = correct.any(dim=0)
    weights = torch.softmax(torch.where(any_correct[None, :], score, torch.zeros_like(score)), dim=0)
    weights = weights * any_correct[None, :]
    return (weights[:, :, None] * client_logits.double()).sum(dim=0).float(), any_correct


KLForm = Literal["paper", "aijack"]  # the KL from teacher to student per example, or AIJack's


def kl_rows(student_logits: Tensor, teacher_logits: Tensor, form: KLForm = "paper") -> Tensor:
    """The server's per-example distillation term ``[B]`` (eq. 2 and 5, at T = 1).

    ``paper``: ``KL(softmax(t) || softmax(s))`` summed over the classes, the paper's ``D_KL(l_teacher || l_s)``.
    ``aijack``: AIJack's ``nn.KLDivLoss()(log softmax(t), softmax(s))``: the KL the other way,
    ``KL(softmax(s) || softmax(t))``, divided by C (the ``mean`` reduction divides the batch's sum by B x C).
    """
    if form == "paper":
        return F.kl_div(F.log_softmax(student_logits, 1), F.softmax(teacher_logits, 1), reduction="none").sum(1)
    rows = F.kl_div(F.log_softmax(teacher_logits, 1), F.softmax(student_logits, 1), reduction="none").sum(1)
    return rows / student_logits.shape[1]


def client_distillation_loss(
    z: Tensor, y: Tensor, server_logits: Tensor, epsilon: float, temperature: float = 1.0, form: KLForm = "paper"
) -> Tensor:
    """A client's loss on public examples (eq. 6): ``eps CE(z, y) + (1 - eps) T^2 KL``, both averaged over the
    batch. ``form: paper``: ``KL(softmax(s / T) || softmax(z / T))`` per example (the server's logits ``s``
    teach); ``aijack``: ``KL(softmax(z / T) || softmax(s / T))`` divided by B x C, as AIJack's client."""
    log_student = F.log_softmax(z / temperature, 1)
    # the means leave out a padded batch's padded rows (batched clients in lockstep); unpadded, plain kl_div
    if form == "paper":
        kl = padded_loss(F.kl_div, log_student, F.softmax(server_logits / temperature, 1), reduction="batchmean")
    else:
        kl = padded_loss(F.kl_div, F.log_softmax(server_logits / temperature, 1), log_student.exp(), reduction="mean")
    return epsilon * F.cross_entropy(z, real_labels(y)) + (1 - epsilon) * kl * temperature**2


@dataclass
class FedGEMSState:
    """What FedGEMS's server carries from round to round (``N`` public examples, ``C`` classes)."""

    server_weights: StateDict  # the server's own model
    pool_logits: Tensor  # [N, C] the server's logits on the public examples it last predicted correctly
    pool_known: Tensor  # [N] bool, the examples that have an entry in the pool


class FedGEMS(PersonalModels, Strategy):
    """A large server model trained by selective knowledge fusion on a labeled public set (eq. 1-6).

    Every client keeps its own model. A round has two phases:

    * ``train``: each sampled client trains on its private data with cross-entropy, then uploads its
      eval-mode logits on the round's public examples (``n x C`` numbers). The server trains its own
      model (``server_role``, a role no tier lists) for ``server_steps`` on those examples with
      :meth:`server_loss`: cross-entropy where it is right (its logits then join its pool, eq. 1),
      ``eps CE + (1 - eps) KL(teacher || server)`` where it is wrong, the teacher being its pool entry
      (eq. 2) or else the :func:`selective_fusion` of the clients that are right (eq. 3-5). It sends its
      eval-mode logits on the examples back (``n x C`` numbers).
    * ``distill``: the same clients train on the public examples with :func:`client_distillation_loss` (eq. 6).

    The public set is the server's labeled split (``data.server_fraction``), held by every client. The
    server model is evaluated on the global test set (``<server_role>/test_acc``, the monitor), the
    clients' own models as ``personal/``. Where the losses follow the paper and the round AIJack's code,
    and how epsilon is read: ``docs/algorithms.md``, FedGEMS.

    Args:
        server_role: the server model's role in ``models`` (no tier may list it).
        epsilon: weight of the cross-entropy; ``1 - epsilon`` weighs the distillation (0.75, the paper's).
        temperature: T of the clients' distillation (1 in paper 001, Table 13).
        public_size: public examples per round (``None``: the whole public set).
        server_steps: server steps per round (``None``: one pass over the round's public examples).
        distill_steps: client steps on the public examples (``None``: one pass).
        server_lr: learning rate of the server's optimizer (a fresh one each round).
        server_optimizer: ``adam`` or ``sgd`` (momentum 0.9).
        batch_size: public examples per server and distillation step.
        split: where the clients' own models are evaluated (``global`` or their local ``test`` split).
        kl_form: ``paper`` (the KL from teacher to student per example) or ``aijack`` (student to teacher,
            divided by C).
    """

    state: FedGEMSState

    # within a round only: the clients that uploaded, the round's public subset and the server's logits on it
    uploaders: list[ClientSpec]
    positions: Tensor | None
    server_logits: Tensor | None

    def __init__(
        self,
        server_role: str = "server",
        epsilon: Fraction01 = 0.75,
        temperature: Positive = 1.0,
        public_size: int | None = None,
        server_steps: NonNegativeInt | None = None,
        distill_steps: NonNegativeInt | None = None,
        server_lr: Positive = 0.003,
        server_optimizer: ServerOptimizer = "adam",
        batch_size: PositiveInt = 32,
        split: Split = "global",
        kl_form: KLForm = "paper",
    ):
        self.server_role, self.epsilon, self.temperature = server_role, epsilon, temperature
        self.public_size, self.server_steps, self.distill_steps = public_size, server_steps, distill_steps
        self.server_lr, self.server_optimizer, self.batch_size = server_lr, server_optimizer, batch_size
        self.split, self.kl_form = split, kl_form

    def server_roles(self) -> tuple[str, ...]:
        return (self.server_role,)

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        server.require_server_only_role(self.server_role)
        self.public_x, self.public_y = server.server_labeled()
        self.exchange = server.public_exchange(self.public_size, "public_size", "public", labeled=True)
        num_public = self.exchange.num_public
        pool_logits = torch.zeros(num_public, server.data.num_classes)
        pool_known = torch.zeros(num_public, dtype=torch.bool)
        self.state = FedGEMSState(server.initial_weights(self.server_role), pool_logits, pool_known)
        self.uploaders, self.positions, self.server_logits = [], None, None  # within a round only

    def phases(self) -> tuple[Phase, ...]:
        return (
            Phase("train", self.configure_train, self.train, self.aggregate_logits),
            Phase("distill", self.configure_distill, self.distill),
        )

    # ------------------------------------------------------------------ train: public logits up
    def configure_train(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        self.positions = self.exchange.subset(rnd)
        return self.exchange.tasks(rnd, clients)

    def train(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role, module = self.load_own(task, ctx)
        x_public = self.exchange.received(task, ctx)[0]  # its positions remembered until the distillation
        metrics = {f"{role}/loss": ctx.fit(role)["loss"]}
        logits = eval_logits(module, x_public, ctx.eval_batch_size)
        return self.keep_own(task, ctx, {"public_logits": TensorPayload("public_logits", {"logits": logits})}, metrics)

    def aggregate_logits(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        """Selective fusion of the clients' logits, the server model's training on it, its logits for the reply."""
        received, self.uploaders = [], []
        for update in updates:
            received.append(update.sent("public_logits", TensorPayload).tensors["logits"].detach())
            self.uploaders.append(update.client)
        if not received:
            return {}
        rows = torch.arange(self.exchange.num_public) if self.positions is None else self.positions.long()
        device = self.public_x.device
        rows = rows.to(device)
        x, y = self.public_x[rows], self.public_y[rows]
        fused, any_correct = selective_fusion(torch.stack([r.to(device) for r in received]), y)
        loss = self.train_server(x, y, rows, fused, any_correct)
        self.server_logits = self.server.predict(self.server_role, self.state.server_weights, x).float()
        return {"server/loss": loss, "server/clients_right": float(any_correct.float().mean())}

    # ------------------------------------------------------------------ distill: the server's logits down
    def configure_distill(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        logits = None if self.server_logits is None else {"logits": self.server_logits}
        return self.exchange.reply(rnd, self.uploaders, "server_logits", logits)

    def distill(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        """The client distils from the server's logits on its public subset; nothing goes back."""
        role = self.load_own(task, ctx)[0]
        x_public, positions = self.exchange.recalled(ctx)
        chosen = ctx.public_indices if positions is None else ctx.public_indices[positions.long()]
        # server knowledge and public labels at one address per name (CUDA graphs keep their key)
        y_public = ctx.on_device("public_labels", ctx.data_y[chosen])
        server_logits = task.received("server_logits", TensorPayload).tensors["logits"].to(x_public.device)
        teacher = ctx.on_device("teacher", server_logits)
        order = torch.arange(len(x_public), device=x_public.device)
        batches = target_batches(x_public, order, self.batch_size, self.distill_steps, ctx.generator)
        temperature, epsilon, form = self.temperature, self.epsilon, self.kl_form  # values, not the strategy

        @vmappable  # pure: batched clients, CUDA graphs
        def distill(module, batch, i):
            x, rows = batch
            return client_distillation_loss(module(x), y_public[rows], teacher[rows], epsilon, temperature, form)

        metrics = {f"{role}/distill_loss": ctx.fit(role, step_fn=distill, batches=batches)["loss"]}
        return self.keep_own(task, ctx, {}, metrics)

    def server_loss(self, s: Tensor, y: Tensor, rows: Tensor, fused: Tensor, any_correct: Tensor) -> Tensor:
        """The selective loss on a batch: server logits ``s``, labels, pool rows and the fused teachers.

        Also keeps the logits of the examples the server gets right in the pool.
        """
        right = s.argmax(1) == y
        state = self.state
        pool_logits, pool_known = state.pool_logits.to(s.device), state.pool_known.to(s.device)
        in_pool = pool_known[rows]
        teacher = torch.where(in_pool[:, None], pool_logits[rows], fused)
        has_teacher = ~right & (in_pool | any_correct)
        ce = F.cross_entropy(s, y, reduction="none")
        kl = kl_rows(s, teacher, self.kl_form)
        mixed = self.epsilon * ce + (1 - self.epsilon) * kl
        loss = torch.where(has_teacher, mixed, ce).mean()
        state.pool_logits[rows[right].cpu()] = s[right].detach().float().cpu()
        state.pool_known[rows[right].cpu()] = True
        return loss

    def train_server(self, x: Tensor, y: Tensor, rows: Tensor, fused: Tensor, any_correct: Tensor) -> float:
        optimizer = server_optimizer(self.server_optimizer, self.server_lr)
        self.state.server_weights, loss = self.server.train_on_rows(
            self.server_role,
            self.state.server_weights,
            x,
            lambda s, at: self.server_loss(s, y[at], rows[at], fused[at], any_correct[at]),
            optimizer,
            self.batch_size,
            self.server_steps,
        )
        return loss

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        """The clients' own models (``personal/``) and the server model on the global test set."""
        server_model = {self.server_role: self.state.server_weights}
        return {**super().evaluate(evaluator), **global_metrics(evaluator, server_model)}

    @property
    def monitor(self) -> str:
        return f"{self.server_role}/test_acc"
