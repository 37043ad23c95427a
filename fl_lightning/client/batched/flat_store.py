"""Stacked per-client tensors in a few flat buffers (the batched executor's state of a group)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


@dataclass
class Selection:
    """Some consecutive clients of a store (views of its buffers) or a gathered copy of scattered ones."""

    flats: dict[tuple, Tensor]
    count: int
    first: int
    whole: int  # clients the buffers in ``flats`` hold
    index: Tensor | None = None  # the gathered clients, to scatter back


class FlatStore:
    """Tensors ``[clients, ...]`` kept in a few flat buffers, one per label, dtype and device; every tensor is
    a view of its buffer. A step of some clients gathers each buffer once (``index_select``) and scatters it
    back once (``index_copy_``), whatever the number of tensors.

    Two layouts. Rows (any label but ``blocks``): one ``[clients, N]`` buffer whose row is a client's tensors
    side by side, in the order given; a tensor's view is strided. Buffers with equal labels' layouts (the
    parameters and each moment) line up element for element, so an optimizer rule runs on whole rows.
    ``blocks``: each tensor's ``[clients, ...]`` kept whole, one after another in a 1-D buffer, so its views
    are contiguous. Buffers the forward updates in place (batch norm's running statistics) must be
    contiguous: vmap's batch-norm rule writes a strided running mean into a copy and drops the update. A
    gather of blocks reads element positions computed from the clients' indices (cached per client count).
    """

    def __init__(self, tensors: dict[Any, Tensor], label: Callable[[Any], str] = lambda key: "rows"):
        self.clients = len(next(iter(tensors.values())))
        by_kind: dict[tuple, list] = {}
        for key, t in tensors.items():
            by_kind.setdefault((label(key), t.dtype, t.device), []).append(key)
        self.flats: dict[tuple, Tensor] = {}
        self.layout: dict[tuple, tuple[list, list[int], list[tuple[int, ...]]]] = {}
        for kind, keys in by_kind.items():
            shapes = [tuple(tensors[k].shape[1:]) for k in keys]
            if kind[0] == "blocks":
                self.flats[kind] = torch.cat([tensors[k].reshape(-1) for k in keys])
            else:
                self.flats[kind] = torch.cat([tensors[k].reshape(self.clients, -1) for k in keys], dim=1)
            self.layout[kind] = (keys, [math.prod(shape) for shape in shapes], shapes)
        self.blocks = {key for kind, (keys, _, _) in self.layout.items() if kind[0] == "blocks" for key in keys}
        self._positions: dict[tuple, tuple[Tensor, Tensor, Tensor]] = {}
        self._all = Selection(self.flats, self.clients, 0, self.clients)
        self._full = self._views(self._all)

    def select(self, first: int, count: int) -> Selection:
        return self._all if count == self.clients else Selection(self.flats, count, first, self.clients)

    def gather(self, index: Tensor) -> Selection:
        flats = {kind: flat.index_select(0, self._where(kind, index)) for kind, flat in self.flats.items()}
        return Selection(flats, len(index), 0, len(index), index)

    def scatter(self, selection: Selection) -> None:
        """Writes a gathered selection back (a selection of views needs nothing)."""
        if selection.index is not None:
            for kind, flat in self.flats.items():
                flat.index_copy_(0, self._where(kind, selection.index), selection.flats[kind])

    def views(self, selection: Selection | None = None, labels: tuple[str, ...] | None = None) -> dict[Any, Tensor]:
        """Views ``[m, ...]`` of every tensor in ``selection`` (all clients when None), or of ``labels``' tensors
        only (a step needs the buffers and counters as views; the rows it takes whole)."""
        return self._full if selection is None or selection is self._all else self._views(selection, labels)

    def rows(self, selection: Selection, label: str) -> dict[tuple, Tensor]:
        """The ``[m, N]`` buffers of ``label`` in ``selection``, by (dtype, device)."""
        out = {}
        for kind, flat in selection.flats.items():
            if kind[0] == label:
                whole = selection.whole == selection.count
                out[kind[1:]] = flat if whole else flat.narrow(0, selection.first, selection.count)
        return out

    def split(self, label: str, rows: dict[tuple, Tensor]) -> dict[Any, Tensor]:
        """Each tensor's view of ``label``'s buffers ``[..., N]`` (a client's row inside vmap): ``[..., *shape]``."""
        out = {}
        for kind, flat in rows.items():
            keys, sizes, shapes = self.layout[(label,) + kind]
            lead = flat.shape[:-1]
            for key, part, shape in zip(keys, flat.split(sizes, dim=-1), shapes):
                out[key] = part.view((*lead, *shape))  # a tuple: a 0-d tensor inside vmap has neither
        return out

    def _where(self, kind: tuple, index: Tensor) -> Tensor:
        """What to index ``kind``'s buffer with for the clients ``index``: rows, or element positions."""
        if kind[0] != "blocks":
            return index
        m = len(index)
        if (kind, m) not in self._positions:  # position of sub element q = base + client(member) * stride
            members, bases, strides, offset = [], [], [], 0
            for n in self.layout[kind][1]:
                members.append(torch.arange(m).repeat_interleave(n))
                bases.append(offset * self.clients + torch.arange(n).repeat(m))
                strides.append(torch.full((m * n,), n))
                offset += n
            member, base, stride = (torch.cat(part).to(index.device) for part in (members, bases, strides))
            self._positions[kind, m] = (member, base, stride)
        member, base, stride = self._positions[kind, m]
        return base + index[member] * stride

    def _views(self, selection: Selection, labels: tuple[str, ...] | None = None) -> dict[Any, Tensor]:
        m, first, whole = selection.count, selection.first, selection.whole
        views = {}
        for kind, (keys, sizes, shapes) in self.layout.items():
            if labels is not None and kind[0] not in labels:
                continue
            flat = selection.flats[kind]
            if kind[0] != "blocks":
                rows = flat if m == whole else flat.narrow(0, first, m)
                for key, part, shape in zip(keys, rows.split(sizes, dim=1), shapes):
                    views[key] = part.view(m, *shape)
            else:
                offset = 0
                for key, n, shape in zip(keys, sizes, shapes):
                    begin = offset * whole + first * n
                    views[key] = flat[begin : begin + m * n].view(m, *shape)
                    offset += n
        return views
