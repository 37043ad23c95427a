"""Weighted averaging of state dicts, streaming so only one client's weights are held at a time."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..types import StateDict


class WeightedAverage:
    """Running weighted mean of state dicts: ``sum_k w_k * theta_k / sum_k w_k``.

    Sums are kept in float64 and cast back to each tensor's dtype at the end, so the result does not
    depend on client order beyond float64 rounding. Integer buffers (BatchNorm's
    ``num_batches_tracked``) are averaged and rounded.
    """

    def __init__(self) -> None:
        self._sum: dict[str, torch.Tensor] | None = None
        self._dtypes: dict[str, torch.dtype] = {}
        self.total_weight = 0.0
        self.count = 0

    def add(self, state: StateDict, weight: float = 1.0) -> None:
        if weight <= 0:
            raise ValueError(f"averaging weight must be positive, got {weight}")
        with torch.no_grad():
            if self._sum is None:
                self._dtypes = {k: v.dtype for k, v in state.items()}
                self._sum = {k: v.to(torch.float64) * weight for k, v in state.items()}
            else:
                if state.keys() != self._sum.keys():
                    raise ValueError("cannot average state dicts with different keys (different architectures?)")
                # one call for every tensor; each is promoted to float64 inside the add, exactly as by .to(float64)
                torch._foreach_add_(list(self._sum.values()), [state[k] for k in self._sum], alpha=weight)
        self.total_weight += weight
        self.count += 1

    def result(self) -> StateDict:
        if self._sum is None:
            raise ValueError("no state dict was added")
        out = {}
        for k, s in self._sum.items():
            mean = s / self.total_weight
            dtype = self._dtypes[k]
            out[k] = (mean if dtype.is_floating_point else mean.round()).to(dtype)
        return out


def weighted_average(states: Iterable[StateDict], weights: Iterable[float]) -> StateDict:
    """The weighted mean of ``states`` (see :class:`WeightedAverage`)."""
    avg = WeightedAverage()
    for state, weight in zip(states, weights, strict=True):
        avg.add(state, weight)
    return avg.result()
