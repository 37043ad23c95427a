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
from ..federation.padding import padded_loss
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, TensorPayload
from ..knowledge.distillation import kl_to_targets
from ..knowledge.public_set import (
    eval_logits,
    mean_upload,
    target_batches,
)
from .base import PersonalModels, Phase, ServerContext, Split, Strategy


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
        self.exchange = server.public_exchange(self.public_size, "public_size", "public", labeled=True)
        self.uploaders, self.consensus = [], None  # within a round only: never checkpointed

    def phases(self) -> tuple[Phase, ...]:
        return (
            Phase("transfer", self.configure_transfer, self.transfer),
            Phase("communicate", self.configure_communicate, self.communicate, self.aggregate_consensus),
            Phase("digest", self.configure_digest, self.digest),
        )

    # ------------------------------------------------------------------ transfer learning (round 1)
    def configure_transfer(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        """Before the first collaboration round, every client; later rounds have no transfer tasks."""
        return [ClientTask(c, rnd) for c in self.server.clients] if rnd == 1 else []

    def transfer(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = self.load_own(task, ctx)[0]
        public_steps = self.public_epochs * ctx.epoch_steps(len(ctx.public_indices))
        private_steps = self.private_epochs * ctx.epoch_steps(ctx.num_examples())
        metrics = {f"{role}/transfer_public_loss": ctx.fit(role, "public", steps=public_steps)["loss"]}
        metrics[f"{role}/transfer_private_loss"] = ctx.fit(role, steps=private_steps)["loss"]
        return self.keep_own(task, ctx, {}, metrics)

    # ------------------------------------------------------------------ communicate: logits up, consensus
    def configure_communicate(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        return self.exchange.tasks(rnd, clients)

    def communicate(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role, module = self.load_own(task, ctx)
        x_public = self.exchange.received(task, ctx)[0]  # its positions remembered until the digest
        logits = eval_logits(module, x_public, ctx.eval_batch_size)
        return self.keep_own(task, ctx, {"public_logits": TensorPayload("public_logits", {"logits": logits})}, {})

    def aggregate_consensus(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        self.consensus, self.uploaders = mean_upload(updates, "public_logits", "logits")
        return {}

    # ------------------------------------------------------------------ digest and revisit, on the clients
    def configure_digest(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        consensus = None if self.consensus is None else {"logits": self.consensus}
        return self.exchange.reply(rnd, self.uploaders, "consensus", consensus)

    def digest(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = self.load_own(task, ctx)[0]
        x_public = self.exchange.recalled(ctx)[0]
        targets = task.received("consensus", TensorPayload).tensors["logits"].to(x_public.device)
        batch_size = self.digest_batch_size or ctx.batch_size
        batches = target_batches(x_public, targets, batch_size, self.digest_steps, ctx.generator)
        step = digest_step(self.digest_loss, self.temperature)
        metrics = {f"{role}/digest_loss": ctx.fit(role, step_fn=step, batches=batches)["loss"]}
        metrics[f"{role}/loss"] = ctx.fit(role, steps=self.revisit_steps)["loss"]  # revisit
        return self.keep_own(task, ctx, {}, metrics)


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
