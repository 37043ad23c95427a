"""PeriodicCodist: FedAdam steps between codistillation rounds, the models replaced and the server moments reset
every period, the models sent each way, and a run with a codistillation round that resumes exactly."""

import math

import torch
from conftest import check_resume, client_update, method_env, metrics_rows
from test_fedavg import LARGE_BYTES, SMALL_BYTES, TWO_MLPS

from fl_lightning.data import DigitsData
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.strategies import Codistillation, PeriodicCodist

TIERS = [Tier("high", ["small", "large"], count=2), Tier("low", ["small"])]
# the distillation leaves the students where the teachers are: what enters is the FedAdam step alone
NO_STEPS = Codistillation(steps=0, augment=False)


def pools_env(strategy):
    """A two-pool codistillation method on digits with a server set, both pools' weights set to 0."""
    server = method_env(strategy, TWO_MLPS, TIERS, data=DigitsData(server_fraction=0.2))
    for role, weights in strategy.state.global_weights.items():
        strategy.state.global_weights[role] = {k: torch.zeros_like(v) for k, v in weights.items()}
    return server


def ones_upload(strategy, client):
    """Both pools' weights, every entry 1."""
    uplink = {
        role: ModelWeights(role, {k: torch.ones_like(v) for k, v in strategy.state.global_weights[role].items()})
        for role in ("small", "large")
    }
    return ClientUpdate(client, 1, uplink)


def all_equal(weights, value):
    return all(torch.allclose(v, torch.full_like(v, value), atol=1e-7) for v in weights.values())


def test_periodic_codist_resets_the_server_moments_every_period():
    strategy = PeriodicCodist(period=2, server_lr=0.01, distillation=NO_STEPS)
    server = pools_env(strategy)
    upload = ones_upload(strategy, server.clients[0])
    # round 1, no codistillation: FedAdam's step from 0 towards 1 (g = -1): 0.01 * 0.1 / (sqrt(0.001) + 1e-5)
    assert strategy.aggregate(1, iter([upload])) == {}
    first = 0.01 * 0.1 / (math.sqrt(0.001) + 1e-5)
    assert all_equal(strategy.state.global_weights["small"], first) and all_equal(
        strategy.state.global_weights["large"], first
    )
    # round 2 = the period: a second Adam step with the moments, then codistillation and a reset of the moments
    assert strategy.aggregate(2, iter([upload])) == {"server/codistilled": 1.0}
    g = first - 1.0
    m, v = 0.9 * -0.1 + 0.1 * g, 0.999 * 0.001 + 0.001 * g * g
    second = first - 0.01 * m / (math.sqrt(v) + 1e-5)
    assert all_equal(strategy.state.global_weights["large"], second)
    assert all(optimizer.m == {} for optimizer in strategy.state.server_optimizers.values())
    # round 3 starts from fresh moments: m = 0.1 g, v = 0.001 g^2 again
    strategy.aggregate(3, iter([upload]))
    g = second - 1.0
    third = second - 0.01 * (0.1 * g) / (math.sqrt(0.001 * g * g) + 1e-5)
    assert all_equal(strategy.state.global_weights["small"], third)

    kept = PeriodicCodist(period=2, server_lr=0.01, distillation=NO_STEPS, reset_server_optimizer=False)
    pools_env(kept)
    for rnd in (1, 2):
        kept.aggregate(rnd, iter([upload]))
    assert all(optimizer.m != {} for optimizer in kept.state.server_optimizers.values())


def test_periodic_codist_sends_each_pools_model_down_and_back():
    strategy = PeriodicCodist(distillation=NO_STEPS)
    server = pools_env(strategy)
    high, low = strategy.configure_round(1, [server.clients[0], server.clients[-1]])
    assert {role: sent.nbytes for role, sent in high.downlink.items()} == {"small": SMALL_BYTES, "large": LARGE_BYTES}
    assert {role: sent.nbytes for role, sent in low.downlink.items()} == {"small": SMALL_BYTES}
    update = client_update(strategy, server, high)
    assert {role: sent.nbytes for role, sent in update.uplink.items()} == {"small": SMALL_BYTES, "large": LARGE_BYTES}


def test_periodic_codist_resumes_exactly_across_a_codistillation_round(tmp_path):
    """Two rounds of period 1 (a codistillation each round) stopped after round 1 and resumed equal the
    uninterrupted run."""
    argv = ["--rounds", "2", "--eval_every", "1", "--training.local_steps", "2", "--strategy.init_args.period", "1"]
    argv += ["--strategy.init_args.distillation.init_args.steps", "2"]
    rows = metrics_rows(check_resume(tmp_path, "digits_periodic_codist", *argv))
    assert [row["server/codistilled"] for row in rows] == ["1.0", "1.0"]
