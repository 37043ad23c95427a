"""Weighted averaging of state dicts, streaming so only one client's weights are held at a time."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..federation.types import StateDict


class WeightedAverage:
    """Running weighted mean of state dicts: ``sum_k w_k * theta_k / sum_k w_k``.

    Sums are kept in float64 (complex128 for complex tensors) and cast back to each tensor's dtype at the
    end, so the result does not depend on client order beyond float64 rounding. Integer buffers
    (BatchNorm's ``num_batches_tracked``) are averaged and rounded. The tensors of one device and dtype
    are summed as one flat buffer: on a GPU adding a state is a concatenation and one add per buffer, two
    kernel launches instead of one per tensor; on a CPU the buffer is added a cache-sized block at a time
    (:func:`_add_by_blocks`). Each element's arithmetic is the same either way.
    """

    def __init__(self) -> None:
        self._sum: dict[tuple, torch.Tensor] | None = None  # (device, dtype) -> flat sums of those keys
        self._groups: dict[tuple, list[str]] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._shapes: dict[str, torch.Size] = {}
        self._sizes: dict[tuple, list[int]] = {}  # each group's tensors' lengths in its flat sum
        self._blocks: dict[tuple, list[Block]] = {}  # CPU groups: their flat sum's blocks (_add_by_blocks)
        self._scratch: dict[torch.dtype, torch.Tensor] = {}  # one block per sum dtype (CPU)
        self.total_weight = 0.0
        self.count = 0

    def add(self, state: StateDict, weight: float = 1.0) -> None:
        if weight <= 0:
            raise ValueError(f"averaging weight must be positive, got {weight}")
        with torch.no_grad():
            if self._sum is None:
                self._dtypes = {k: v.dtype for k, v in state.items()}
                self._shapes = {k: v.shape for k, v in state.items()}
                for k, v in state.items():
                    self._groups.setdefault((v.device, v.dtype), []).append(k)
                self._sizes = {group: [self._shapes[k].numel() for k in keys] for group, keys in self._groups.items()}
                self._sum = {
                    group: _flat(state, keys).to(torch.promote_types(group[1], torch.float64)) * weight
                    for group, keys in self._groups.items()
                }
                self._blocks = {group: blocks(self._sizes[group]) for group in self._groups if group[0].type == "cpu"}
            else:
                if state.keys() != self._dtypes.keys():
                    raise ValueError("cannot average state dicts with different keys (different architectures?)")
                wrong = [k for k, v in state.items() if v.shape != self._shapes[k]]  # flat sums would not see it
                if wrong:
                    raise ValueError(
                        f"cannot average {wrong[0]!r}: shape {tuple(state[wrong[0]].shape)} differs from the first "
                        f"state's {tuple(self._shapes[wrong[0]])} (different architectures?)"
                    )
                for group, keys in self._groups.items():  # promoted to the sum's dtype inside the add
                    if all((state[k].device, state[k].dtype) == group for k in keys):
                        self._add_group(group, [state[k] for k in keys], weight)
                    else:  # a tensor of another dtype or device than the first state's: each on its own
                        for k, part in zip(keys, self._sum[group].split(self._sizes[group]), strict=True):
                            part.add_(state[k].reshape(-1), alpha=weight)
        self.total_weight += weight
        self.count += 1

    def _add_group(self, group: tuple, tensors: list[torch.Tensor], weight: float) -> None:
        total = self._sum[group]
        if group not in self._blocks:  # a GPU: two launches
            total.add_(torch.cat([t.reshape(-1) for t in tensors]), alpha=weight)
            return
        if total.dtype not in self._scratch:
            self._scratch[total.dtype] = torch.empty(BLOCK, dtype=total.dtype)
        _add_by_blocks(total, tensors, weight, self._blocks[group], self._scratch[total.dtype])

    def result(self) -> StateDict:
        if self._sum is None:
            raise ValueError("no state dict was added")
        out = {}
        for group, keys in self._groups.items():
            for k, flat in zip(keys, (self._sum[group] / self.total_weight).split(self._sizes[group]), strict=True):
                dtype = self._dtypes[k]
                mean = flat.view(self._shapes[k])
                # a copy even where the dtype is the sum's: results must not share the sums' storage
                out[k] = (mean if dtype.is_floating_point or dtype.is_complex else mean.round()).to(dtype, copy=True)
        return {k: out[k] for k in self._dtypes}  # the state dict's key order


def _flat(state: StateDict, keys: list[str]) -> torch.Tensor:
    """The tensors of ``keys`` as one flat tensor (a copy)."""
    return torch.cat([state[k].reshape(-1) for k in keys])


BLOCK = 1 << 16
"""Elements of a CPU sum added at a time: 512 KiB of float64, in a core's cache. A multiple of every SIMD
width, so that each block's vectorised part and remainder fall where one add over the whole buffer puts them."""

Block = tuple[int, int, list[tuple[int, int, int, int]]]
"""(start in the flat sum, length, pieces: (tensor index, start in the tensor, start in the block, count))."""


def blocks(sizes: list[int], block: int = BLOCK) -> list[Block]:
    """The flat concatenation of tensors of ``sizes`` cut into blocks of ``block`` elements (the last shorter),
    each with the pieces of the tensors it holds."""
    plan, pieces, start, fill = [], [], 0, 0
    for index, size in enumerate(sizes):
        offset = 0
        while offset < size:
            count = min(size - offset, block - fill)
            pieces.append((index, offset, fill, count))
            offset, fill = offset + count, fill + count
            if fill == block:
                plan.append((start, fill, pieces))
                start, pieces, fill = start + fill, [], 0
    if fill:
        plan.append((start, fill, pieces))
    return plan


def _add_by_blocks(
    total: torch.Tensor, tensors: list[torch.Tensor], weight: float, plan: list[Block], scratch: torch.Tensor
) -> None:
    """``total += weight * cat(tensors)`` one block at a time: each block's pieces are cast into ``scratch`` (in
    cache) and added with one ``add_``. A whole-buffer add would write the cast copy to memory and read it back
    (two 13 MB passes at 1.6 M parameters); the arithmetic of every element is that add's."""
    flats = [t.reshape(-1) for t in tensors]
    for start, length, pieces in plan:
        for index, offset, at, count in pieces:
            scratch[at : at + count].copy_(flats[index][offset : offset + count])
        total[start : start + length].add_(scratch[:length], alpha=weight)


def weighted_average(states: Iterable[StateDict], weights: Iterable[float]) -> StateDict:
    """The weighted mean of ``states`` (see :class:`WeightedAverage`)."""
    avg = WeightedAverage()
    for state, weight in zip(states, weights, strict=True):
        avg.add(state, weight)
    return avg.result()
