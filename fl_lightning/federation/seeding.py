"""Every random stream of a run, named in one place.

A random draw is seeded by ``derive_seed(seed, step, owner, stream[, extra])``: the run seed, the round
(or another step counter), who draws (a client id, or one of the :class:`Owner` ids of the server) and
what the draw is for (a :class:`Stream`). Because a stream depends only on these numbers, never on what
ran before, a resumed run draws exactly what an uninterrupted one draws, and client order does not
matter. A new purpose gets a new member here; reusing a number for two purposes would correlate them.

The values are part of every recorded result: changing one changes the numbers of every run that draws
from it (``benchmarks/digits_fingerprint.py --check`` notices).
"""

from __future__ import annotations

from enum import IntEnum, unique

import numpy as np
import torch


@unique
class Stream(IntEnum):
    """What a draw is for: the fourth number of ``derive_seed``. ``@unique`` refuses a duplicated value."""

    DROPOUT = 0
    """torch's global generator during a client's update (dropout, random ops in a step function)."""
    BATCH_ORDER = 1
    """``ClientContext.generator``: a client's batch order and augmentation in a round."""
    SAMPLER = 2
    """The clients that join a round (server)."""
    CLIENT_INIT = 3
    """A client's own initial weights (personalized methods), drawn once at step 0."""
    ARRIVAL = 4
    """Asynchronous mode: the simulated duration of one dispatch (step = the dispatch number)."""
    SPEEDS = 5
    """Asynchronous mode: every client's speed, drawn once at step 0 (server)."""
    ASYNC_START = 6
    """Asynchronous mode: the clients that start at time 0 when ``concurrency`` is set (server)."""
    PUBLIC_SUBSET = 7
    """The public-set examples a round's clients predict on (FedMD's alignment set, DS-FL's open batch; server)."""
    SUBMODEL_RATE = 8
    """HeteroFL's dynamic mode: the width rate every client would train this round (server)."""
    EVAL_SAMPLE = 9
    """The clients a personalized evaluation covers when ``evaluation.sample`` is set (server, per round)."""
    SERVER_PHASE = 10
    """torch's global generator while the strategy aggregates phase k of a round: ``SERVER_PHASE + k``."""
    FAULTS = SERVER_PHASE + 10  # MAX_PHASES: the server phases take 10..19
    """The fault injected into a client's task in a round (``robustness.Faults``)."""
    PRIVACY = FAULTS + 1
    """Differential privacy's Gaussian noise: a client's upload of a round's phase (the fifth number is the phase),
    or the server's noise on an aggregate (``run/privacy.py``)."""


MAX_PHASES = 10
"""Phases a round may have: ``SERVER_PHASE + k`` for k below this must not reach another stream."""


@unique
class Owner(IntEnum):
    """Who draws, when it is not a client: the third number of ``derive_seed`` (client ids are below these)."""

    SERVER = 2**31 - 1
    """The server and the sampler."""
    COHORTS = 2**31 - 2
    """FedAvg's per-role cohorts (``clients_per_round``); the fourth number is the role's index, not a stream."""


SERVER_STREAM = Owner.SERVER  # the name the orchestrator and benchmarks/overhead.py used


def server_phase(number: int) -> int:
    """The stream of the server's randomness in phase ``number`` of a round."""
    if not 0 <= number < MAX_PHASES:
        raise ValueError(f"a round has at most {MAX_PHASES} phases, got phase number {number}")
    return Stream.SERVER_PHASE + number


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (run seed, round, client, stream), independent of call order."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def seed_torch(seed: int) -> None:
    """Seeds torch's global CPU generator (and CUDA's, once CUDA is in use).

    ``torch.manual_seed`` also queues a lazy CUDA seeding that captures a Python stack trace on every
    call; per client and round that cost 0.3 ms, several percent of a small model's round.
    """
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():  # is_available() would dlopen the driver library on every call
        torch.cuda.manual_seed_all(seed)
