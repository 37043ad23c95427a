"""FedAdam: Reddi et al., "Adaptive Federated Optimization", ICLR 2021 (Algorithm 2, Adam server)."""

from __future__ import annotations

from collections.abc import Iterator

from ..federation.errors import ConfigError
from ..federation.schedules import linear_decay
from ..federation.types import ClientUpdate, StateDict
from ..knowledge import WeightedAverage
from ..knowledge.server_optim import ServerAdam
from .base import ServerContext
from .fedavg import FedAvg


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

    state_attributes = ("global_weights", "server_optimizers")

    def __init__(
        self,
        roles: list[str] | None = None,
        weighted: bool = True,
        server_lr: float | dict[str, float] = 0.01,
        server_lr_final: float = 1.0,
        beta1: float = 0.9,
        beta2: float = 0.999,
        eps: float = 1e-5,
        clients_per_round: dict[str, int] | None = None,
    ):
        super().__init__(roles, weighted, clients_per_round)
        name = type(self).__name__  # MergedCodist and PeriodicCodist take these options through **kwargs
        rates = server_lr.values() if isinstance(server_lr, dict) else [server_lr]
        if not all(rate > 0 for rate in rates) or not server_lr_final >= 0:
            raise ConfigError(
                f"{name} needs server_lr > 0 and server_lr_final >= 0; got server_lr={server_lr}, "
                f"server_lr_final={server_lr_final}."
            )
        if not (0 <= beta1 < 1 and 0 <= beta2 < 1 and eps > 0):
            raise ConfigError(
                f"{name} needs 0 <= beta1 < 1, 0 <= beta2 < 1 and eps > 0; got beta1={beta1}, beta2={beta2}, eps={eps}."
            )
        self.server_lr, self.server_lr_final = server_lr, server_lr_final
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        missing = [r for r in self.roles if isinstance(self.server_lr, dict) and r not in self.server_lr]
        if missing:
            raise ConfigError(
                f"{type(self).__name__} server_lr gives no rate for role(s) {missing}; give one per role "
                f"({', '.join(self.roles)}) or a single number."
            )
        self.server_optimizers = {r: ServerAdam(self.beta1, self.beta2, self.eps) for r in self.roles}
        self.param_keys = {r: server.parameter_names(r) for r in self.roles}

    def lr(self, role: str, rnd: int) -> float:
        base = self.server_lr[role] if isinstance(self.server_lr, dict) else self.server_lr
        return base * linear_decay(self.server.progress(rnd), self.server_lr_final)

    def client_averages(self, updates) -> dict[str, StateDict]:
        """The round's averaged client weights per role (streaming)."""
        averages = {role: WeightedAverage() for role in self.roles}
        for update in updates:
            for role, payload in update.uplink.items():
                averages[role].add(payload.state, update.num_samples if self.weighted else 1.0)
        return {role: a.result() for role, a in averages.items() if a.count}

    def pseudo_gradient(self, role: str, average: StateDict) -> StateDict:
        current = self.global_weights[role]
        return {k: current[k] - average[k] for k in self.param_keys[role]}

    def apply(self, role: str, gradient: StateDict, average: StateDict, rnd: int) -> None:
        """Adam step on the parameters; buffers are set to the clients' average; a frozen part (never sent) stays."""
        stepped = self.server_optimizers[role].step(self.global_weights[role], gradient, self.lr(role, rnd))
        self.global_weights[role] = {**self.global_weights[role], **{k: stepped.get(k, average[k]) for k in average}}

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "train") -> dict[str, float]:
        for role, average in self.client_averages(updates).items():
            self.apply(role, self.pseudo_gradient(role, average), average, rnd)
        return {}
