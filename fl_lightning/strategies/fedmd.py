"""FedMD: Li and Wang, "FedMD: Heterogenous Federated Learning via Model Distillation", NeurIPS-W 2019
(Algorithm 1). The paper was not at hand: the steps follow the official code diogenes0319/FedMD_clean
(``FedMD.py``, ``Neural_Networks.py``, ``conf/``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import NonNegativeInt, Positive, PositiveInt
from ..federation.errors import ConfigError
from ..federation.padding import padded_loss
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, TensorPayload
from ..knowledge.distillation import kl_to_targets
from ..knowledge.public_set import (
    eval_logits,
    mean_upload,
    public_inputs,
    received_positions,
    round_subset,
    subset_downlink,
    target_batches,
)
from .base import PersonalModels, ServerContext, Split, Strategy


class FedMD(PersonalModels, Strategy):
    """Heterogeneous personal models that learn from a labeled public set and a consensus on it.

    Every client keeps its own model. Phases (Algorithm 1):

    * ``transfer`` (round 1, every client): ``public_epochs`` of cross-entropy on the labeled public set,
      then ``private_epochs`` on the private data;
    * ``communicate``: each sampled client uploads its eval-mode logits on the round's public subset
      (``n x C`` numbers); the server averages them into the consensus ``1/m sum_k f_k(x)`` and sends it
      back to the same clients (``n x C`` numbers);
    * ``digest``: each client trains towards the consensus for ``digest_steps`` with ``digest_loss``
      (:func:`digest_step`), then revisits its private data with cross-entropy for ``revisit_steps``.

    The public set is the server's labeled split (``data.server_fraction``; an out-of-domain server set
    has no labels and is refused), held by every client. ``public_size: n`` draws n of its examples per
    round and sends their positions (``n`` int32 down). Digest and revisit share the client's optimizer
    from the recipe. Where this follows the official code: ``docs/algorithms.md``, FedMD.

    Args:
        public_size: public examples per round (``None``: the whole public set).
        public_epochs: transfer-learning epochs on the labeled public set.
        private_epochs: transfer-learning epochs on the private data afterwards.
        digest_loss: ``l1`` (the code's mean absolute error on logits), ``mse`` or ``kl``
            (``T^2 KL(softmax(c / T) || softmax(z / T))``).
        temperature: T of ``digest_loss: kl``.
        digest_steps: digest steps per round (``None``: one pass over the round's public subset).
        digest_batch_size: examples per digest step (``None``: the training batch size).
        revisit_steps: private steps per round (``None``: the recipe's local steps or epochs).
        split: where personal models are evaluated (``global`` test set or the local ``test`` split).
    """

    phases = ("transfer", "communicate", "digest")

    # within a round only, never checkpointed: the clients that uploaded and the consensus they get back
    uploaders: list[ClientSpec]
    consensus: Tensor | None

    def __init__(
        self,
        public_size: int | None = 5000,
        public_epochs: NonNegativeInt = 20,
        private_epochs: NonNegativeInt = 25,
        digest_loss: Literal["l1", "mse", "kl"] = "l1",
        temperature: Positive = 1.0,
        digest_steps: NonNegativeInt | None = None,
        digest_batch_size: PositiveInt | None = None,
        revisit_steps: NonNegativeInt | None = None,
        split: Split = "global",
    ):
        self.public_size, self.public_epochs, self.private_epochs = public_size, public_epochs, private_epochs
        self.digest_loss, self.temperature, self.split = digest_loss, temperature, split
        self.digest_steps, self.digest_batch_size, self.revisit_steps = digest_steps, digest_batch_size, revisit_steps

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        num_public = len(server.server_labeled()[1])
        if self.public_size is not None and not 1 <= self.public_size <= num_public:
            raise ConfigError(
                f"FedMD public_size {self.public_size} must be between 1 and the public set's {num_public} "
                "examples (data.server_fraction); lower it, or set null for the whole set."
            )
        self.num_public = num_public
        self.uploaders, self.consensus = [], None  # within a round only: never checkpointed

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec], phase: str = "communicate") -> list[ClientTask]:
        if phase == "transfer":  # before the first collaboration round, every client
            return [ClientTask(c, rnd, {}, phase) for c in self.server.clients] if rnd == 1 else []
        if phase == "communicate":
            positions = round_subset(self.server.seed, rnd, self.num_public, self.public_size)
            down = subset_downlink("public_positions", positions)
            return [ClientTask(c, rnd, dict(down), phase) for c in clients]
        if not self.uploaders or self.consensus is None:  # set together, by aggregate
            return []
        consensus = TensorPayload("consensus", {"logits": self.consensus})
        return [ClientTask(c, rnd, {"consensus": consensus}, phase) for c in self.uploaders]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        uplink, metrics = {}, {}
        if task.phase == "transfer":
            public_steps = self.public_epochs * ctx.epoch_steps(len(ctx.public_indices))
            private_steps = self.private_epochs * ctx.epoch_steps(ctx.num_examples())
            metrics[f"{role}/transfer_public_loss"] = ctx.fit(role, "public", steps=public_steps)["loss"]
            metrics[f"{role}/transfer_private_loss"] = ctx.fit(role, steps=private_steps)["loss"]
        elif task.phase == "communicate":
            positions = received_positions(task.downlink, "public_positions")
            x_public = public_inputs(ctx.data_x, ctx.public_indices, positions)
            if positions is not None:
                ctx.state["public_positions"] = positions  # the client remembers its subset until the digest
            logits = eval_logits(module, x_public, ctx.eval_batch_size)
            uplink["public_logits"] = TensorPayload("public_logits", {"logits": logits})
        else:
            x_public = public_inputs(ctx.data_x, ctx.public_indices, ctx.state.pop("public_positions", None))
            targets = task.received("consensus", TensorPayload).tensors["logits"].to(x_public.device)
            batch_size = self.digest_batch_size or ctx.batch_size
            batches = target_batches(x_public, targets, batch_size, self.digest_steps, ctx.generator)
            step = digest_step(self.digest_loss, self.temperature)
            metrics[f"{role}/digest_loss"] = ctx.fit(role, step_fn=step, batches=batches)["loss"]
            metrics[f"{role}/loss"] = ctx.fit(role, steps=self.revisit_steps)["loss"]  # revisit
        ctx.state["weights"] = ctx.weights(role)
        return ClientUpdate(task.client, ctx.num_examples(), uplink, metrics)

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "communicate") -> dict[str, float]:
        if phase != "communicate":
            for _ in updates:  # transfer learning and digest / revisit stay on the clients
                pass
            return {}
        self.consensus, self.uploaders = mean_upload(updates, "public_logits", "logits")
        return {}


def digest_step(loss: str, temperature: float):
    """The digest step: the public batch's logits towards the consensus in the batch. Pure, and closing over
    two values only (not the strategy, whose server state changes each round): batched clients, CUDA graphs."""

    @vmappable
    def step(module, batch, i):
        x, consensus = batch
        z = module(x)
        if loss == "l1":  # mean over batch x classes, as Keras' mean_absolute_error (a padded batch: its real rows)
            return padded_loss(F.l1_loss, z, consensus)
        if loss == "mse":
            return padded_loss(F.mse_loss, z, consensus)
        return kl_to_targets(z, F.softmax(consensus / temperature, dim=1), temperature)

    return step
