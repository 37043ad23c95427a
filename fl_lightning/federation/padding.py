"""Padded batches: the rows that let clients with batches of different sizes take one step together, and
the reductions that leave those rows out.

The batched executor in lockstep (``runtime.lockstep``) pads every client's batch to the group's batch
size, its own examples first, so that each step of a phase is one vmapped call over all its clients.
While such a step runs, :func:`real_rows` gives the client's mask ``[B]`` (True for its own examples);
everywhere else (the sequential loop, a step with nothing padded) it is None and every function here is
the plain computation, call for call, so the sequential numbers do not move.

A step function honours the mask so that a padded row changes nothing:

- labels of padded rows are :data:`PAD` (when the batch comes from a client's labeled split), which the
  cross-entropy ignores (its default ``ignore_index`` is ``PAD``); :func:`class_index` makes them safe
  to index per-class tensors with, and :func:`real_labels` marks labels a step computes itself;
- a mean over the batch goes through :func:`padded_loss`, or a ``knowledge`` function that does
  (``kl_to_targets``, ``kd_kl_loss``, ``masked_row_mean``);
- what a step records per example (``(loss, record)``) is cut to the client's own rows by the executor.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from .types import PAD

__all__ = ["PAD", "class_index", "padded_loss", "padded_rows", "real_labels", "real_rows"]

_current = threading.local()  # the mask of the padded batch whose step runs on this thread


@contextlib.contextmanager
def padded_rows(mask: Tensor | None) -> Iterator[None]:
    """Makes ``mask`` ``[B]`` (True: the client's own example) the batch's mask while the block runs (the
    batched executor, around one client's step inside its vmapped call); None: nothing is padded."""
    before = getattr(_current, "mask", None)
    _current.mask = mask
    try:
        yield
    finally:
        _current.mask = before


def real_rows() -> Tensor | None:
    """The running step's mask ``[B]`` of real (not padded) rows, or None when its batch is not padded."""
    return getattr(_current, "mask", None)


def class_index(labels: Tensor) -> Tensor:
    """``labels`` to index per-class tensors with: a padded row's PAD points at class 0 (the mask leaves
    that row out of every reduction); the labels themselves when nothing is padded."""
    return labels if real_rows() is None else labels.clamp(min=0)


def real_labels(labels: Tensor) -> Tensor:
    """``labels`` with PAD in the padded rows, which the cross-entropy ignores: for labels a step computes
    itself (from positions in the batch); the labels themselves when nothing is padded."""
    rows = real_rows()
    return labels if rows is None else labels.masked_fill(~rows, PAD)


def padded_loss(
    loss_fn: Callable[..., Tensor], input: Tensor, target: Tensor, reduction: str = "mean", **kwargs
) -> Tensor:
    """``loss_fn(input, target, reduction=reduction)`` over the real rows of a padded batch (``mean``: the mean
    of their elements; ``batchmean``: their sum over their number; ``sum``), and that call itself when
    nothing is padded. For element-wise losses (``F.l1_loss``, ``F.mse_loss``, ``F.kl_div``); a
    cross-entropy takes :func:`real_labels` instead (its mean counts only labels it does not ignore)."""
    rows = real_rows()
    if rows is None:
        return loss_fn(input, target, reduction=reduction, **kwargs)
    elements = loss_fn(input, target, reduction="none", **kwargs)
    keep = rows.view(-1, *[1] * (elements.dim() - 1))
    total = torch.where(keep, elements, torch.zeros_like(elements)).sum()
    if reduction == "sum":
        return total
    count = rows.sum().clamp(min=1)
    if reduction == "batchmean":
        return total / count
    if reduction == "mean":
        return total / (count * elements[0].numel())
    raise ValueError(f"padded_loss: reduction must be mean, batchmean or sum, got {reduction!r}")
