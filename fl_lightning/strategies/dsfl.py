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
    public_inputs,
    received_positions,
    round_subset,
    subset_downlink,
    target_batches,
)
from .base import PersonalModels, ServerContext, Split, Strategy


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

    The open set is the server's public set (``data.server_fraction``), held by every client, its labels
    never read. ``open_size: n`` draws n of its examples per round and sends their positions (``n`` int32
    down). No server model is trained. How the temperature and upload options map to AIJack's versions and
    to paper 001's tables: ``docs/algorithms.md``, DS-FL.

    Args:
        open_size: open-set examples per round (``None``: all of them).
        aggregation: ``era`` (entropy reduction) or ``sa`` (simple average of the probabilities).
        era_temperature: T of ERA.
        distill_steps: distillation steps per round (``None``: one pass over the open batch).
        distill_batch_size: examples per distillation step (``None``: the training batch size).
        upload: what clients send, ``probs`` (softmax outputs, the paper) or ``logits`` (early AIJack).
        split: where personal models are evaluated (``global`` test set or the local ``test`` split).
    """

    name = "DS-FL"
    phases = ("train", "distill")

    # within a round only, never checkpointed: the clients that uploaded and the soft labels they get back
    uploaders: list[ClientSpec]
    global_probs: Tensor | None

    def __init__(
        self,
        open_size: int | None = None,
        aggregation: Literal["era", "sa"] = "era",
        era_temperature: Positive = 0.1,
        distill_steps: NonNegativeInt | None = None,
        distill_batch_size: PositiveInt | None = None,
        upload: Literal["probs", "logits"] = "probs",
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
        num_public = len(server.server_inputs())
        if self.open_size is not None and not 1 <= self.open_size <= num_public:
            raise ConfigError(
                f"DS-FL open_size {self.open_size} must be between 1 and the open set's {num_public} examples "
                "(data.server_fraction); lower it, or set null for the whole set."
            )
        self.num_public = num_public
        self.uploaders, self.global_probs = [], None  # within a round only: never checkpointed

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec], phase: str = "train") -> list[ClientTask]:
        if phase == "train":
            positions = round_subset(self.server.seed, rnd, self.num_public, self.open_size)
            down = subset_downlink("open_positions", positions)
            return [ClientTask(c, rnd, dict(down), phase) for c in clients]
        if not self.uploaders or self.global_probs is None:  # set together, by aggregate
            return []
        soft_labels = TensorPayload("global_soft_labels", {"probs": self.global_probs})
        return [ClientTask(c, rnd, {"global_soft_labels": soft_labels}, phase) for c in self.uploaders]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        if task.phase == "train":
            loss = ctx.fit(role)["loss"]
            positions = received_positions(task.downlink, "open_positions")
            x_open = public_inputs(ctx.data_x, ctx.public_indices, positions)
            outputs = eval_logits(module, x_open, ctx.eval_batch_size)
            if self.upload == "probs":
                outputs = F.softmax(outputs, dim=1)
            if positions is not None:
                ctx.state["open_positions"] = positions  # the client remembers its batch until the distill phase
            uplink = {"open_outputs": TensorPayload("open_outputs", {"outputs": outputs})}
            metrics = {f"{role}/loss": loss}
        else:
            x_open = public_inputs(ctx.data_x, ctx.public_indices, ctx.state.pop("open_positions", None))
            targets = task.received("global_soft_labels", TensorPayload).tensors["probs"].to(x_open.device)
            batch_size = self.distill_batch_size or ctx.batch_size
            batches = target_batches(x_open, targets, batch_size, self.distill_steps, ctx.generator)
            loss = ctx.fit(role, step_fn=self.distillation_step, batches=batches)["loss"]
            uplink, metrics = {}, {f"{role}/distill_loss": loss}
        ctx.state["weights"] = ctx.weights(role)
        return ClientUpdate(task.client, ctx.num_examples(), uplink, metrics)

    @staticmethod
    @vmappable  # pure: its targets come in the batch (batched clients, CUDA graphs)
    def distillation_step(module, batch, i):
        x, targets = batch
        return kl_to_targets(module(x), targets)

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "train") -> dict[str, float]:
        if phase == "distill":
            for _ in updates:  # the clients distilled locally; nothing comes back
                pass
            return {}
        mean, self.uploaders = mean_upload(updates, "open_outputs", "outputs")
        if mean is None:
            self.global_probs = None
            return {}
        self.global_probs = entropy_reduction(mean, self.era_temperature) if self.aggregation == "era" else mean
        entropy = -(self.global_probs * self.global_probs.clamp_min(1e-12).log()).sum(1).mean()
        return {"server/soft_label_entropy": float(entropy)}
