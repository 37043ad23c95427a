"""Server optimizers over pseudo-gradients (Reddi et al., "Adaptive Federated Optimization", 2021)."""

from __future__ import annotations

from typing import Literal

import torch

from ..federation.types import StateDict


def global_norm(tensors: StateDict) -> torch.Tensor:
    squares = [(t.double() ** 2).sum() for t in tensors.values()]
    return torch.sqrt(sum(squares[1:], squares[0]))


def merge_gradients(fedavg_grad: StateDict, distill_grad: StateDict, alpha: float) -> StateDict:
    """Paper 002 eq. 2: ``alpha * g + (1 - alpha) * delta * ||g|| / ||delta||`` (global L2 norms).

    With ``alpha = 1`` this returns ``g`` exactly. A zero ``delta`` contributes nothing.
    """
    if alpha == 1.0:
        return fedavg_grad
    g_norm, d_norm = global_norm(fedavg_grad), global_norm(distill_grad)
    scale = (1 - alpha) * (g_norm / d_norm if d_norm > 0 else 0.0)
    return {k: (alpha * g.double() + scale * distill_grad[k].double()).to(g.dtype) for k, g in fedavg_grad.items()}


class ServerAdam:
    """FedAdam's server update on a pseudo-gradient ``g = theta - mean(client thetas)``.

    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, ``theta <- theta - lr * m / (sqrt(v) + eps)``
    (Reddi et al. Algorithm 2, no bias correction). Paper 002 uses b1 0.9, b2 0.999, eps 1e-5.
    """

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-5):
        self.beta1, self.beta2, self.eps = beta1, beta2, eps
        self.m: StateDict = {}
        self.v: StateDict = {}

    def step(self, params: StateDict, grad: StateDict, lr: float) -> StateDict:
        out = {}
        for k, g in grad.items():
            if k not in self.m:
                self.m[k], self.v[k] = torch.zeros_like(g), torch.zeros_like(g)
            elif self.m[k].device != g.device:  # restored from a checkpoint (on the CPU) into a run on a GPU
                self.m[k], self.v[k] = self.m[k].to(g.device), self.v[k].to(g.device)
            self.m[k].mul_(self.beta1).add_(g, alpha=1 - self.beta1)
            self.v[k].mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
            out[k] = params[k] - lr * self.m[k] / (self.v[k].sqrt() + self.eps)
        return out

    def reset(self) -> None:
        """Forgets the moments (PeriodicCodist does this after replacing the models)."""
        self.m, self.v = {}, {}

    def state_dict(self) -> dict:
        return {"m": self.m, "v": self.v}

    def load_state_dict(self, state: dict) -> None:
        self.m, self.v = state["m"], state["v"]


ServerOptimizer = Literal["adam", "sgd"]


def server_optimizer(kind: ServerOptimizer, lr: float):
    """A factory of a server model's optimizer: ``adam``, or ``sgd`` with momentum 0.9 (FedGEMS, FedGKT)."""
    if kind == "adam":
        return lambda params: torch.optim.Adam(params, lr=lr)
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=0.9)
