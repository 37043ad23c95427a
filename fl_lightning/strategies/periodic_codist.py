"""PeriodicCodist: Lichtarge et al., federated codistillation (paper 002), Algorithm 1."""

from __future__ import annotations

from collections.abc import Iterator

from ..federation.bounds import PositiveInt
from ..federation.types import ClientUpdate
from .codistillation import Codistillation, CodistillationPools


class PeriodicCodist(CodistillationPools):
    """Two FedAdam pools that exchange knowledge by server-side codistillation every ``period`` rounds.

    All clients train the small model; high-capacity clients (the tiers that also list the large role)
    train the large one. Every ``period`` rounds the server distills each model from a frozen copy of
    the other on its unlabeled set (``data.server_fraction``) for ``distillation.steps`` steps, replaces
    both models by the students and resets the FedAdam moments (``reset_server_optimizer``).

    Args:
        small_role, large_role: the two pools' roles.
        period: p, rounds between codistillation rounds.
        distillation: steps, batch size, learning rates, temperatures and student regularization.
        reset_server_optimizer: forget the Adam moments after replacing the models.
        (server_lr, server_lr_final, beta1, beta2, eps, weighted, clients_per_round: as FedAdam)
    """

    def __init__(
        self,
        small_role: str = "small",
        large_role: str = "large",
        period: PositiveInt = 5,
        distillation: Codistillation | None = None,
        reset_server_optimizer: bool = True,
        **kwargs,
    ):
        super().__init__(small_role, large_role, distillation, **kwargs)
        self.period, self.reset_server_optimizer = period, reset_server_optimizer

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        super(CodistillationPools, self).aggregate(rnd, updates)  # FedAdam's
        if rnd % self.period:
            return {}
        self.state.global_weights.update(self.students(rnd))
        if self.reset_server_optimizer:
            for optimizer in self.state.server_optimizers.values():
                optimizer.reset()
        return {"server/codistilled": 1.0}
