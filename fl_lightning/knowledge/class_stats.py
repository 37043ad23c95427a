"""Per-class statistics: what FedHe, Felo / Velo and FedGH upload, and how a client collects them.

A client sums vectors (logits, features, representations) per class while it trains or in an eval
pass, divides by the class counts, and sends one :class:`ClassStatistics`. Two layouts exist:

- padded: one row per class ``[C, D]`` and labels ``[C]`` with :data:`ABSENT` for classes the client
  has no data of, so an upload always has the same size (FedHe counts ``C x (C + 1)`` numbers);
- compact: only the ``S`` classes present, ``[S, D]`` and their labels ``[S]`` (FedGH's LARs,
  ``S x (D + 1)`` numbers).

The server side (:class:`~fl_lightning.knowledge.banks.ClassBank`) accepts either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..federation.types import Payload, tensor_bytes

ABSENT = -1  # the label of a padded row: the sender has no example of that class


def class_sums(values: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor]:
    """Per-class sums ``[C, D]`` of ``values`` ``[B, D]`` and counts ``[C]``."""
    sums = torch.zeros(num_classes, values.shape[1], dtype=values.dtype, device=values.device)
    sums.index_add_(0, labels, values)
    counts = torch.bincount(labels, minlength=num_classes)
    return sums, counts


@dataclass
class ClassStatistics(Payload):
    """Named per-class vectors with their class labels (int32 on the wire).

    Attributes:
        kind: the payload's name in the ledger (``class_logits``, ``class_knowledge``, ``lars``).
        vectors: name -> ``[R, D]`` rows, one per entry of ``labels``.
        labels: ``[R]`` class of each row; :data:`ABSENT` marks a padded row.
    """

    kind: str
    vectors: dict[str, Tensor]
    labels: Tensor

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.vectors) + tensor_bytes(self.labels)

    @property
    def present(self) -> Tensor:
        """``[R]`` bool: rows that carry a class."""
        return self.labels >= 0

    @classmethod
    def padded(cls, kind: str, vectors: dict[str, Tensor], present: Tensor) -> ClassStatistics:
        """One row per class; rows of classes where ``present`` is false are sent with label ABSENT."""
        labels = torch.where(present, torch.arange(len(present), device=present.device), ABSENT)
        return cls(kind, vectors, labels.to(torch.int32))

    def compact(self) -> ClassStatistics:
        """Only the rows that carry a class (no padding)."""
        keep = self.present
        return ClassStatistics(self.kind, {k: v[keep] for k, v in self.vectors.items()}, self.labels[keep])


class ClassStatsCollector:
    """Sums named vectors per class over batches; :meth:`result` divides by the class counts.

    Args:
        num_classes: C.
        dims: name -> vector size D of each statistic, e.g. ``{"logits": C, "features": 512}``.
        device: where the sums live (the client's device).
    """

    def __init__(self, num_classes: int, dims: dict[str, int], device: torch.device | str = "cpu"):
        self.num_classes = num_classes
        self.sums = {name: torch.zeros(num_classes, d, device=device) for name, d in dims.items()}
        self.counts = torch.zeros(num_classes, dtype=torch.long, device=device)

    @torch.no_grad()
    def add(self, labels: Tensor, **values: Tensor) -> None:
        """Adds a batch: ``labels`` ``[B]`` and, per name, the batch's vectors ``[B, D]`` (detached)."""
        counts = None
        for name, v in values.items():
            sums, counts = class_sums(v.detach(), labels, self.num_classes)
            self.sums[name].add_(sums)
        self.counts.add_(counts)

    def result(self, kind: str, plus_one: bool = False) -> ClassStatistics:
        """Padded class means: ``sums / counts`` (``sums / (counts + 1)`` with ``plus_one``, FedHe eq. 8)."""
        denominator = (self.counts + 1 if plus_one else self.counts.clamp(min=1))[:, None]
        return ClassStatistics.padded(kind, {k: s / denominator for k, s in self.sums.items()}, self.counts > 0)


@torch.no_grad()
def class_means(
    features: Callable[[Tensor], Tensor],
    x: Tensor,
    y: Tensor,
    idx: Tensor,
    batch_size: int,
    dims: tuple[str, int],
    num_classes: int,
    kind: str,
) -> ClassStatistics:
    """Compact class means ``[S, D]`` of ``features`` over the examples ``idx`` of the pool ``x``, ``y``, in
    passes of ``batch_size`` (FedGH's LARs, FedTGP's client prototypes: the model in eval mode after training).

    Args:
        features: the model's representation (``module.features``), already in the wanted mode.
        dims: the statistic's name in the payload and its size D, e.g. ``("representations", 64)``.
        kind: the payload's name in the ledger.
    """
    name, dim = dims
    collector = ClassStatsCollector(num_classes, {name: dim}, idx.device)
    for start in range(0, len(idx), batch_size):
        chosen = idx[start : start + batch_size]
        collector.add(y[chosen], **{name: features(x[chosen])})
    return collector.result(kind).compact()
