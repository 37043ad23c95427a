"""Low-rank compression of model updates by truncated SVD with an energy threshold (FedKD, Wu et al. 2022).

Each update matrix ``M = U diag(s) V^T`` is sent as its top-k factors, k the fewest singular values whose
energy ``sum_{i<k} s_i^2`` exceeds ``T`` times the total. Tensors of more than two dimensions (convolution
kernels ``[out, in, kh, kw]``) are compressed as ``[out, in x kh x kw]`` matrices; vectors, scalars and
all-zero matrices are sent as they are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..federation.types import Payload, StateDict, tensor_bytes


def energy_rank(singular_values: Tensor, energy: float) -> int:
    """The fewest leading singular values whose squared sum exceeds ``energy`` x the total (all of them if
    none does, e.g. ``energy = 1``). The official code's loop never tries all of them, so a matrix whose
    threshold needs every singular value is dropped there; here it is kept whole."""
    squares = singular_values.double().pow(2)
    above = torch.nonzero(squares.cumsum(0) > energy * squares.sum())
    return int(above[0]) + 1 if len(above) else len(singular_values)


def energy_threshold(rnd: int, rounds: int, start: float, end: float) -> float:
    """``T(r) = start + r / R x (end - start)`` for round r of R (from 1): the official code's
    ``tmin + (1 + comm_round) / epochs x (tmax - tmin)`` with its 0-based ``comm_round``."""
    return start + rnd / rounds * (end - start)


@dataclass
class LowRankUpdate(Payload):
    """A model update: matrices as truncated SVD factors, every other tensor as it is.

    Attributes:
        kind: the payload's name in the ledger.
        factors: name -> ``[U [m, k], s [k], Vh [k, n]]`` of the update as an ``[m, n]`` matrix.
        dense: name -> tensor sent uncompressed.
        shapes: name -> the compressed tensor's shape (fixed by the architecture, known to both sides: not
            counted).
    """

    kind: str
    factors: dict[str, list[Tensor]]
    dense: StateDict
    shapes: dict[str, list[int]]

    @property
    def nbytes(self) -> int:
        return tensor_bytes(self.dense) + sum(tensor_bytes(f) for f in self.factors.values())

    def reconstruct(self) -> StateDict:
        """The update the factors stand for (``U diag(s) Vh`` reshaped), and the dense tensors."""
        out = dict(self.dense)
        for name, (u, s, vh) in self.factors.items():
            out[name] = ((u * s) @ vh).reshape(self.shapes[name])
        return out

    def state_dict(self) -> dict:
        """Plain tensors and containers (server state must load with ``weights_only``)."""
        return {"kind": self.kind, "factors": self.factors, "dense": self.dense, "shapes": self.shapes}

    @classmethod
    def from_state(cls, state: dict) -> LowRankUpdate:
        return cls(state["kind"], state["factors"], state["dense"], state["shapes"])


def compress(kind: str, update: StateDict, energy: float | None) -> LowRankUpdate:
    """``update`` with every non-zero matrix replaced by its truncated SVD at ``energy``; ``None`` sends
    everything dense (no compression)."""
    factors, dense, shapes = {}, {}, {}
    for name, tensor in update.items():
        if energy is None or tensor.dim() < 2 or not bool(tensor.any()):
            dense[name] = tensor
            continue
        u, s, vh = torch.linalg.svd(tensor.reshape(tensor.shape[0], -1), full_matrices=False)
        k = energy_rank(s, energy)
        factors[name] = [u[:, :k].contiguous(), s[:k].contiguous(), vh[:k].contiguous()]
        shapes[name] = list(tensor.shape)
    return LowRankUpdate(kind, factors, dense, shapes)
