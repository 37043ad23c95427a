"""FD: Jeong et al., "Communication-Efficient On-Device Machine Learning: Federated Distillation and
Augmentation under Non-IID Private Data", NeurIPS-W 2018 (Sec. 2, Algorithm 1)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from ..client.context import ClientContext
from ..client.steps import vmappable
from ..federation.errors import ConfigError
from ..federation.padding import class_index
from ..federation.types import ClientSpec, ClientTask, ClientUpdate
from ..knowledge.class_stats import ClassStatistics, ClassStatsCollector
from ..knowledge.distillation import masked_row_mean
from .base import PersonalModels, ServerContext, Strategy


class FD(PersonalModels, Strategy):
    """Federated distillation: personal models that exchange per-label average logits, no public data.

    Client k keeps its own model. While it trains it sums the logits of each label (training-mode
    forward, before each step) and uploads the per-label means ``z_k,c`` (``C x (C + 1)`` numbers with
    the labels, Algorithm 1 line 6). The server averages, per label, the uploads of the last round
    (unweighted: "global average logit vectors"). Client k's teacher for label c is that average
    **without its own upload** (Algorithm 1 line 9: ``F_global - F_k``, the paper's choice;
    ``exclude_own: false`` is the plain mean of HtFLlib's version). Local loss:
    ``CE(z, y) + lam * KL(softmax(t_y / T) || softmax(z / T))`` over samples whose label has a
    teacher. The paper writes the regulariser as a cross-entropy against the teacher's softmax;
    the KL has the same gradient (they differ by the teacher's entropy, a constant).

    Personal models are evaluated on the global test set (``split: global``) or on each client's local
    test split (``split: test``, as paper 004 compares FD with FedGH).

    Args:
        lam: gamma, weight of the distillation term.
        temperature: T of the teacher and student softmax (1 in the paper).
        exclude_own: client k's teacher leaves out k's own upload (paper) or not (HtFLlib).
        split: where personal models are evaluated.
    """

    state_attributes = ("round_sums", "round_counts", "last_uploads")

    def __init__(self, lam: float = 1.0, temperature: float = 1.0, exclude_own: bool = True, split: str = "global"):
        if not (lam >= 0 and temperature > 0):
            raise ConfigError(f"FD needs lam >= 0 and temperature > 0; got lam={lam}, temperature={temperature}.")
        self.lam, self.temperature, self.exclude_own, self.split = lam, temperature, exclude_own, split

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client("FD")
        self.num_classes = server.data.num_classes
        c = self.num_classes
        # the last round's uploads: their per-label sums and counts, and each uploader's own part
        self.round_sums = torch.zeros(c, c, dtype=torch.float64)
        self.round_counts = torch.zeros(c, dtype=torch.float64)
        self.last_uploads: dict[int, dict[str, torch.Tensor]] = {}

    # ------------------------------------------------------------------ server -> client
    def teacher(self, client: ClientSpec) -> ClassStatistics:
        """Per-label teacher logits ``[C, C]`` for ``client`` (label ABSENT where no other client has one)."""
        sums, counts = self.round_sums.clone(), self.round_counts.clone()
        own = self.last_uploads.get(client.id) if self.exclude_own else None
        if own is not None:
            sums -= own["logits"].double() * own["present"][:, None]
            counts -= own["present"].double()
        present = counts > 0.5
        mean = (sums / counts.clamp(min=1.0)[:, None]).float() * present[:, None]
        return ClassStatistics.padded("teacher_logits", {"logits": mean}, present)

    def configure_round(self, rnd: int, clients: list[ClientSpec], phase: str = "train") -> list[ClientTask]:
        return [ClientTask(c, rnd, {"teacher_logits": self.teacher(c)}) for c in clients]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        teacher = task.downlink["teacher_logits"]
        device = ctx.data_x.device
        # at one address per name (CUDA graphs keep their key); absent labels' rows are zeros
        targets, available = ctx.on_device("teacher", teacher.vectors["logits"]), ctx.on_device("has", teacher.present)
        collector = ClassStatsCollector(self.num_classes, {"logits": self.num_classes}, device)
        lam, temperature = self.lam, self.temperature  # values, not the strategy, in the closure

        @vmappable  # pure: the logits go out as its record; fixed shapes, no branch on a tensor
        def step(module, batch, i):
            x, y = batch
            z = module(x)  # [B, C]
            loss = F.cross_entropy(z, y)  # ignores a padded row's label PAD (batched clients in lockstep)
            # T^2 KL(softmax(t_y / T) || softmax(z / T)), averaged over the samples whose label has a teacher
            log_student = F.log_softmax(z.float() / temperature, dim=1)
            c = class_index(y)
            soft = F.softmax(targets[c] / temperature, dim=1)
            rows = F.kl_div(log_student, soft, reduction="none").sum(1) * temperature**2
            loss = loss + lam * masked_row_mean(rows, available[c], "available")
            return loss, (y, z)  # training-mode logits, before the step

        stats = ctx.fit(role, step_fn=step, on_record=lambda record: collector.add(record[0], logits=record[1]))
        ctx.state["weights"] = ctx.weights(role)
        upload = collector.result("class_logits")
        return ClientUpdate(task.client, ctx.num_examples(), {"class_logits": upload}, {f"{role}/loss": stats["loss"]})

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "train") -> dict[str, float]:
        self.round_sums.zero_()
        self.round_counts.zero_()
        self.last_uploads = {}
        for update in updates:
            upload = update.uplink["class_logits"]
            present = upload.present
            logits = upload.vectors["logits"].detach().cpu()
            self.round_sums += logits.double() * present.cpu()[:, None]
            self.round_counts += present.cpu().double()
            self.last_uploads[update.client.id] = {"logits": logits, "present": present.cpu()}
        return {"server/labels_with_logits": float((self.round_counts > 0).sum())}
