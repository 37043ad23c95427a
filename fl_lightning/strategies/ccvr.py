"""CCVR: Luo, Chen, Hu, Zhang, Liang, Feng, "No Fear of Heterogeneity: Classifier Calibration for Federated
Learning with Non-IID Data", NeurIPS 2021."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..client.context import ClientContext
from ..client.evaluation import Evaluator
from ..federation.bounds import Positive, PositiveInt
from ..federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    Role,
    StateDict,
    TensorPayload,
    load_exchanged,
)
from ..knowledge.virtual_features import class_moments, pooled_moments, virtual_features
from .base import Phase, ServerContext, global_metrics
from .fedavg import FedAvg, FedAvgState


@dataclass
class CCVRState(FedAvgState):
    """FedAvg's global weights, and the calibrated model of the round's calibration (empty outside one)."""

    calibrated: dict[Role, StateDict]


class CCVR(FedAvg):
    """Classifier calibration with virtual representations: FedAvg, then the global model's classifier
    retrained on the server on features drawn from Gaussians of the clients' class statistics.

    A round trains as FedAvg (phase ``train``). In a calibration round (the last, the paper's post-hoc
    calibration, and with ``calibrate_every: k`` also every k-th) a second phase, ``statistics``, sends the new
    global model to every client of the population; each computes its training examples' features (the
    model's ``features``, eval mode) and uploads, per class it holds, the count, the mean and the unbiased
    covariance. The server pools them into each class's mean and covariance over all clients
    (:func:`~fl_lightning.knowledge.virtual_features.pooled_moments`), draws ``virtual_per_class`` features
    per class from ``N(mu_c, Sigma_c)`` and trains the classifier (the model's ``head``) alone on them with
    cross-entropy: ``calibration_epochs`` passes in shuffled batches, SGD at ``calibration_lr``. The calibrated
    model is evaluated as ``<role>/test_*`` (and the uncalibrated one as ``uncalibrated/<role>/test_*``); the
    next round trains on from the uncalibrated global model, as FL-bench calibrates a copy. The method is
    defined for one architecture (one role). Where it follows the paper and where FL-bench's version:
    ``docs/algorithms.md``, CCVR.

    Args:
        virtual_per_class: virtual features drawn per class (FL-bench's default).
        calibration_epochs: passes over the virtual features.
        calibration_lr: the calibration's SGD learning rate.
        calibration_batch_size: its batch size; the recipe's ``training.batch_size`` when not given.
        calibrate_every: also calibrate every k-th round (None: the last round only).
        (roles, weighted: as FedAvg)
    """

    central_privacy = False  # the server calibrates on the clients' class moments, not on a noised sum

    state: CCVRState
    needs_split = True  # the classifier trains on features

    def __init__(
        self,
        virtual_per_class: PositiveInt = 200,
        calibration_epochs: PositiveInt = 1,
        calibration_lr: Positive = 0.01,
        calibration_batch_size: PositiveInt | None = None,
        calibrate_every: PositiveInt | None = None,
        roles: list[str] | None = None,
        weighted: bool = True,
    ):
        super().__init__(roles, weighted)
        self.virtual_per_class, self.calibration_epochs = virtual_per_class, calibration_epochs
        self.calibration_lr, self.calibration_batch_size = calibration_lr, calibration_batch_size
        self.calibrate_every = calibrate_every

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_architecture()
        self.state = CCVRState(self.state.global_weights, {})
        self.num_classes = server.data.num_classes

    def phases(self) -> tuple[Phase, ...]:
        return (
            Phase("train", self.configure_round, self.client_update, self.aggregate),
            Phase("statistics", self.configure_statistics, self.client_statistics, self.calibrate),
        )

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        self.state.calibrated = {}  # a new global model: the last calibration no longer belongs to it
        return super().aggregate(rnd, updates)

    def calibrates(self, rnd: int) -> bool:
        """Whether round ``rnd`` ends with a calibration."""
        return rnd == self.server.rounds or (self.calibrate_every is not None and rnd % self.calibrate_every == 0)

    def configure_statistics(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        if not self.calibrates(rnd):
            return []
        role = self.roles[0]
        weights = self.outgoing(role, self.state.global_weights[role])
        return [ClientTask(c, rnd, {role: weights}) for c in self.server.clients]  # every client, as the paper

    def client_statistics(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role)
        load_exchanged(module.model, task.received(role, ModelWeights).state)
        module.eval()
        idx = ctx.indices.train
        with torch.no_grad():
            features = torch.cat(
                [
                    module.model.features(ctx.data_x[idx[start : start + ctx.eval_batch_size]])
                    for start in range(0, len(idx), ctx.eval_batch_size)
                ]
            )
        counts, means, covs = class_moments(features, ctx.data_y[idx], self.num_classes)
        held = counts > 0  # the classes it holds travel (compact), with their labels
        tensors = {
            "labels": torch.nonzero(held).flatten(),
            "counts": counts[held].float(),
            "means": means[held].float(),
            "covariances": covs[held].float(),
        }
        return ClientUpdate(task.client, ctx.num_examples("train"), {"class_moments": TensorPayload("ccvr", tensors)})

    def calibrate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        role = self.roles[0]
        num_classes, dim = self.num_classes, self.server.feature_dim(role)
        device = next(self.server.model(role).parameters()).device
        rows = []
        for update in updates:
            sent = update.sent("class_moments", TensorPayload).tensors
            counts = torch.zeros(num_classes, dtype=torch.float64)
            means = torch.zeros(num_classes, dim, dtype=torch.float64)
            covs = torch.zeros(num_classes, dim, dim, dtype=torch.float64)
            labels = sent["labels"].cpu()
            counts[labels], means[labels], covs[labels] = (
                sent[k].cpu().double() for k in ("counts", "means", "covariances")
            )
            rows.append((counts, means, covs))
        if not rows:
            return {}
        n, mu, sigma = pooled_moments(*(torch.stack(parts) for parts in zip(*rows)))
        x, y = virtual_features(n, mu, sigma, self.virtual_per_class, self.server.round_generator())
        if not len(y):
            return {}
        x, y = x.to(device), y.to(device)  # the server's device, as its model
        batch_size = self.calibration_batch_size or self.server.batch_size
        generator = self.server.round_generator()
        batches = [
            (x[order[start : start + batch_size]], y[order[start : start + batch_size]])
            for order in (
                torch.randperm(len(y), generator=generator).to(y.device) for _ in range(self.calibration_epochs)
            )
            for start in range(0, len(y), batch_size)
        ]
        lr = self.calibration_lr

        def step(module, batch, i):
            features, labels = batch
            return F.cross_entropy(module.model.head(features), labels)

        # only the head sees a gradient (the step never runs the features), so SGD moves the head alone
        calibrated, loss = self.server.train(
            role, self.state.global_weights[role], batches, step, lambda p: torch.optim.SGD(p, lr=lr), return_loss=True
        )
        self.state.calibrated = {role: calibrated}
        return {"calibration/loss": loss, "calibration/virtual_features": float(len(y))}

    def evaluate(self, evaluator: Evaluator) -> dict[str, float]:
        if not self.state.calibrated:
            return global_metrics(evaluator, self.state.global_weights)
        metrics = global_metrics(evaluator, self.state.calibrated)
        uncalibrated = global_metrics(evaluator, self.state.global_weights)
        return metrics | {f"uncalibrated/{name}": value for name, value in uncalibrated.items()}
