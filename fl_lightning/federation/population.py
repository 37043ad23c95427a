"""Clients, tiers and the model roles each tier trains."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .errors import ConfigError
from .types import ClientSpec, Role


@dataclass
class Tier:
    """A group of clients with the same compute budget.

    Attributes:
        name: e.g. ``weak``, ``strong`` or one name per architecture.
        roles: the model roles (keys of ``models``) these clients train.
        fraction: share of the population in this tier; the last tier without ``fraction`` or
            ``count`` takes the rest.
        count: exact number of clients (overrides ``fraction``).
    """

    name: str
    roles: list[str]
    fraction: float | None = None
    count: int | None = None

    def __post_init__(self):
        if not self.roles:
            raise ConfigError(
                f"tier {self.name!r} has no roles; give it at least one model role, e.g. roles: [global]."
            )
        if self.fraction is not None and not 0.0 < self.fraction <= 1.0:
            raise ConfigError(f"tier {self.name!r}: fraction must be in (0, 1], got {self.fraction}.")
        if self.count is not None and self.count < 0:
            raise ConfigError(f"tier {self.name!r}: count must be at least 0, got {self.count}.")


@dataclass
class Population:
    """The federation's clients and their tiers.

    Attributes:
        num_clients: total number of clients.
        tiers: the tiers; one tier ``all`` training role ``global`` by default.
        assignment: how client ids map to tiers: ``contiguous`` (tier 0 gets ids 0..n0-1, as paper 001's
            code makes clients 0-19 strong), ``interleaved`` (client k in tier k mod T, as FedGH gives
            client k CNN-((k mod 5)+1)), ``cyclic`` (client k in tier k mod T for any number of clients, the
            tiers' sizes following from it, so they give no count or fraction: HtFLlib's ``models[k % n]``)
            or ``random`` (seeded by the run seed).
    """

    num_clients: int = 20
    tiers: list[Tier] = field(default_factory=lambda: [Tier(name="all", roles=["global"])])
    assignment: Literal["contiguous", "interleaved", "cyclic", "random"] = "contiguous"

    def build(self, seed: int) -> list[ClientSpec]:
        """The clients, each with its tier and roles."""
        counts = self.tier_counts()
        if self.assignment == "contiguous":
            tier_of = np.repeat(np.arange(len(self.tiers)), counts)
        elif self.assignment == "interleaved":
            tier_of = np.array(_interleave(counts))
        elif self.assignment == "cyclic":
            tier_of = np.arange(self.num_clients) % len(self.tiers)
        elif self.assignment == "random":
            tier_of = np.random.default_rng(seed).permutation(np.repeat(np.arange(len(self.tiers)), counts))
        else:  # only code that bypasses the parser, which refuses any other value, gets here
            raise ValueError(f"unknown population.assignment {self.assignment!r}")
        return [ClientSpec(i, self.tiers[t].name, tuple(self.tiers[t].roles)) for i, t in enumerate(tier_of)]

    def tier_counts(self) -> list[int]:
        if self.num_clients < 1:
            raise ConfigError(f"population.num_clients must be at least 1, got {self.num_clients}.")
        if not self.tiers:
            raise ConfigError("population.tiers is empty; give at least one tier with its roles.")
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):
            raise ConfigError(f"tier names must be unique, got {names}.")
        if self.assignment == "cyclic":
            return self._cyclic_counts()
        counts: list[int | None] = []
        for tier in self.tiers:
            if tier.count is not None:
                counts.append(tier.count)
            elif tier.fraction is not None:
                counts.append(int(round(tier.fraction * self.num_clients)))
            else:
                counts.append(None)
        rest = [i for i, c in enumerate(counts) if c is None]
        if len(rest) > 1:
            raise ConfigError(
                "only one tier may leave out both fraction and count (it takes the remaining clients); "
                "give the other tiers a fraction or a count."
            )
        fixed = sum(c for c in counts if c is not None)
        sizes = [self.num_clients - fixed if c is None else c for c in counts]  # the one tier left out: the rest
        if sum(sizes) != self.num_clients or min(sizes) < 0:
            raise ConfigError(
                f"tier sizes {dict(zip(names, sizes))} do not add up to num_clients={self.num_clients}; "
                "adjust the fractions / counts or leave one tier without either."
            )
        return sizes

    def _cyclic_counts(self) -> list[int]:
        """``cyclic``: tier t holds the clients k with k mod T = t; a tier that states its own size is refused."""
        sized = [t.name for t in self.tiers if t.count is not None or t.fraction is not None]
        if sized:
            raise ConfigError(
                f"with population.assignment cyclic, client k joins tier k mod {len(self.tiers)} and the tiers' sizes "
                f"follow from num_clients; remove count and fraction from tier(s) {', '.join(sized)}."
            )
        return [len(range(t, self.num_clients, len(self.tiers))) for t in range(len(self.tiers))]

    def roles(self) -> list[Role]:
        """Every role some tier trains, in first-seen order."""
        seen: dict[str, None] = {}
        for tier in self.tiers:
            seen.update(dict.fromkeys(tier.roles))
        return list(seen)


def _interleave(counts: list[int]) -> list[int]:
    left, order = list(counts), []
    while any(left):
        for t, n in enumerate(left):
            if n:
                order.append(t)
                left[t] -= 1
    return order
