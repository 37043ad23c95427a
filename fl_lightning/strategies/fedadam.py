"""FedAdam: Reddi et al., "Adaptive Federated Optimization", ICLR 2021 (Algorithm 2, Adam server)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

from ..federation.bounds import Interval, NonNegative, Positive
from ..federation.errors import ConfigError
from ..federation.schedules import linear_decay
from ..federation.types import ClientUpdate, Role, StateDict
from ..knowledge.server_optim import ServerAdam
from .base import ServerContext
from .fedavg import FedAvg, FedAvgState


@dataclass
class FedAdamState(FedAvgState):
    """FedAvg's global weights and, per role, the server optimizer's moments."""

    server_optimizers: dict[Role, ServerAdam]


class FedAdam(FedAvg):
    """FedAvg's client update with an Adam server optimizer per role.

    The server averages the clients' weights, takes the pseudo-gradient ``g = theta - average`` of the
    trainable parameters and applies ``ServerAdam`` with learning rate ``server_lr`` decayed linearly
    to ``server_lr * server_lr_final`` over the rounds (paper 002: b1 0.9, b2 0.999, eps 1e-5, tuned
    server rate, linear decay). Buffers (BatchNorm statistics) take the plain average.

    Args:
        server_lr: server learning rate, or one per role (``{small: 0.01, large: 0.003}``).
        server_lr_final: the rate in the last round as a fraction of ``server_lr`` (1: no decay).
        beta1, beta2, eps: Adam's constants.
        (roles, weighted, clients_per_round: as FedAvg)
    """

    state: FedAdamState

    def __init__(
        self,
        roles: list[str] | None = None,
        weighted: bool = True,
        server_lr: Positive | dict[str, Positive] = 0.01,
        server_lr_final: NonNegative = 1.0,
        beta1: Annotated[float, Interval(ge=0, lt=1)] = 0.9,
        beta2: Annotated[float, Interval(ge=0, lt=1)] = 0.999,
        eps: Positive = 1e-5,
        clients_per_round: dict[str, int] | None = None,
    ):
        super().__init__(roles, weighted, clients_per_round)
        self.server_lr, self.server_lr_final = server_lr, server_lr_final
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        missing = [r for r in self.roles if isinstance(self.server_lr, dict) and r not in self.server_lr]
        if missing:
            raise ConfigError(
                f"{self.name} server_lr gives no rate for role(s) {missing}; give one per role "
                f"({', '.join(self.roles)}) or a single number."
            )
        optimizers = {r: ServerAdam(self.beta1, self.beta2, self.eps) for r in self.roles}
        self.state = FedAdamState(**vars(self.state), server_optimizers=optimizers)
        self.param_keys = {r: server.parameter_names(r) for r in self.roles}

    def lr(self, role: str, rnd: int) -> float:
        base = self.server_lr[role] if isinstance(self.server_lr, dict) else self.server_lr
        return base * linear_decay(self.server.progress(rnd), self.server_lr_final)

    def pseudo_gradient(self, role: str, average: StateDict) -> StateDict:
        """``g = theta - average`` on the role's trainable parameters."""
        current = self.state.global_weights[role]
        return {k: current[k] - average[k] for k in self.param_keys[role]}

    def apply(self, role: str, gradient: StateDict, average: StateDict, rnd: int) -> None:
        """Adam step on the parameters; buffers are set to the clients' average; a frozen part (never sent) stays."""
        weights = self.state.global_weights
        stepped = self.state.server_optimizers[role].step(weights[role], gradient, self.lr(role, rnd))
        weights[role] = {**weights[role], **{k: stepped.get(k, average[k]) for k in average}}

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        for role, average in self.client_averages(updates).items():
            self.apply(role, self.pseudo_gradient(role, average), average, rnd)
        return {}
