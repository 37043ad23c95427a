"""Client samplers: which clients take part in a round."""

from __future__ import annotations

import numpy as np

from .bounds import Bounded, PositiveFraction, PositiveInt
from .errors import ConfigError
from .types import ClientSpec


class ClientSampler:
    """Chooses the round's clients. ``rng`` is derived from (seed, round), so sampling is resumable."""

    def sample(self, rnd: int, clients: list[ClientSpec], rng: np.random.Generator) -> list[ClientSpec]:
        raise NotImplementedError


class UniformSampler(Bounded, ClientSampler):
    """Draws clients uniformly without replacement.

    Args:
        fraction: share of eligible clients per round (used when ``num_per_round`` is not set).
        num_per_round: exact number of clients per round.
        tiers: only clients of these tiers are eligible (e.g. ``[strong]`` for the strong-only baseline).
    """

    name = "sampler"  # in messages: sampler fraction must be in (0, 1], got 2.0.

    def __init__(
        self, fraction: PositiveFraction = 1.0, num_per_round: PositiveInt | None = None, tiers: list[str] | None = None
    ):
        self.fraction = fraction
        self.num_per_round = num_per_round
        self.tiers = tiers

    def sample(self, rnd, clients, rng):
        # no copy of the population per round without a tier filter (10,000+ clients)
        eligible = clients if self.tiers is None else [c for c in clients if c.tier in self.tiers]
        if not eligible:
            raise ConfigError(f"no client belongs to the sampler's tiers {self.tiers}; check population.tiers names.")
        k = self.num_per_round if self.num_per_round is not None else max(1, round_half(self.fraction * len(eligible)))
        if not 1 <= k <= len(eligible):
            raise ConfigError(
                f"cannot sample {k} clients per round from {len(eligible)} eligible clients; lower the sampler's "
                "num_per_round or add clients."
            )
        chosen = np.sort(rng.choice(len(eligible), k, replace=False))
        return [eligible[i] for i in chosen]


def round_half(value: float) -> int:
    return int(np.floor(value + 0.5))
