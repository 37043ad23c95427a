"""FedAdam: the server's Adam step on the pseudo-gradient (no bias correction), the models sent each way, and a
run that resumes exactly (the server moments are checkpointed)."""

import math

import pytest
import torch
from conftest import check_resume, client_update, method_env, read_summary
from test_fedavg import LARGE_BYTES, SMALL_BYTES, TWO_MLPS, weights_upload

from fl_lightning.federation.population import Tier
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedAdam

MLP = {"m": ModelSpec("digits_mlp", {"hidden": 8})}


def test_fedadam_takes_an_adam_step_on_theta_minus_the_average():
    strategy = FedAdam(server_lr=0.01)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    strategy.state.global_weights["m"] = {k: torch.zeros_like(v) for k, v in strategy.state.global_weights["m"].items()}
    c = server.clients
    strategy.aggregate(
        1, iter([weights_upload(strategy, c[0], "m", 1.0, 1), weights_upload(strategy, c[1], "m", 1.0, 3)])
    )
    # g = 0 - 1; m = 0.1 g; v = 0.001 g^2; theta = 0 - 0.01 m / (sqrt(v) + 1e-5)
    first = 0.01 * 0.1 / (math.sqrt(0.001) + 1e-5)
    assert first == pytest.approx(0.0316128)
    assert all(torch.allclose(v, torch.full_like(v, first)) for v in strategy.state.global_weights["m"].values())
    strategy.aggregate(2, iter([weights_upload(strategy, c[0], "m", 1.0, 1)]))  # moments carry over
    g = first - 1.0
    m, v = 0.9 * -0.1 + 0.1 * g, 0.999 * 0.001 + 0.001 * g * g
    second = first - 0.01 * m / (math.sqrt(v) + 1e-5)
    assert all(torch.allclose(w, torch.full_like(w, second)) for w in strategy.state.global_weights["m"].values())


def test_fedadam_sends_each_pools_model_down_and_back():
    strategy = FedAdam()
    server = method_env(strategy, TWO_MLPS, [Tier("high", ["small", "large"], count=1), Tier("low", ["small"])])
    high, low = strategy.configure_round(1, server.clients[:2])
    assert {role: sent.nbytes for role, sent in high.downlink.items()} == {"small": SMALL_BYTES, "large": LARGE_BYTES}
    assert {role: sent.nbytes for role, sent in low.downlink.items()} == {"small": SMALL_BYTES}
    update = client_update(strategy, server, low)
    assert {role: sent.nbytes for role, sent in update.uplink.items()} == {"small": SMALL_BYTES}


def test_fedadam_resumes_exactly(tmp_path):
    """Two rounds stopped after round 1 and resumed equal the uninterrupted run, server moments included."""
    full = check_resume(tmp_path, "digits_fedadam", "--rounds", "2", "--eval_every", "1", "--training.local_steps", "2")
    comm = read_summary(full)["comm"]
    assert comm["uplink_bytes"] == comm["downlink_bytes"] > 0  # every client returns the models it got
