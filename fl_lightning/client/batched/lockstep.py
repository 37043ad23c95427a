"""Every client of a group in every step, whatever its batch's size (``runtime.lockstep``).

Without lockstep a group's clients step together only while their batches have one shape: a client
smaller than a batch, or at the end of a pass over its data, steps alone or with a few others. In lockstep
each client's batch is padded to the group's batch size ``B``, its own rows first and then copies of its
first row (with the label :data:`~fl_lightning.federation.padding.PAD` where the batch comes from a
labeled split), and the step runs under the mask of real rows (``federation.padding``; batch norm:
``masked_norm``). A client that has finished its steps takes the step on a copy of another client's batch
and its state is put back afterwards, so every step of the group is one vmapped call over all its clients.

A group's :class:`Lockstep` makes each step's padded batch (laid out by :class:`Padder`) and checks, at its
first padded step, that the step function honours the mask: one client's loss on its real rows and on two
paddings of them must agree (:func:`padding_variants`, :func:`padding_mismatch`). A step that does not (a
plain mean over the batch) steps by shape, as without lockstep, for the rest of the run;
:class:`LockstepMemory` keeps that, and the counts summary.json gives.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from ...data.transforms import to_device
from ...federation.types import PAD
from .gathering import gather

log = logging.getLogger(__name__)


@dataclass
class LockstepMemory:
    """What lockstep learns over a run: the steps whose padding was checked (on a client with two real rows
    or more) or refused (they step by shape), and the counts of steps summary.json reports."""

    verified: set = field(default_factory=set)
    refused: dict[Any, str] = field(default_factory=dict)
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(
            ("steps", "by_shape_steps", "client_steps", "padded_client_steps", "idle_client_steps"), 0
        )
    )

    def refuse(self, key: Any, why: str) -> None:
        """Steps of ``key`` (role, step code) step by shape from now on (a warning names why, once)."""
        if key not in self.refused:
            log.warning("%s: its clients step by batch shape, not in lockstep: %s", key[0], why)
            self.refused[key] = why

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.counts)
        if self.refused:
            out["refused"] = sorted({why for why in self.refused.values()})
        return out


@dataclass
class PaddedStep:
    """How a lockstep step's stacked batch ``[m, B, ...]`` maps to the group's clients.

    Attributes:
        real: each client's real rows at this step; 0 for a client that has finished its steps.
        rows: ``B``.
        mask: ``[m, B]``, True on real rows (a finished client has its source client's); None when no client
            with a batch has padded rows.
    """

    real: list[int]
    rows: int
    mask: Tensor | None
    finished: list[int] = field(init=False)

    def __post_init__(self):
        self.finished = [k for k, n in enumerate(self.real) if n == 0]

    def cut(self, k: int, record: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        """Client ``k``'s record (tensors per example, ``[B, ...]``) cut to its own rows."""
        n = self.real[k]
        if n == self.rows:
            return record
        return tuple(t[:n] if t.dim() and t.shape[0] == self.rows else t for t in record)


class OneClient(Protocol):
    """What the padding check needs of a group's training (``group_training.GroupTraining``)."""

    mixed: bool  # bf16 / fp16 mixed precision: losses of two batch sizes agree less closely

    def client_loss(self, k: int, batch: tuple, mask: Tensor | None) -> float: ...


class Lockstep:
    """A group's steps in lockstep: each step's padded batch, the check that the step honours the mask, the
    counts (``memory``: the run's, shared by its groups; ``key``: the group's step, as ``step_key``)."""

    def __init__(self, memory: LockstepMemory, key: Any, device: torch.device):
        self.memory, self.key = memory, key
        self.padder = Padder(device, 0)
        self.checked = False  # the check passed in this group (on one real row only, it is not kept for the run)

    def applies(self, streams: list, batches: dict[int, tuple], gathered: bool) -> bool:
        """Whether this step's batches can be padded into one: they differ at most in their number of rows
        (batches a strategy made itself may differ in more; those clients step by shape that step)."""
        if not self.padder.rows:
            self.padder.rows = group_rows(streams, list(batches.values()))
        return gathered or len({tuple((t.shape[1:], t.dtype) for t in b) for b in batches.values()}) == 1

    def padded_batch(
        self, m: int, streams: list, batches: dict[int, tuple], gathered: bool
    ) -> tuple[tuple, PaddedStep]:
        """The ``m`` clients' batches padded to the group's rows and stacked ``[m, B, ...]`` (a finished client's:
        a copy of the first active client's), with the label PAD in padded rows of a labeled split."""
        padded, key = self.padder.layout([len(batches[k][0]) if k in batches else 0 for k in range(m)])
        order = [k for k in range(m) if k in batches]
        rows, first = padded.rows, batches[order[0]]
        if gathered:  # one gather from the pool and one augmentation call, as without padding
            stream = streams[order[0]]
            index = self.padder.pad([batches[k][0] for k in order], key)
            x = stream.x[index]
            if stream.augment is not None:
                x = stream.augment.apply(x, self.padder.pad([batches[k][1] for k in order], key))
            batch: tuple[Tensor, ...] = (x.view(m, rows, *x.shape[1:]),)
            batch += () if stream.y is None else (stream.y[index].view(m, rows, *stream.y.shape[1:]),)
        else:
            batch = tuple(
                self.padder.pad([batches[k][i] for k in order], key).view(m, rows, *first[i].shape[1:])
                for i in range(len(first))
            )
        if padded.mask is not None and len(batch) > 1 and labeled(streams):
            y = batch[1]
            batch = (batch[0], y.masked_fill(~padded.mask.view(m, rows, *[1] * (y.dim() - 2)), PAD), *batch[2:])
        return batch, padded

    def honoured(
        self, training: OneClient, streams: list, batches: dict[int, tuple], gathered: bool, padded: PaddedStep
    ) -> bool:
        """Whether the step leaves padded rows out, checked on the padded client with the most real rows: its
        loss on its own rows must equal its losses on two paddings of them (once per group; once a check on two
        rows or more has passed, not again in this run). False: the step is refused, its clients step by shape
        from here on."""
        if self.checked or self.key in self.memory.verified:
            return True
        k = max((k for k in batches if padded.real[k] < padded.rows), key=lambda k: padded.real[k])
        one = tuple(t[0] for t in gather(streams[k], [batches[k]])) if gathered else batches[k]
        variants = padding_variants(one, padded.rows, 1 if len(one) > 1 and labeled(streams) else None)
        mask = torch.arange(padded.rows, device=one[0].device) < padded.real[k]
        try:
            losses = [training.client_loss(k, batch, None if i == 0 else mask) for i, batch in enumerate(variants)]
        except (RuntimeError, ValueError, TypeError, IndexError, NotImplementedError) as err:
            why: str | None = (
                f"its step fails on a padded batch ({str(err).splitlines()[0] if str(err) else type(err).__name__})"
            )
        else:
            why = padding_mismatch(losses, 2e-2 if training.mixed else 1e-3)
            if why is None and padded.real[k] >= 2 and all(math.isfinite(v) for v in losses):
                self.memory.verified.add(self.key)
        if why is not None:
            self.memory.refuse(self.key, why)
        self.checked = why is None
        return self.checked

    def count(self, batches: dict[int, tuple], padded: PaddedStep) -> None:
        counts = self.memory.counts
        counts["steps"] += 1
        counts["client_steps"] += len(batches)
        counts["padded_client_steps"] += sum(padded.real[k] < padded.rows for k in batches)
        counts["idle_client_steps"] += len(padded.finished)


class Padder:
    """Lays out lockstep batches: each client's rows, by position in the concatenation of the batches of the
    clients that have one, so that a step pads every tensor with one indexing call, whatever the number of
    clients. Positions and masks are cached by the clients' sizes (they repeat: a client smaller than a
    batch has the same size at every step)."""

    def __init__(self, device: torch.device, rows: int):
        self.device, self.rows = device, rows
        self._layouts: dict[tuple, tuple[PaddedStep, Tensor]] = {}
        self._positions: dict[tuple, Tensor] = {}  # by layout and device (augmentation draws stay on the CPU)

    def layout(self, sizes: list[int]) -> tuple[PaddedStep, tuple]:
        """(the step's :class:`PaddedStep`, the key :meth:`pad` takes) for clients with ``sizes`` real rows (0:
        finished)."""
        self.rows = max(self.rows, *sizes)  # a stream may give a larger batch than the first ones (not a BatchStream)
        key = (self.rows, *sizes)
        if key not in self._layouts:
            if len(self._layouts) > 1024:
                self._layouts.clear()
                self._positions.clear()
            self._layouts[key] = self._make(sizes)
        return self._layouts[key][0], key

    def pad(self, parts: list[Tensor], key: tuple) -> Tensor:
        """The parts (one tensor of each client that has a batch, in client order) padded and stacked:
        ``[m * B, ...]``."""
        device = parts[0].device
        positions = self._positions.get((key, device))
        if positions is None:
            positions = self._positions[key, device] = to_device(self._layouts[key][1], device)
        return torch.cat(parts)[positions]

    def _make(self, sizes: list[int]) -> tuple[PaddedStep, Tensor]:
        rows, offsets, offset = self.rows, [], 0
        for n in sizes:
            offsets.append(offset)
            offset += n
        source = next(k for k, n in enumerate(sizes) if n)  # a finished client steps on the first active one's batch
        row = torch.arange(rows)
        positions, masks = [], []
        for k, n in enumerate(sizes):
            k, n = (k, n) if n else (source, sizes[source])
            positions.append(offsets[k] + torch.where(row < n, row, 0))  # padded rows: copies of the first
            masks.append(row < n)
        mask = torch.stack(masks)
        padded = not all(n in (0, rows) for n in sizes)
        return PaddedStep(list(sizes), rows, to_device(mask, self.device) if padded else None), torch.cat(positions)


def labeled(streams: list) -> bool:
    """Whether every client's batches are ``(x, y)`` of a labeled split, whose padded rows take the label PAD."""
    from ..batches import BatchStream

    return all(isinstance(s, BatchStream) and s.y is not None for s in streams)


def group_rows(streams: list, batches: list[tuple]) -> int:
    """``B``: the largest batch any client of the group can draw (a stream of unknown batches: the largest seen)."""
    from ..batches import BatchStream

    rows = max(len(batch[0]) for batch in batches)
    for s in streams:
        if isinstance(s, BatchStream):
            rows = max(rows, min(s.batch_size, len(s.idx)))
    return rows


def padding_variants(batch: tuple[Tensor, ...], rows: int, label_at: int | None) -> list[tuple[Tensor, ...]]:
    """One client's batch three ways: as drawn, padded to ``rows`` with copies of its first row, and with
    copies of its last. A step that honours the mask gives the three the same loss."""

    def padded(t: Tensor, source: int) -> Tensor:
        return torch.cat([t, t[source : source + 1].expand(rows - len(t), *t.shape[1:])])

    variants = [batch]
    for source in (0, len(batch[0]) - 1):
        tensors = [padded(t, source) for t in batch]
        if label_at is not None:
            tensors[label_at] = tensors[label_at].clone()
            tensors[label_at][len(batch[0]) :] = PAD
        variants.append(tuple(tensors))
    return variants


def padding_mismatch(losses: list[float], rtol: float) -> str | None:
    """Why ``losses`` (a client's on its real rows, then on :func:`padding_variants`' two paddings) show a
    step that does not honour the mask, or None. The two paddings differ only in the padded rows' values,
    so an honouring step gives them the same loss to the last bits; the real rows' loss comes from another
    batch size, so it agrees to ``rtol`` (float rounding; low precision needs more)."""
    real, first, last = losses
    if abs(first - last) > 1e-5 * max(abs(first), abs(last)) + 1e-7:
        return f"its loss depends on the values of padded rows ({first:.6g} and {last:.6g} for two paddings)"
    if abs(first - real) > rtol * abs(real) + 1e-6:
        return f"its loss over a padded batch ({first:.6g}) is not the loss over the real rows ({real:.6g})"
    return None
