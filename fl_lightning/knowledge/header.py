"""FedGH's server-side training of the global prediction header on clients' class representations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def header_step(header: nn.Linear, representations: Tensor, labels: Tensor, lr: float) -> float:
    """One SGD step of cross-entropy on one client's LARs ``[S, D]`` with their labels ``[S]``.

    Returns the loss before the step. (FedGH Algorithm 1: one update per client's LARs, in arrival
    order, with learning rate eta_g; the official code never zeroes gradients and steps another
    optimizer, so its header stays at initialisation.)
    """
    header.zero_grad(set_to_none=True)
    loss = F.cross_entropy(header(representations), labels)
    loss.backward()
    with torch.no_grad():
        for p in header.parameters():
            p.sub_(lr * p.grad)
    return loss.item()
