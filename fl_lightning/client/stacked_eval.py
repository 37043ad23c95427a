"""Personalized evaluation of many clients of one architecture at once.

A personalized method evaluates every client's own model on the same global test set. One at a time,
that is a weight load and a forward pass of a few examples' worth of Python per client and layer;
stacked, ``torch.func.vmap`` over ``functional_call`` runs a chunk of clients' models as one batched
forward per test batch. The sums are those of :meth:`ClientModule.test_step`, client by
client, so the metrics equal the one-at-a-time loop's to float tolerance: bit for bit where the batched
kernels compute the same sums (linear layers on the CPU), to a few units in the last place where they
do not (a convolution over stacked weights runs as a grouped convolution).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, vmap

from ..federation.types import PAD, StateDict
from .module import _flat, _fp32

SLOW_FALLBACK = "There is a performance drop"  # torch's warning when vmap loops over an op it cannot batch


class StackedEvaluation:
    """Accuracy and mean loss of several weight sets of one model on the same examples.

    Args:
        model: the role's model instance (its own weights are not used, its mode is set to eval).
        batch_size: test examples per forward pass (``training.eval_batch_size``).
        autocast: the precision context of the forward passes (Fabric's ``autocast``).
    """

    def __init__(
        self,
        model: nn.Module,
        batch_size: int,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
    ):
        self.model = model
        self.batch_size = batch_size
        self.autocast = autocast
        self.slow = False  # vmap fell back to a per-client loop for some op: batching buys nothing here
        self._forward = vmap(self._logits, in_dims=(0, None))

    def _logits(self, state: StateDict, x: Tensor) -> Tensor:
        return functional_call(self.model, state, (x,), strict=True)

    @torch.no_grad()
    def scores(self, weights: list[StateDict], x: Tensor, y: Tensor) -> list[tuple[float, float]]:
        """``(accuracy, mean loss)`` of each weight set on ``(x, y)``, as ``Evaluator`` computes them one at a time.

        Raises whatever ``vmap`` raises for a model it cannot run (e.g. an LSTM: no batching rule for
        ``aten::lstm``); the caller then evaluates one client at a time.
        """
        stacked = {name: torch.stack([w[name] for w in weights]) for name in weights[0]}
        self.model.eval()
        loss_sums = torch.zeros(len(weights), device=x.device)  # float32, as test_step's sums
        correct = torch.zeros(len(weights), dtype=torch.long, device=x.device)
        with warnings.catch_warnings(record=True) as caught, self.autocast():
            warnings.simplefilter("always")
            for start in range(0, len(y), self.batch_size):
                xb, yb = x[start : start + self.batch_size], y[start : start + self.batch_size]
                logits = self._forward(stacked, xb)
                for i in range(len(weights)):  # the sums of ClientModule.test_step, client by client
                    flat, targets = _flat(logits[i], yb)
                    loss_sums[i] += F.cross_entropy(_fp32(flat), targets, reduction="sum", ignore_index=PAD).float()
                    correct[i] += ((flat.argmax(1) == targets) & (targets != PAD)).sum()
        for warning in caught:  # vmap's slow-fallback notice is acted on; any other warning is passed on
            if SLOW_FALLBACK in str(warning.message):
                self.slow = True
            else:
                warnings.warn_explicit(warning.message, warning.category, warning.filename, warning.lineno)
        n = max(int((y != PAD).sum()), 1)  # tokens for sequence targets, examples otherwise
        return [(c / n, s / n) for c, s in zip(correct.tolist(), loss_sums.tolist())]
