"""PeriodicCodist: Lichtarge et al., federated codistillation (paper 002), Algorithm 1."""

from __future__ import annotations

from collections.abc import Iterator

from ..federation.bounds import PositiveInt
from ..federation.types import ClientUpdate
from .base import ServerContext
from .codistillation import Codistillation
from .fedadam import FedAdam


class PeriodicCodist(FedAdam):
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
        super().__init__([small_role, large_role], **kwargs)  # FedAdam's server optimizer options
        self.pools = (small_role, large_role)
        self.period, self.reset_server_optimizer = period, reset_server_optimizer
        self.distillation = distillation or Codistillation()

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        self.distillation.check_roles(self.name, self.pools)
        self.server_x = server.server_inputs()

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate], phase: str = "train") -> dict[str, float]:
        super().aggregate(rnd, updates, phase)
        if rnd % self.period:
            return {}
        generator = self.server.round_generator()
        students = self.distillation.run(
            self.server,
            self.state.global_weights,
            self.pools,
            self.server_x,
            self.server.progress(rnd),
            generator,
        )
        self.state.global_weights.update(students)
        if self.reset_server_optimizer:
            for optimizer in self.state.server_optimizers.values():
                optimizer.reset()
        return {"server/codistilled": 1.0}
