"""MergedCodist: Lichtarge et al., federated codistillation (paper 002), Algorithm 2 and eq. 2."""

from __future__ import annotations

from collections.abc import Iterator

from ..federation.bounds import Fraction01
from ..federation.types import ClientUpdate
from ..knowledge.server_optim import global_norm, merge_gradients
from .codistillation import Codistillation, CodistillationPools


class MergedCodist(CodistillationPools):
    """Two FedAdam pools whose server update merges the FedAvg and the distillation directions each round.

    Each round: average the clients into the pseudo-gradient ``g`` per pool; distill students from the
    current models (teachers: frozen copies of the other pool) for ``distillation.steps`` steps; take
    the distillation gradient ``delta = theta - theta_student``; feed FedAdam
    ``alpha * g + (1 - alpha) * delta * ||g|| / ||delta||`` (eq. 2). ``alpha = 1`` is FedAdam exactly.

    Args:
        alpha: the merging factor in [0, 1].
        (small_role, large_role, distillation, server optimizer settings, clients_per_round: as PeriodicCodist)
    """

    def __init__(
        self,
        small_role: str = "small",
        large_role: str = "large",
        alpha: Fraction01 = 0.5,
        distillation: Codistillation | None = None,
        **kwargs,
    ):
        super().__init__(small_role, large_role, distillation, **kwargs)
        self.alpha = alpha

    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        averages = self.client_averages(updates)
        students = self.students(rnd)
        metrics = {}
        for role, average in averages.items():
            g = self.pseudo_gradient(role, average)
            delta = {k: self.state.global_weights[role][k] - students[role][k] for k in g}
            metrics[f"server/{role}/distill_to_fedavg_norm"] = float(
                global_norm(delta) / global_norm(g).clamp_min(1e-12)
            )
            self.apply(role, merge_gradients(g, delta, self.alpha), average, rnd)
        return metrics
