"""FedHe: Chan & Ngai, "FedHe: Heterogeneous Models and Communication-Efficient Federated Learning", MSN 2021."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal

import torch.nn.functional as F

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import NonNegative, NonNegativeInt, PositiveInt
from ..federation.padding import class_index
from ..federation.types import ClientSpec, ClientTask, ClientUpdate
from ..knowledge.banks import ClassBank
from ..knowledge.class_stats import ClassStatistics, ClassStatsCollector
from ..knowledge.distillation import logit_distance_rows, masked_row_mean
from .base import PersonalModels, ServerContext, Strategy


@dataclass
class FedHeState:
    """What FedHe's server carries from round to round."""

    bank: ClassBank  # every class logit received: per class, their sum and count
    last_reset_round: int = 0  # the last round whose end collapsed the bank (reset_every)


class FedHe(PersonalModels, Strategy):
    """FedHe: personalized heterogeneous models that exchange per-class average logits.

    Client (eq. 7-8): while training on its batches, client k sums the logits of each class y and counts
    them (``V_k,y``), then uploads ``p_k,y / (V_k,y + 1)`` with the label y. Server (eq. 9-10): stores
    every received class logit and answers with their per-class average ``p_s,y``. Client loss (eq. 11-13):
    ``CE(z, y) + alpha * l_logit(z, p_s,y)``, both averaged over the batch; a sample of a class the server
    has no logit for yet adds no logit loss but counts in the average. Every client keeps its own model;
    no weights are exchanged. In asynchronous mode (``schedule: AsynchronousSchedule``) each arrival is
    answered with the current class averages, as Algorithm 1's server loop. Where the options follow the
    official code: ``docs/algorithms.md``, FedHe.

    Args:
        alpha: weight of the logit loss (1 in the paper's experiments).
        plus_one: divide by ``V + 1`` as eq. 8 (paper); ``false`` divides by ``V`` as the official code.
        logit_loss: ``mse`` on logits (the code's; the paper leaves it open) or ``kl`` (KL divergence of
            softmax outputs at temperature 1).
        warmup_rounds: rounds of cross-entropy only before the logit term starts (the code waits N
            iterations); 0 uses server logits as soon as there are any.
        reset_every: every k rounds collapse the bank to its current averages weighted as one upload (the
            code's periodic reset, not in the paper), once per period after round k's last update, in
            asynchronous mode too; ``None`` never does.
        logit_average: ``batch`` averages the logit loss over the whole batch (eq. 12-13); ``available``
            over the samples whose class has a server logit only.
    """

    state: FedHeState

    def __init__(
        self,
        alpha: NonNegative = 1.0,
        plus_one: bool = True,
        logit_loss: Literal["mse", "kl"] = "mse",
        warmup_rounds: NonNegativeInt = 0,
        reset_every: PositiveInt | None = None,  # null: never
        logit_average: Literal["batch", "available"] = "batch",
    ):
        self.alpha, self.plus_one, self.logit_loss = alpha, plus_one, logit_loss
        self.warmup_rounds, self.reset_every, self.logit_average = warmup_rounds, reset_every, logit_average

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        self.num_classes = server.data.num_classes
        self.state = FedHeState(ClassBank(self.num_classes, self.num_classes))

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        # padded to C rows, so an upload is always C x (C + 1) numbers (paper Tables III-IV count the same)
        bank = self.state.bank
        payload = ClassStatistics.padded("class_logits", {"logits": bank.mean()}, bank.available)
        return [ClientTask(c, rnd, {"class_logits": payload}) for c in clients]

    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        received = task.received("class_logits", ClassStatistics)
        # the server's bank lives on the CPU; the step indexes it with labels on the device
        server_logits = ctx.on_device("server_logits", received.vectors["logits"])
        available = ctx.on_device("available", received.present)
        device = ctx.data_x.device
        use_logits = task.round > self.warmup_rounds and bool(available.any())
        collector = ClassStatsCollector(self.num_classes, {"logits": self.num_classes}, device)
        # the step closes over these values, not over the strategy and its server state (CUDA-graph keys)
        alpha, logit_loss, logit_average = self.alpha, self.logit_loss, self.logit_average

        @vmappable  # pure: the logits it observes go out as its record, so clients can train batched
        def step(module, batch, i):
            x, y = batch
            z = module(x)  # [B, C] training-mode logits, collected before the step (eq. 7)
            loss = F.cross_entropy(z, y)  # ignores a padded row's label PAD (batched clients in lockstep)
            if use_logits:  # only samples whose class has a server logit; "batch": their sum / batch size
                c = class_index(y)
                distance = logit_distance_rows(z, server_logits[c], logit_loss)
                loss = loss + alpha * masked_row_mean(distance, available[c], logit_average)
            return loss, (y, z)

        stats = ctx.fit(role, step_fn=step, on_record=lambda record: collector.add(record[0], logits=record[1]))
        ctx.state["weights"] = ctx.weights(role)
        upload = collector.result("class_logits", plus_one=self.plus_one)
        return ClientUpdate(task.client, ctx.num_examples(), {"class_logits": upload}, {f"{role}/loss": stats["loss"]})

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        state = self.state
        if self.reset_every:
            # the end of the last full period: collapse once for it, at the first aggregation after it
            period_end = (rnd - 1) // self.reset_every * self.reset_every
            if period_end > state.last_reset_round:
                state.bank.collapse()
                state.last_reset_round = period_end
        for update in updates:
            state.bank.add_statistics(update.sent("class_logits", ClassStatistics), "logits")
        return {"server/classes_with_logits": float(state.bank.available.sum())}
