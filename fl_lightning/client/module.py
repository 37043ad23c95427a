"""ClientModule: the module wrapper of one client model role, with the steps Fabric's loop runs.

A plain ``torch.nn.Module``, not a ``LightningModule``: the Fabric loop uses nothing a LightningModule adds
(no Trainer, ``self.log`` or hooks), and ``lightning.pytorch`` imports torchmetrics, which imports
torchvision, transformers and ``scipy.signal``: seconds of every run's start-up (docs/reference/measurements.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..federation.types import PAD
from ..models import FeatureClassifier
from .training import OptimizerFactory


def _flat(logits: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
    """``[B, T, C]`` sequence logits and ``[B, T]`` targets become ``[B*T, C]`` and ``[B*T]``."""
    if logits.dim() == 3:
        return logits.flatten(0, 1), y.flatten()
    return logits, y


def _fp32(logits: Tensor) -> Tensor:
    """Logits for a loss: softmax and its sums run in float32 whatever the precision (a no-op in 32-true)."""
    return logits.float()


class ClientModule(torch.nn.Module):
    """Wraps a :class:`FeatureClassifier` with the supervised steps every method starts from.

    One instance exists per model role and is reused by every client of that role: a client's weights
    are loaded into it, never a fresh module built. Strategies that change the objective pass their own
    step function to the local loop; ``training_step`` is the plain cross-entropy default.
    """

    pure_training_step = True  # training_step is a pure function of the module and the batch (batched executor)

    def __init__(self, model: FeatureClassifier, optimizer: OptimizerFactory | None):
        super().__init__()
        self.model = model
        self._optimizer_factory = optimizer

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def features(self, x: Tensor) -> Tensor:
        return self.model.features(x)

    def head(self, f: Tensor) -> Tensor:
        return self.model.head(f)

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int = 0) -> Tensor:
        x, y = batch
        logits, y = _flat(self.model(x), y)  # the wrapped model directly: one module dispatch less per step
        return F.cross_entropy(_fp32(logits), y, ignore_index=PAD)

    @torch.no_grad()
    def test_step(self, batch: tuple[Tensor, Tensor], batch_idx: int = 0) -> tuple[Tensor, Tensor, Tensor]:
        """Summed loss, number correct and per-class prediction counts ``[C]`` of a batch (sums, so
        batches of any size combine exactly).

        For sequence outputs (language models) the counts are over non-padding tokens. The summed loss
        is float32 under any precision: a bfloat16 sum of a batch's losses keeps 3 significant digits.
        """
        x, y = batch
        logits, y = _flat(self.model(x), y)  # the wrapped model directly: one module dispatch less per step
        keep = y != PAD
        loss = F.cross_entropy(_fp32(logits), y, reduction="sum", ignore_index=PAD)
        predicted = logits.argmax(1)
        return loss, ((predicted == y) & keep).sum(), torch.bincount(predicted[keep], minlength=logits.shape[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self._optimizer_factory is not None, "a ClientModule without a factory overrides this method"
        return self._optimizer_factory(self.parameters())
