"""FedGH's server-side training of the global prediction header on clients' class representations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def header_step(header: nn.Linear, representations: Tensor, labels: Tensor, lr: float) -> float:
    """One SGD step of cross-entropy (mean over the rows) on representations ``[S, D]`` with labels ``[S]``.

    Returns the loss before the step.
    """
    header.zero_grad(set_to_none=True)
    loss = F.cross_entropy(header(representations), labels)
    loss.backward()
    with torch.no_grad():
        for p in header.parameters():
            assert p.grad is not None, "every header parameter is in the loss"
            p.sub_(lr * p.grad)
    return loss.item()


def train_header(header: nn.Linear, representations: Tensor, labels: Tensor, lr: float, per_lar: bool) -> list[float]:
    """Trains the header on one client's LARs ``[S, D]``; returns the loss before each step.

    ``per_lar``: one SGD step per LAR, in row order (FedGH eq. 4 and Algorithm 1 write the step for one
    representation ``R_k^{t,s}`` with its label s; the official code feeds one LAR at a time); otherwise
    one step on the mean loss over the client's LARs.
    """
    if not per_lar:
        return [header_step(header, representations, labels, lr)]
    return [header_step(header, representations[i : i + 1], labels[i : i + 1], lr) for i in range(len(labels))]
