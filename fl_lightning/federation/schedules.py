"""Learning-rate schedules over rounds: a multiplier of the optimizer's base learning rate.

Rounds are numbered from 1. Each schedule is a small callable so recipes pick one by class path.
"""

from __future__ import annotations

import math

from .errors import ConfigError


def round_progress(rnd: int, rounds: int) -> float:
    """How far round ``rnd`` (from 1) is through ``rounds``: 0 in the first round, 1 in the last."""
    return (rnd - 1) / max(1, rounds - 1)


def linear_decay(progress: float, final: float) -> float:
    """A factor falling linearly from 1 (progress 0) to ``final`` (progress 1)."""
    return 1.0 + (final - 1.0) * progress


class RoundSchedule:
    """Multiplier of the base learning rate in round ``rnd`` of ``rounds``."""

    def __call__(self, rnd: int, rounds: int) -> float:
        raise NotImplementedError


class ConstantLR(RoundSchedule):
    """The base learning rate in every round."""

    def __call__(self, rnd, rounds):
        return 1.0


class StepLR(RoundSchedule):
    """Multiply by ``gamma`` once each milestone round has been completed.

    Args:
        milestones: rounds after which the rate drops, e.g. [200, 300] (paper 001: x0.1 at rounds 200
            and 300 of 400). Values in (0, 1) are fractions of the total rounds.
        gamma: the factor per milestone.
    """

    def __init__(self, milestones: list[float], gamma: float = 0.1):
        if any(m <= 0 for m in milestones):
            raise ConfigError(f"StepLR milestones must be positive, got {milestones}.")
        if not gamma > 0:
            raise ConfigError(f"StepLR gamma must be positive, got {gamma}; e.g. 0.1 divides the rate by 10.")
        self.milestones = milestones
        self.gamma = gamma

    def __call__(self, rnd, rounds):
        done = rnd - 1
        passed = sum(done >= (m * rounds if m < 1 else m) for m in self.milestones)
        return self.gamma**passed


class LinearDecayLR(RoundSchedule):
    """Linear decay from 1 in round 1 to ``final`` in the last round (paper 002's server and distillation rates)."""

    def __init__(self, final: float = 0.0):
        _check_final(type(self).__name__, final)
        self.final = final

    def __call__(self, rnd, rounds):
        return linear_decay(round_progress(rnd, rounds), self.final)


class CosineLR(RoundSchedule):
    """Cosine decay from 1 to ``final`` over the rounds."""

    def __init__(self, final: float = 0.0):
        _check_final(type(self).__name__, final)
        self.final = final

    def __call__(self, rnd, rounds):
        progress = round_progress(rnd, rounds)
        return self.final + (1.0 - self.final) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _check_final(schedule: str, final: float) -> None:
    # a negative final multiplier turns the last rounds' steps into gradient ascent
    if not final >= 0:
        raise ConfigError(f"{schedule} final must be at least 0 (a multiplier of the base rate), got {final}.")
