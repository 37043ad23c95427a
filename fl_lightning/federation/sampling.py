"""Client samplers: which clients take part in a round."""

from __future__ import annotations

import numpy as np

from .bounds import Bounded, PositiveFraction, PositiveInt
from .errors import ConfigError
from .types import ClientSpec


class ClientSampler:
    """Chooses the round's clients. ``rng`` is derived from (seed, round), so sampling is resumable."""

    may_be_empty = False
    """Whether a round may sample no client at all (the orchestrator then skips its aggregation)."""

    def sample(self, rnd: int, clients: list[ClientSpec], rng: np.random.Generator) -> list[ClientSpec]:
        raise NotImplementedError

    def inclusion(self, clients: list[ClientSpec]) -> dict[int, float]:
        """Each client's probability of being sampled in a round, by client id. Central differential privacy
        divides the noised sum of a round's uploads by the expected number of them (the sum of these), a number
        fixed before the round, where the number received would tell who took part. A sampler that cannot say
        raises ``NotImplementedError`` (central privacy is then refused)."""
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

    def inclusion(self, clients):
        eligible = {c.id for c in clients if self.tiers is None or c.tier in self.tiers}
        k = self.num_per_round if self.num_per_round is not None else max(1, round_half(self.fraction * len(eligible)))
        share = min(k, len(eligible)) / len(eligible) if eligible else 0.0  # k of the eligible, each alike
        return {c.id: share if c.id in eligible else 0.0 for c in clients}


class PoissonSampler(Bounded, ClientSampler):
    """Takes each eligible client independently with probability ``rate`` (Poisson sampling).

    The number of clients varies from round to round and may be zero (the server then keeps its state). This is
    the sampler under which differential privacy's accountant counts amplification by subsampling: one client's
    presence in a round is a coin flip the server cannot steer.

    Args:
        rate: probability that a client takes part in a round, in (0, 1].
        tiers: only clients of these tiers are eligible.
    """

    name = "sampler"  # in messages: sampler rate must be in (0, 1], got 2.0.
    may_be_empty = True

    def __init__(self, rate: PositiveFraction = 0.5, tiers: list[str] | None = None):
        self.rate = rate
        self.tiers = tiers

    def sample(self, rnd, clients, rng):
        eligible = clients if self.tiers is None else [c for c in clients if c.tier in self.tiers]
        if not eligible:
            raise ConfigError(f"no client belongs to the sampler's tiers {self.tiers}; check population.tiers names.")
        taken = rng.uniform(size=len(eligible)) < self.rate
        return [client for client, take in zip(eligible, taken, strict=True) if take]

    def inclusion(self, clients):
        return {c.id: float(self.rate) if self.tiers is None or c.tier in self.tiers else 0.0 for c in clients}


def round_half(value: float) -> int:
    return int(np.floor(value + 0.5))
