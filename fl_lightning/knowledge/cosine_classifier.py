"""A classifier of fixed class vectors: cosine logits with a learnable scale (FedETF's ETF, FedNH's prototypes)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Scale(nn.Module):
    """The learnable scale (FedETF's temperature beta, FedNH's s): one scalar trained beside the model, a helper
    of the fit (``ctx.helper``)."""

    def __init__(self, value: float = 1.0):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(float(value)))


def cosine_logits(outputs: Tensor, vectors: Tensor, scale: Tensor) -> Tensor:
    """``scale * normalize(outputs) @ vectors^T``: each row of ``outputs`` ``[B, D]`` normalised against the class
    vectors ``[C, D]`` (unit rows), scaled."""
    return scale * F.normalize(outputs, dim=1) @ vectors.T
