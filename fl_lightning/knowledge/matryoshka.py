"""FedMRL's adaptive representation fusion and Matryoshka heads (Yi et al., NeurIPS 2024).

A client holds a shared small model (representation size ``d1``) beside its own heterogeneous one (``d2``). A
per-client projector fuses their representations, ``fused = W [r_global ‖ r_local] + b`` (``d1 + d2 -> d2``), and
two heads read nested parts of the fused vector: the local head all ``d2`` dimensions, the small model's head the
first ``d1`` (the Matryoshka representation: coarse inside fine).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def projector(global_dim: int, local_dim: int) -> nn.Linear:
    """The fusion projector: ``[B, d1 + d2] -> [B, d2]``, global representation first."""
    return nn.Linear(global_dim + local_dim, local_dim)


def fuse(projector: nn.Module, global_rep: Tensor, local_rep: Tensor) -> Tensor:
    """The fused representation ``[B, d2]`` of ``global_rep`` ``[B, d1]`` and ``local_rep`` ``[B, d2]``."""
    return projector(torch.cat((global_rep, local_rep), dim=1))


def matryoshka_losses(
    fused: Tensor, labels: Tensor, local_head: nn.Module, global_head: nn.Module, global_dim: int
) -> tuple[Tensor, Tensor]:
    """The two heads' cross-entropies on the fused representation ``[B, d2]``: the local head's on all of it and
    the small model's head's on its first ``global_dim`` dimensions. Their sum is FedMRL's loss."""
    local_loss = F.cross_entropy(local_head(fused), labels)
    global_loss = F.cross_entropy(global_head(fused[:, :global_dim]), labels)
    return local_loss, global_loss


class FusedModel(nn.Module):
    """A FedMRL client's inference model: its local head on the fused representation of the small model's and its
    own model's features (``[B, ...] -> [B, C]``).

    The modules are held, not copied: loading a state dict (keys ``global_model.*``, ``local_model.*``,
    ``projector.*``) loads it into them.

    Args:
        global_model: the small shared model (``features``: ``[B, d1]``).
        local_model: the client's own model (``features``: ``[B, d2]``, ``head``: ``[B, d2] -> [B, C]``).
        projector: ``[B, d1 + d2] -> [B, d2]``.
    """

    def __init__(self, global_model: nn.Module, local_model: nn.Module, projector: nn.Module):
        super().__init__()
        self.global_model, self.local_model, self.projector = global_model, local_model, projector

    def forward(self, x: Tensor) -> Tensor:
        fused = fuse(self.projector, self.global_model.features(x), self.local_model.features(x))
        return self.local_model.head(fused)
