"""Batches of a client's examples, gathered by index from the tensors held in memory (no DataLoader)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from ..data.transforms import to_device
from ..federation.errors import ConfigError


def batch_stream(
    x: Tensor,
    y: Tensor | None,
    idx: Tensor,
    batch_size: int,
    num_steps: int,
    generator: torch.Generator,
    augment: Callable[[Tensor, torch.Generator], Tensor] | None = None,
    drop_last: bool = False,
) -> BatchStream:
    """``num_steps`` batches gathered from the in-memory pool by index (see :class:`BatchStream`)."""
    return BatchStream(x, y, idx, batch_size, num_steps, generator, augment, drop_last)


class BatchStream:
    """``num_steps`` batches gathered from the in-memory pool by index; iterate it for ``(x, y)`` / ``(x,)``.

    Each pass over ``idx`` is a fresh permutation; the last batch of a pass may be smaller, so an epoch
    sees every example exactly once; with ``drop_last`` a pass ends at its last full batch (a pass of fewer
    examples than a batch is one batch of them all). With ``y`` None (unlabeled data) batches are ``(x,)``. ``augment``
    is applied to each batch with the same generator; when it is a :class:`~fl_lightning.data.transforms.
    CropFlip` the batched executor takes :meth:`next_parts` (indices and augmentation draws) from every
    client and gathers and augments all of them at once, with the same random numbers in the same order.
    Nothing is drawn before the first batch is asked for.
    """

    def __init__(self, x, y, idx, batch_size, num_steps, generator, augment=None, drop_last=False):
        self.x, self.y, self.idx, self.drop_last = x, y, idx, drop_last
        self.batch_size, self.num_steps, self.generator, self.augment = batch_size, num_steps, generator, augment
        self.produced, self._order, self._start = 0, None, 0
        self._iterator: Iterator[tuple] | None = None
        self._given_back: tuple[Tensor, Tensor | None] | None = None

    def give_back(self, parts: tuple[Tensor, Tensor | None]) -> None:
        """Makes the batch of ``parts`` (from :meth:`next_parts`) the next one again: a batched group that
        falls back hands its clients their streams with the first batch unconsumed."""
        self._given_back = parts

    def next_parts(self) -> tuple[Tensor, Tensor | None] | None:
        """The next batch's pool indices and its augmentation draws (None without a ``CropFlip``), or None
        after the last step."""
        if self._given_back is not None:
            parts, self._given_back = self._given_back, None
            return parts
        if self.produced == self.num_steps:
            return None
        chosen = self._next_indices()
        draw = getattr(self.augment, "draw", None)
        return chosen, draw(len(chosen), self.generator) if draw is not None else None

    def _next_indices(self) -> Tensor:
        n = len(self.idx)
        if n == 0:
            raise ConfigError(
                "a client has no examples in the split it must train on; check the partition "
                "(min_partition_size) and the labeled / local-split fractions."
            )
        partial = self.drop_last and self._start + self.batch_size > n >= self.batch_size  # what drop_last drops
        if self._order is None or self._start >= n or partial:  # a new pass: a fresh permutation
            self._order = self.idx[to_device(torch.randperm(n, generator=self.generator), self.idx.device)]
            self._start = 0
        chosen = self._order[self._start : self._start + self.batch_size]
        self._start += self.batch_size
        self.produced += 1
        return chosen

    def __next__(self) -> tuple:
        """The next batch (``next(stream)``, as a step that draws a second stream does)."""
        if self._given_back is not None and self._iterator is not None:  # a running generator would skip it
            self._iterator = None
        if self._iterator is None:
            self._iterator = iter(self)
        return next(self._iterator)

    def __iter__(self) -> Iterator[tuple]:
        """The batches from where the stream stands (a generator: the sequential loop's hot path)."""
        x, y, augment, generator = self.x, self.y, self.augment, self.generator
        draw = getattr(augment, "draw", None)
        if self._given_back is not None:
            (chosen, draws), self._given_back = self._given_back, None
            xb = x[chosen] if draws is None else augment.apply(x[chosen], draws)
            yield (xb,) if y is None else (xb, y[chosen])
        while self.produced < self.num_steps:
            chosen = self._next_indices()
            xb = x[chosen]
            if draw is not None:
                xb = augment.apply(xb, draw(len(chosen), generator))
            elif augment is not None:
                xb = augment(xb, generator)
            yield (xb,) if y is None else (xb, y[chosen])
