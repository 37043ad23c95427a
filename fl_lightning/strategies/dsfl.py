"""DS-FL: Itahara, Nishio, Koda, Morikura, Yamamoto, "Distillation-Based Semi-Supervised Federated Learning
for Communication-Efficient Collaborative Training With Non-IID Private Data", IEEE TMC 2021 (Algorithm 1
and its entropy reduction aggregation). The paper was not at hand: the method follows AIJack's
``collaborative/dsfl`` code; the paper's details are recalled."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import NonNegativeInt, Positive, PositiveInt
from ..federation.errors import ConfigError
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, TensorPayload
from ..knowledge.distillation import kl_to_targets
from ..knowledge.public_set import (
    eval_logits,
    mean_upload,
    sum_upload,
    target_batches,
)
from .base import PersonalModels, Phase, ServerContext, Split, Strategy


def entropy_reduction(mean_outputs: Tensor, temperature: float) -> Tensor:
    """ERA: ``softmax(p_bar / T)`` of the clients' averaged outputs ``[N, C]``.

    On averaged probabilities, T < 1 sharpens the average (lower entropy) and T = 1 flattens it, since
    probabilities in [0, 1] become the logits of a softmax. On averaged logits (``upload: logits``),
    T = 1 gives the ensemble's ordinary soft labels.
    """
    return F.softmax(mean_outputs / temperature, dim=1)


class DSFL(PersonalModels, Strategy):
    """Distillation-based semi-supervised FL: personal models exchange predictions on a shared open set.

    Each round has two phases (Algorithm 1):

    * ``train``: a sampled client trains its own model on its private labeled data with cross-entropy,
      then uploads its eval-mode softmax outputs on the round's open batch (``n x C`` numbers; ``upload:
      logits`` sends the logits). The server averages them and applies ERA, :func:`entropy_reduction`
      (``aggregation: era``; ``sa`` keeps the plain average), and sends the result back (``n x C``).
    * ``distill``: the same clients train on the open batch against these soft labels,
      ``-sum_c p_c log softmax(z)_c`` (computed as the KL, same gradient), for ``distill_steps`` steps.

    ``upload: votes`` sends each open example's predicted class as a one-hot row instead (PATE's teachers'
    votes), and ``aggregation: plurality`` sends back each example's most voted class, one-hot. With a
    ``privacy`` section and ``where: server`` the server adds the Gaussian noise to the sum of the uploads (the
    vote counts) and divides by the expected number of uploads: votes, plurality and central noise together are
    PATE's GNMax (Papernot et al., ICLR 2018), each open example one noisy-argmax query.

    The open set is the server's public set (``data.server_fraction``), held by every client, its labels
    never read. ``open_size: n`` draws n of its examples per round and sends their positions (``n`` int32
    down). No server model is trained. How the temperature and upload options map to AIJack's versions and
    to paper 001's tables: ``docs/algorithms.md``, DS-FL.

    Args:
        open_size: open-set examples per round (``None``: all of them).
        aggregation: ``era`` (entropy reduction), ``sa`` (simple average of the probabilities) or ``plurality``
            (each example's class of the largest average, one-hot).
        era_temperature: T of ERA.
        distill_steps: distillation steps per round (``None``: one pass over the open batch).
        distill_batch_size: examples per distillation step (``None``: the training batch size).
        upload: what clients send, ``probs`` (softmax outputs, the paper), ``logits`` (early AIJack) or ``votes``
            (the predicted class, one-hot).
        split: where personal models are evaluated (``global`` test set or the local ``test`` split).
    """

    name = "DS-FL"
    central_privacy = True  # the soft labels are a function of the uploads' sum alone
    # within a round only, never checkpointed: the clients that uploaded and the soft labels they get back
    uploaders: list[ClientSpec]
    global_probs: Tensor | None

    def __init__(
        self,
        open_size: int | None = None,
        aggregation: Literal["era", "sa", "plurality"] = "era",
        era_temperature: Positive = 0.1,
        distill_steps: NonNegativeInt | None = None,
        distill_batch_size: PositiveInt | None = None,
        upload: Literal["probs", "logits", "votes"] = "probs",
        split: Split = "global",
    ):
        if aggregation == "sa" and upload == "logits":
            raise ConfigError("DS-FL aggregation: sa averages probabilities; with upload: logits use aggregation: era.")
        self.open_size, self.aggregation, self.era_temperature = open_size, aggregation, era_temperature
        self.distill_steps, self.distill_batch_size, self.split = distill_steps, distill_batch_size, split
        self.upload = upload

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        self.exchange = server.public_exchange(self.open_size, "open_size", "open", labeled=False)
        self.uploaders, self.global_probs = [], None  # within a round only: never checkpointed

    def phases(self) -> tuple[Phase, ...]:
        return (
            Phase("train", self.configure_train, self.train, self.aggregate_soft_labels),
            Phase("distill", self.configure_distill, self.distill),
        )

    # ------------------------------------------------------------------ train: outputs on the open batch up
    def configure_train(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        return self.exchange.tasks(rnd, clients)

    def train(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role, module = self.load_own(task, ctx)
        loss = ctx.fit(role)["loss"]
        x_open = self.exchange.received(task, ctx)[0]  # its positions remembered until the distill phase
        outputs = eval_logits(module, x_open, ctx.eval_batch_size)
        if self.upload == "probs":
            outputs = F.softmax(outputs, dim=1)
        elif self.upload == "votes":  # one vote per example, a row of norm 1
            outputs = F.one_hot(outputs.argmax(1), outputs.shape[1]).float()
        uplink = {"open_outputs": TensorPayload("open_outputs", {"outputs": outputs})}
        return self.keep_own(task, ctx, uplink, {f"{role}/loss": loss})

    def aggregate_soft_labels(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        if self.server.central_noise is None:
            mean, self.uploaders = mean_upload(updates, "open_outputs", "outputs")
        else:  # central privacy: the noised sum over the expected number of uploads
            total, self.uploaders = sum_upload(updates, "open_outputs", "outputs")
            if total is not None:
                noised, expected = self.server.private_sum({"outputs": total}, self.server.clients)
                total = (noised["outputs"] / expected).float()
            mean = total
        if mean is None:
            self.global_probs = None
            return {}
        if self.aggregation == "era":
            self.global_probs = entropy_reduction(mean, self.era_temperature)
        elif self.aggregation == "plurality":
            self.global_probs = F.one_hot(mean.argmax(1), mean.shape[1]).float()
        elif bool((mean < 0).any()):  # noised (privacy) probabilities: back onto the simplex, post-processing
            clamped = mean.clamp_min(0)
            self.global_probs = clamped / clamped.sum(1, keepdim=True).clamp_min(1e-12)
        else:
            self.global_probs = mean
        entropy = -(self.global_probs * self.global_probs.clamp_min(1e-12).log()).sum(1).mean()
        return {"server/soft_label_entropy": float(entropy)}

    # ------------------------------------------------------------------ distill: the soft labels down
    def configure_distill(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        probs = None if self.global_probs is None else {"probs": self.global_probs}
        return self.exchange.reply(rnd, self.uploaders, "global_soft_labels", probs)

    def distill(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        """The client distils locally; nothing goes back."""
        role = self.load_own(task, ctx)[0]
        x_open = self.exchange.recalled(ctx)[0]
        targets = task.received("global_soft_labels", TensorPayload).tensors["probs"].to(x_open.device)
        batch_size = self.distill_batch_size or ctx.batch_size
        batches = target_batches(x_open, targets, batch_size, self.distill_steps, ctx.generator)
        loss = ctx.fit(role, step_fn=self.distillation_step, batches=batches)["loss"]
        return self.keep_own(task, ctx, {}, {f"{role}/distill_loss": loss})

    @staticmethod
    @vmappable  # pure: its targets come in the batch (batched clients, CUDA graphs)
    def distillation_step(module, batch, i):
        x, targets = batch
        return kl_to_targets(module(x), targets)
