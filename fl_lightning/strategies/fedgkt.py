"""FedGKT: He et al., "Group Knowledge Transfer: Federated Learning of Large CNNs at the Edge", NeurIPS 2020
(Algorithm 1, eq. 4-7). The paper was not at hand: the details follow FedML's ``fedgkt`` code (T = 3,
alpha = 1, server distillation on) and paper 003's set-up (Section 4)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..client.steps import vmappable
from ..federation.bounds import NonNegative, NonNegativeInt, Positive, PositiveInt
from ..federation.errors import ConfigError
from ..federation.padding import real_labels
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, StateDict, TensorPayload
from ..knowledge.distillation import kd_kl_loss
from ..knowledge.public_set import target_batches
from ..knowledge.server_optim import ServerOptimizer, server_optimizer
from ..models.base import FeatureClassifier, SplitFeatureClassifier  # not models.fedgkt: it imports torchvision
from .base import PersonalModels, ServerContext, Split, Strategy


def bidirectional_losses(
    z_client: Tensor, z_server: Tensor, y: Tensor, alpha: float, temperature: float
) -> tuple[Tensor, Tensor]:
    """FedGKT's two losses on the same examples: the client's ``CE(z_c, y) + alpha KD(z_c, z_s)`` (eq. 5)
    and the server's ``CE(z_s, y) + alpha KD(z_s, z_c)`` (eq. 7); KD is ``T^2 KL`` at temperature T and
    the teacher side gets no gradient."""
    client = F.cross_entropy(z_client, y) + alpha * kd_kl_loss(z_client, z_server, temperature)
    server = F.cross_entropy(z_server, y) + alpha * kd_kl_loss(z_server, z_client, temperature)
    return client, server


def split_point(model: FeatureClassifier) -> tuple[Callable[[Tensor], Tensor], Callable[[Tensor], Tensor]]:
    """A client model cut where FedGKT cuts it: ``(extract, classify)``. A
    :class:`~fl_lightning.models.base.SplitFeatureClassifier` (FedGKT's ResNet-8) is cut at its split point
    and sends feature maps; any other model after its feature extractor, and sends feature vectors."""
    if isinstance(model, SplitFeatureClassifier):
        return model.extract, model.classify
    return model.features, model.head


@dataclass
class FedGKTState:
    """What FedGKT's server carries from round to round."""

    server_weights: StateDict  # the server's own model
    server_logits: dict[int, Tensor]  # per client, [N_k, C] on its training examples in order, sent next round


class FedGKT(PersonalModels, Strategy):
    """Group knowledge transfer: small client models and a large server model on their features.

    Client k keeps its own small model. Each round (Algorithm 1):

    * the client trains on its private data with ``CE(z_c, y) + alpha KD(z_c, z_s)`` (eq. 5), ``z_s`` the
      server's logits on the same example from the client's previous round (plain CE before it has any);
      then it uploads, for every training example in a fixed order, its features ``H`` at the model's
      :func:`split_point`, its logits and its label (eval mode): ``N_k (|H| + C + 1)`` numbers;
    * the server trains its model (``server_role``, a role no tier lists, whose input is the clients'
      features) for ``server_epochs`` passes over all received features with ``CE(z_s, y) + alpha KD(z_s,
      z_c)`` (eq. 7), then computes ``z_s`` on each client's features, in the client's order, and sends
      them at the client's next round: ``N_k C`` numbers.

    Inference needs both sides: ``server/`` metrics (the monitor) are the server model on each client's
    features of the global test set, averaged over the clients; ``personal/`` are the clients' own models.
    The settings FedML's code and paper 003 use: ``docs/algorithms.md``, FedGKT.

    Args:
        server_role: the server model's role in ``models`` (no tier may list it; it takes the clients' features).
        alpha: weight of the distillation on both sides (1 in FedML).
        temperature: T of the distillation (3 in FedML).
        server_epochs: server passes over the round's features.
        server_lr: learning rate of the server's optimizer (a fresh one each round).
        server_optimizer: ``adam`` or ``sgd`` (momentum 0.9).
        batch_size: features per server step.
        split: where the clients' own models are evaluated (``global`` or their local ``test`` split).
    """

    needs_split = True  # reads the models' features and head apart

    state: FedGKTState

    def __init__(
        self,
        server_role: str = "server",
        alpha: NonNegative = 1.0,
        temperature: Positive = 3.0,
        server_epochs: NonNegativeInt = 1,
        server_lr: Positive = 0.003,
        server_optimizer: ServerOptimizer = "adam",
        batch_size: PositiveInt = 32,
        split: Split = "global",
    ):
        self.server_role, self.alpha, self.temperature = server_role, alpha, temperature
        self.server_epochs, self.server_lr, self.server_optimizer = server_epochs, server_lr, server_optimizer
        self.batch_size, self.split = batch_size, split

    def server_roles(self) -> tuple[str, ...]:
        return (self.server_role,)

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        server.require_server_only_role(self.server_role)
        self.state = FedGKTState(server.initial_weights(self.server_role), {})
        for role in sorted({c.roles[0] for c in server.clients}):
            probe = self.client_features(role, server.initial_weights(role), server.data.x[:2])
            try:
                server.predict(self.server_role, self.state.server_weights, probe)
            except RuntimeError:
                shape = tuple(probe.shape[1:])
                example = (
                    f"digits_mlp with args {{in_features: {shape[0]}}}"
                    if len(shape) == 1
                    else (f"fedgkt_server_resnet with args {{feature_channels: {shape[0]}}}")
                )
                raise ConfigError(
                    f"FedGKT's server model {self.server_role!r} must take the clients' features, but it does not "
                    f"accept role {role!r}'s features of shape {shape}; build it for them, e.g. builder {example}."
                ) from None

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        tasks = []
        for c in clients:
            logits = self.state.server_logits.get(c.id)
            down = {} if logits is None else {"server_logits": TensorPayload("server_logits", {"logits": logits})}
            tasks.append(ClientTask(c, rnd, down))
        return tasks

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        idx = ctx.indices.train
        x, y = ctx.data_x[idx], ctx.data_y[idx]
        # what the step indexes, at one address per name and shape (CUDA graphs keep their key)
        labels = ctx.on_device("labels", y)
        teacher = None
        if "server_logits" in task.downlink:
            teacher = ctx.on_device("teacher", task.received("server_logits", TensorPayload).tensors["logits"])
        order = torch.arange(len(idx), device=x.device)
        batches = target_batches(x, order, ctx.batch_size, ctx.local_steps(len(idx)), ctx.generator)
        alpha, temperature = self.alpha, self.temperature  # values, not the strategy, in the closure

        @vmappable  # pure: batched clients, CUDA graphs
        def step(module, batch, i):
            xb, at = batch
            z = module(xb)
            y = real_labels(labels[at])  # PAD in a padded batch's padded rows (batched clients in lockstep)
            if teacher is None:
                return F.cross_entropy(z, y)
            return F.cross_entropy(z, y) + alpha * kd_kl_loss(z, teacher[at], temperature)

        loss = ctx.fit(role, step_fn=step, batches=batches)["loss"]
        ctx.state["weights"] = ctx.weights(role)
        module.eval()
        extract, classify = split_point(module.model)
        with torch.no_grad():
            size = ctx.eval_batch_size
            features = torch.cat([extract(x[i : i + size]).float() for i in range(0, len(x), size)])
            logits = torch.cat([classify(features[i : i + size]).float() for i in range(0, len(x), size)])
        upload = TensorPayload("features", {"features": features, "logits": logits, "labels": y.to(torch.int32)})
        return ClientUpdate(task.client, len(idx), {"features": upload}, {f"{role}/loss": loss})

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        received: dict[int, dict[str, Tensor]] = {}
        for update in updates:
            received[update.client.id] = {
                k: v.detach() for k, v in update.sent("features", TensorPayload).tensors.items()
            }
        if not received:
            return {}
        h = torch.cat([r["features"] for r in received.values()])
        z_client = torch.cat([r["logits"] for r in received.values()])
        y = torch.cat([r["labels"] for r in received.values()]).long()
        loss = self.train_server(h, z_client, y)
        state = self.state
        for cid, r in received.items():
            state.server_logits[cid] = self.server.predict(
                self.server_role, state.server_weights, r["features"]
            ).float()
        return {"server/loss": loss}

    def train_server(self, h: Tensor, z_client: Tensor, y: Tensor) -> float:
        steps = self.server_epochs * -(-len(h) // self.batch_size)
        alpha, temperature = self.alpha, self.temperature
        optimizer = server_optimizer(self.server_optimizer, self.server_lr)
        self.state.server_weights, loss = self.server.train_on_rows(
            self.server_role,
            self.state.server_weights,
            h,
            lambda s, at: bidirectional_losses(z_client[at], s, y[at], alpha, temperature)[1],
            optimizer,
            self.batch_size,
            steps,
        )
        return loss

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        metrics = evaluator.personalized(self.personal_weights, split=self.split)
        data = self.server.data
        accs, losses = [], []
        for client in self.server.clients:
            role, weights = self.personal_weights(client, evaluator.client_states.get(client.id, {}))
            features = self.client_features(role, weights, data.test_x)
            logits = self.server.predict(self.server_role, self.state.server_weights, features).float()
            accs.append(float((logits.argmax(1) == data.test_y).float().mean()))
            losses.append(float(F.cross_entropy(logits, data.test_y)))
        metrics["server/test_acc"] = sum(accs) / len(accs)
        metrics["server/test_loss"] = sum(losses) / len(losses)
        return metrics

    @torch.no_grad()
    def client_features(self, role: str, weights: StateDict, x: Tensor, batch_size: int = 512) -> Tensor:
        """What a client with ``weights`` would send for ``x`` (eval mode): feature maps at the split point
        of a split model, else the server context's feature vectors."""
        model = self.server.model(role)
        if not isinstance(model, SplitFeatureClassifier):
            return self.server.features(role, weights, x, batch_size)
        model.load_state_dict(weights)
        model.eval()
        return torch.cat([model.extract(x[i : i + batch_size]) for i in range(0, len(x), batch_size)])

    @property
    def monitor(self) -> str:
        return "server/test_acc"
