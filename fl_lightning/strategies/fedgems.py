"""FedGEMS: Cheng et al., "FedGEMS: Federated Learning of Larger Server Models via Selective Knowledge Fusion",
arXiv:2110.11027, 2021 (Sec. 3.3-3.4, eq. 1-6, Algorithm 1). The losses follow the paper's equations; the
round's order follows AIJack's implementation (``aijack/collaborative/fedgems``: server, client and API),
whose KL form is an option (``kl_form: aijack``), and paper 001's set-up (Appendix 6.3, Table 13)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.steps import vmappable
from ..federation.errors import ConfigError
from ..federation.padding import padded_loss, real_labels
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, TensorPayload
from ..knowledge.public_set import eval_logits, public_inputs, round_subset, target_batches
from ..knowledge.server_optim import SERVER_OPTIMIZERS, server_optimizer
from .base import PersonalModels, ServerContext, Strategy


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


KL_FORMS = ("paper", "aijack")


def kl_rows(student_logits: Tensor, teacher_logits: Tensor, form: str = "paper") -> Tensor:
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
    z: Tensor, y: Tensor, server_logits: Tensor, epsilon: float, temperature: float = 1.0, form: str = "paper"
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


class FedGEMS(PersonalModels, Strategy):
    """A large server model trained by selective knowledge fusion on a labeled public set.

    Every client keeps its own (small or large) model. A round (AIJack's ``FedGEMSAPI.run``):

    * ``train``: each sampled client trains on its private data with cross-entropy (the recipe's local
      steps), then uploads its eval-mode logits on the round's public examples, ``n x C`` numbers;
    * the server trains its own model (``server_role``, a role no tier lists) for ``server_steps`` on
      those examples. Per example i with server logits ``s_i``: if the server is right, plain
      ``CE(s_i, y_i)`` (eq. 1) and ``s_i`` is kept in its logit pool (self-knowledge); if it is wrong,
      ``eps CE(s_i, y_i) + (1 - eps) KL(softmax(t_i) || softmax(s_i))`` where the teacher ``t_i`` is the
      pool's entry when it has one (self-distillation, eq. 2), else the selective fusion of the clients
      that predict i correctly (:func:`selective_fusion`, eq. 3-5); if none does, plain CE. The loss is the
      mean over the batch (AIJack sums the means of the three groups). It then sends its eval-mode logits
      on the examples back, ``n x C`` numbers;
    * ``distill``: the same clients train on the public examples with
      ``eps CE(z, y) + (1 - eps) T^2 KL(softmax(s / T) || softmax(z / T))``
      (:func:`client_distillation_loss`, eq. 6).

    ``epsilon`` weighs the cross-entropy and ``1 - epsilon`` the KL, as the paper's equations 2 and 5 write
    it (its text calls epsilon "a hyper-parameter to control the weight of knowledge distillation in all
    the following formulations", the clients' eq. 6 included, and finds 0.75 best), and as AIJack's server
    and client; paper 001 (Appendix 6.3) repeats the text's words ("determines how much KL contributes")
    and sets 0.75, "as the original authors presented", the value used here (``epsilon: 0.25`` puts 0.75
    on the KL instead). The KL runs from the teacher to the student per example (the paper's
    ``D_KL(l_teacher || l_s)``, ``kl_form: paper``); AIJack computes ``KL(student || teacher)`` divided by
    B x C (``kl_form: aijack``, server and clients). AIJack's fusion takes a softmax over every client
    with score 0 for the wrong ones, which leaves them a weight of ``exp(0)``; here they are masked, as
    the paper describes (eq. 4).

    The public set is the server's labeled split (``data.server_fraction``), held by every client;
    ``public_size: n`` draws n of its examples per round and sends their positions (n int32 down).
    The server model is evaluated on the global test set (``<server_role>/test_acc``, the monitor) and
    the clients' own models as ``personal/``.

    Args:
        server_role: the server model's role in ``models`` (no tier may list it).
        epsilon: weight of the cross-entropy; ``1 - epsilon`` weighs the distillation.
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

    phases = ("train", "distill")
    state_attributes = ("server_weights", "pool_logits", "pool_known")

    def __init__(
        self,
        server_role: str = "server",
        epsilon: float = 0.75,
        temperature: float = 1.0,
        public_size: int | None = None,
        server_steps: int | None = None,
        distill_steps: int | None = None,
        server_lr: float = 0.003,
        server_optimizer: str = "adam",
        batch_size: int = 32,
        split: str = "global",
        kl_form: str = "paper",
    ):
        if kl_form not in KL_FORMS:
            raise ConfigError(f"FedGEMS kl_form must be paper or aijack, got {kl_form!r}.")
        if not 0.0 <= epsilon <= 1.0 or temperature <= 0 or server_lr <= 0:
            raise ConfigError(
                f"FedGEMS needs 0 <= epsilon <= 1, temperature > 0 and server_lr > 0; got epsilon={epsilon}, "
                f"temperature={temperature}, server_lr={server_lr}."
            )
        if server_optimizer not in SERVER_OPTIMIZERS:
            raise ConfigError(f"FedGEMS server_optimizer must be adam or sgd, got {server_optimizer!r}.")
        if min(server_steps or 0, distill_steps or 0) < 0 or batch_size < 1:
            raise ConfigError("FedGEMS server_steps and distill_steps must be >= 0 and batch_size >= 1.")
        self.server_role, self.epsilon, self.temperature = server_role, epsilon, temperature
        self.public_size, self.server_steps, self.distill_steps = public_size, server_steps, distill_steps
        self.server_lr, self.server_optimizer, self.batch_size, self.split = (
            server_lr,
            server_optimizer,
            batch_size,
            split,
        )
        self.kl_form = kl_form

    def server_roles(self) -> tuple[str, ...]:
        return (self.server_role,)

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client("FedGEMS")
        server.require_server_only_role("FedGEMS", self.server_role)
        self.public_x, self.public_y = server.server_labeled("FedGEMS")
        num_public = len(self.public_y)
        if self.public_size is not None and not 1 <= self.public_size <= num_public:
            raise ConfigError(
                f"FedGEMS public_size {self.public_size} must be between 1 and the public set's {num_public} "
                "examples (data.server_fraction); lower it, or set null for the whole set."
            )
        self.num_public = num_public
        self.server_weights = server.initial_weights(self.server_role)
        # the logit pool: the server's own logits on the public examples it last predicted correctly
        self.pool_logits = torch.zeros(num_public, server.data.num_classes)
        self.pool_known = torch.zeros(num_public, dtype=torch.bool)
        self.uploaders, self.positions, self.server_logits = [], None, None  # within a round only

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec], phase: str = "train") -> list[ClientTask]:
        if phase == "train":
            self.positions = round_subset(self.server.seed, rnd, self.num_public, self.public_size)
            down = (
                {}
                if self.positions is None
                else {"public_positions": TensorPayload("public_positions", {"positions": self.positions})}
            )
            return [ClientTask(c, rnd, dict(down), phase) for c in clients]
        if not self.uploaders:
            return []
        logits = TensorPayload("server_logits", {"logits": self.server_logits})
        return [ClientTask(c, rnd, {"server_logits": logits}, phase) for c in self.uploaders]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        uplink, metrics = {}, {}
        if task.phase == "train":
            positions = task.downlink["public_positions"].tensors["positions"] if task.downlink else None
            if positions is not None:
                ctx.state["public_positions"] = positions  # remembered until the distillation
            metrics[f"{role}/loss"] = ctx.fit(role)["loss"]
            x_public = public_inputs(ctx.data_x, ctx.public_indices, positions)
            logits = eval_logits(module, x_public, ctx.loop.training.eval_batch_size)
            uplink["public_logits"] = TensorPayload("public_logits", {"logits": logits})
        else:
            positions = ctx.state.pop("public_positions", None)
            x_public = public_inputs(ctx.data_x, ctx.public_indices, positions)
            chosen = ctx.public_indices if positions is None else ctx.public_indices[positions.long()]
            # server knowledge and public labels at one address per name (CUDA graphs keep their key)
            y_public = ctx.on_device("public_labels", ctx.data_y[chosen])
            server_logits = task.downlink["server_logits"].tensors["logits"].to(x_public.device)
            teacher = ctx.on_device("teacher", server_logits)
            order = torch.arange(len(x_public), device=x_public.device)
            batches = target_batches(x_public, order, self.batch_size, self.distill_steps, ctx.generator)
            temperature, epsilon, form = self.temperature, self.epsilon, self.kl_form  # values, not the strategy

            @vmappable  # pure: batched clients, CUDA graphs
            def distill(module, batch, i):
                x, rows = batch
                return client_distillation_loss(module(x), y_public[rows], teacher[rows], epsilon, temperature, form)

            metrics[f"{role}/distill_loss"] = ctx.fit(role, step_fn=distill, batches=batches)["loss"]
        ctx.state["weights"] = ctx.weights(role)
        return ClientUpdate(task.client, ctx.num_examples(), uplink, metrics)

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "train") -> dict[str, float]:
        if phase != "train":
            for _ in updates:  # the distillation stays on the clients
                pass
            return {}
        received, self.uploaders = [], []
        for update in updates:
            received.append(update.uplink["public_logits"].tensors["logits"].detach())
            self.uploaders.append(update.client)
        if not received:
            return {}
        rows = torch.arange(self.num_public) if self.positions is None else self.positions.long()
        device = self.public_x.device
        rows = rows.to(device)
        x, y = self.public_x[rows], self.public_y[rows]
        fused, any_correct = selective_fusion(torch.stack([r.to(device) for r in received]), y)
        loss = self.train_server(x, y, rows, fused, any_correct)
        self.server_logits = self.server.predict(self.server_role, self.server_weights, x).float()
        return {"server/loss": loss, "server/clients_right": float(any_correct.float().mean())}

    def server_loss(self, s: Tensor, y: Tensor, rows: Tensor, fused: Tensor, any_correct: Tensor) -> Tensor:
        """The selective loss on a batch: server logits ``s``, labels, pool rows and the fused teachers.

        Also keeps the logits of the examples the server gets right in the pool.
        """
        right = s.argmax(1) == y
        pool_logits, pool_known = self.pool_logits.to(s.device), self.pool_known.to(s.device)
        in_pool = pool_known[rows]
        teacher = torch.where(in_pool[:, None], pool_logits[rows], fused)
        has_teacher = ~right & (in_pool | any_correct)
        ce = F.cross_entropy(s, y, reduction="none")
        kl = kl_rows(s, teacher, self.kl_form)
        mixed = self.epsilon * ce + (1 - self.epsilon) * kl
        loss = torch.where(has_teacher, mixed, ce).mean()
        self.pool_logits[rows[right].cpu()] = s[right].detach().float().cpu()
        self.pool_known[rows[right].cpu()] = True
        return loss

    def train_server(self, x: Tensor, y: Tensor, rows: Tensor, fused: Tensor, any_correct: Tensor) -> float:
        # drawn from the round's server stream: the batch order depends on the seed and round only
        generator = torch.Generator().manual_seed(int(torch.randint(2**62, ())))
        positions = torch.arange(len(x), device=x.device)
        batches = target_batches(x, positions, self.batch_size, self.server_steps, generator)

        def step(module, batch, i):
            xb, at = batch
            loss = self.server_loss(module(xb), y[at], rows[at], fused[at], any_correct[at])
            return loss

        optimizer = server_optimizer(self.server_optimizer, self.server_lr)
        self.server_weights, loss = self.server.train(
            self.server_role, self.server_weights, batches, step, optimizer, return_loss=True
        )
        return loss

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        metrics = evaluator.personalized(self.personal_weights, split=self.split)
        for name, value in evaluator.global_model(self.server_role, self.server_weights).items():
            metrics[f"{self.server_role}/test_{name}"] = value
        return metrics

    @property
    def monitor(self) -> str:
        return f"{self.server_role}/test_acc"
