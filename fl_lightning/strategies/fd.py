"""FD: Jeong et al., "Communication-Efficient On-Device Machine Learning: Federated Distillation and
Augmentation under Non-IID Private Data", NeurIPS-W 2018 (Sec. 2, Algorithm 1)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.bounds import NonNegative, Positive
from ..federation.padding import class_index
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, TensorPayload
from ..knowledge.class_stats import ClassStatistics, ClassStatsCollector
from ..knowledge.distillation import masked_row_mean
from .base import PersonalModels, ServerContext, Split, Strategy


def fd_loss(z: Tensor, y: Tensor, targets: Tensor, available: Tensor, lam: float, temperature: float) -> Tensor:
    """FD's local loss on a batch: ``CE(z, y) + lam * T^2 KL(softmax(t_y / T) || softmax(z / T))``.

    The KL is summed over classes and averaged over the samples whose label has a teacher (``available``);
    a batch without one is plain cross-entropy. A padded batch's padded rows (label PAD, batched clients in
    lockstep) count in neither term.

    Args:
        z: the student's logits ``[B, C]``.
        y: labels ``[B]``.
        targets: the teacher's logits per label ``[C, C]`` (rows of labels without a teacher are ignored).
        available: ``[C]`` bool, labels that have a teacher.
        lam: gamma, the weight of the distillation term.
        temperature: T of both softmaxes.
    """
    log_student = F.log_softmax(z.float() / temperature, dim=1)
    c = class_index(y)  # a padded row's PAD label indexes class 0; the means below leave that row out
    soft = F.softmax(targets[c] / temperature, dim=1)
    rows = F.kl_div(log_student, soft, reduction="none").sum(1) * temperature**2
    return F.cross_entropy(z, y) + lam * masked_row_mean(rows, available[c], "available")


@dataclass
class FDState:
    """The last round's uploads, all that FD's server keeps (``C`` classes)."""

    round_sums: Tensor  # [C, C] float64, per label the sum of the uploaded logits
    round_counts: Tensor  # [C] float64, per label the number of uploads
    last_uploads: dict[int, dict[str, Tensor]]  # per uploader its "labels" [S] int32 and "logits" [S, C]


class FD(PersonalModels, Strategy):
    """Federated distillation: personal models that exchange per-label average logits, no public data.

    Client k keeps its own model. While it trains it sums the logits of each label (training-mode
    forward, before each step) and uploads the per-label means of the ``S`` labels it met, with those
    labels (``S x (C + 1)`` numbers, Algorithm 1 line 6). The server averages the last round's uploads
    per label, unweighted. Client k's teacher for label c is that average without its own upload
    (Algorithm 1 line 9, ``exclude_own``), and its local loss is :func:`fd_loss`.

    What goes down is the teacher of the client's own labels only (:meth:`teacher`): the ``S x C`` rows
    in the order of its last upload's labels, which it kept (``TensorPayload``), or, when it did not
    upload last round or a label of it has no teacher, the teacher rows that exist with their labels
    (``ClassStatistics``). How this matches paper 004's traffic count: ``docs/algorithms.md``, FD.

    Args:
        lam: gamma, weight of the distillation term.
        temperature: T of the teacher and student softmax (1 in the paper).
        exclude_own: client k's teacher leaves out k's own upload (paper) or not (HtFLlib).
        split: where personal models are evaluated: the ``global`` test set or each client's local ``test`` split.
    """

    state: FDState
    central_privacy = True

    def __init__(
        self, lam: NonNegative = 1.0, temperature: Positive = 1.0, exclude_own: bool = True, split: Split = "global"
    ):
        self.lam, self.temperature, self.exclude_own, self.split = lam, temperature, exclude_own, split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        self.num_classes = c = server.data.num_classes
        self.state = FDState(torch.zeros(c, c, dtype=torch.float64), torch.zeros(c, dtype=torch.float64), {})

    # ------------------------------------------------------------------ server -> client
    def teacher(self, client: ClientSpec) -> ClassStatistics | TensorPayload:
        """What ``client`` receives: its labels' teacher logits, in the order of its last upload (a
        ``TensorPayload`` of ``[S, C]``), or the teacher rows that exist with their labels (compact
        ``ClassStatistics``; no row before any upload)."""
        sums, counts = self.state.round_sums.clone(), self.state.round_counts.clone()
        own = self.state.last_uploads.get(client.id)
        if own is not None and self.exclude_own:
            labels = own["labels"].long()
            sums.index_add_(0, labels, -own["logits"].double())
            counts.index_add_(0, labels, -torch.ones(len(labels), dtype=torch.float64))
        present = counts > 0.5
        mean = (sums / counts.clamp(min=1.0)[:, None]).float()
        if own is not None:
            labels = own["labels"].long()
            if bool(present[labels].all()):  # the client knows these labels: only the rows go down
                return TensorPayload("teacher_logits", {"logits": mean[labels]})
            present = present & torch.zeros_like(present).index_fill_(0, labels, True)
        return ClassStatistics.padded("teacher_logits", {"logits": mean * present[:, None]}, present).compact()

    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        return [ClientTask(c, rnd, {"teacher_logits": self.teacher(c)}) for c in clients]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        targets, available = self.received_teacher(task, ctx)
        device = ctx.data_x.device
        # at one address per name (CUDA graphs keep their key); absent labels' rows are zeros
        targets, available = ctx.on_device("teacher", targets), ctx.on_device("has", available)
        collector = ClassStatsCollector(self.num_classes, {"logits": self.num_classes}, device)
        lam, temperature = self.lam, self.temperature  # values, not the strategy, in the closure

        @vmappable  # pure: the logits go out as its record; fixed shapes, no branch on a tensor
        def step(module, batch, i):
            x, y = batch
            z = module(x)  # [B, C]
            return fd_loss(z, y, targets, available, lam, temperature), (y, z)  # training-mode logits, before the step

        stats = ctx.fit(role, step_fn=step, on_record=lambda record: collector.add(record[0], logits=record[1]))
        ctx.state["weights"] = ctx.weights(role)
        upload = collector.result("class_logits").compact()
        ctx.state["sent_labels"] = upload.labels.cpu()  # to read the next round's teacher rows
        return ClientUpdate(task.client, ctx.num_examples(), {"class_logits": upload}, {f"{role}/loss": stats["loss"]})

    def received_teacher(self, task: ClientTask, ctx: ClientContext) -> tuple[Tensor, Tensor]:
        """The downlink as per-label teacher logits ``[C, C]`` (zeros where none) and ``[C]`` bool."""
        c = self.num_classes
        if isinstance(task.downlink["teacher_logits"], ClassStatistics):
            received = task.received("teacher_logits", ClassStatistics)
            labels, rows = received.labels.long().cpu(), received.vectors["logits"].cpu()
        else:  # rows in the order of the labels this client uploaded last
            sent = ctx.state.get("sent_labels")
            rows = task.received("teacher_logits", TensorPayload).tensors["logits"].cpu()
            if self.server.whole_class_tables:  # privacy sent a row of every class, so every class's row comes back
                sent = torch.arange(c)
            if sent is None or len(sent) != len(rows):
                raise RuntimeError(
                    f"FD client {task.client.id} received {len(rows)} teacher rows for the labels of its last "
                    f"upload, but it holds {None if sent is None else len(sent)}."
                )
            labels = sent.long()
        targets = torch.zeros(c, c)
        available = torch.zeros(c, dtype=torch.bool)
        targets[labels], available[labels] = rows.float(), True
        return targets, available

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        state = self.state
        state.round_sums.zero_()
        state.round_counts.zero_()
        state.last_uploads = {}
        for update in updates:
            upload = update.sent("class_logits", ClassStatistics).compact()
            labels = upload.labels.cpu().long()
            logits = upload.vectors["logits"].detach().cpu()
            state.round_sums.index_add_(0, labels, logits.double())
            state.round_counts.index_add_(0, labels, torch.ones(len(labels), dtype=torch.float64))
            state.last_uploads[update.client.id] = {"labels": labels.to(torch.int32), "logits": logits}
        if self.server.central_noise is not None:  # central privacy: the noised sums over the expected uploads
            noised, expected = self.server.private_sum({"sums": state.round_sums}, self.server.clients)
            state.round_sums, state.round_counts = noised["sums"], torch.full_like(state.round_counts, expected)
        return {"server/labels_with_logits": float((state.round_counts > 0).sum())}
