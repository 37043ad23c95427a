"""FedAvg: the weighted and uniform averages of the clients' weights, per-role cohorts, the model bytes sent each
way, and a run that resumes exactly."""

import pytest
import torch
from conftest import check_resume, client_update, method_env, metrics_rows, write_recipe

from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedAvg

MLP = {"m": ModelSpec("digits_mlp", {"hidden": 8})}


def test_fedavg_per_role_cohorts_are_drawn_from_each_pool():
    from fl_lightning.strategies import FedAvg

    models = {"small": ModelSpec("digits_mlp", {"hidden": 4}), "large": ModelSpec("digits_mlp", {"hidden": 8})}
    strategy = FedAvg(clients_per_round={"small": 3, "large": 2})
    method_env(strategy, models, [Tier("high", ["small", "large"], count=3), Tier("low", ["small"])], num_clients=8)
    tasks = strategy.configure_round(1, [])  # the sampler's clients are not used for roles with a cohort size
    small = [t.client.id for t in tasks if "small" in t.downlink]
    large = [t.client.id for t in tasks if "large" in t.downlink]
    assert len(small) == 3 and len(large) == 2 and set(large) <= {0, 1, 2}
    assert [t.client.id for t in strategy.configure_round(1, [])] == [t.client.id for t in tasks]  # seeded by round


TWO_MLPS = {"small": ModelSpec("digits_mlp", {"hidden": 4}), "large": ModelSpec("digits_mlp", {"hidden": 8})}
# digits_mlp: 64 inputs -> hidden -> 10 classes, float32: (64 h + h + 10 h + 10) x 4 bytes
SMALL_BYTES, LARGE_BYTES, TINY_BYTES = (64 * 4 + 4 + 40 + 10) * 4, (64 * 8 + 8 + 80 + 10) * 4, (64 * 32 + 32 + 330) * 4


def weights_upload(strategy, client, role, value, n):
    """An upload of ``role``'s weights with every entry ``value``, from a client with ``n`` examples."""
    state = {k: torch.full_like(v, value) for k, v in strategy.state.global_weights[role].items()}
    return ClientUpdate(client, n, {role: ModelWeights(role, state)})


@pytest.mark.parametrize("weighted, expected", [(True, (1 + 4 * 3) / 4), (False, (1 + 4) / 2)])
def test_fedavg_averages_weights_by_example_count_or_uniformly(weighted, expected):
    strategy = FedAvg(weighted=weighted)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(
        1, iter([weights_upload(strategy, c[0], "m", 1.0, 1), weights_upload(strategy, c[1], "m", 4.0, 3)])
    )
    weights = strategy.state.global_weights["m"]
    assert all(torch.allclose(v, torch.full_like(v, expected)) for v in weights.values())
    task = strategy.configure_round(2, [c[2]])[0]
    assert all(torch.equal(v, weights[k]) for k, v in task.downlink["m"].state.items())  # sent as averaged


def test_fedavg_sends_each_trained_model_down_and_back():
    strategy = FedAvg()
    server = method_env(strategy, TWO_MLPS, [Tier("high", ["small", "large"], count=1), Tier("low", ["small"])])
    high, low = strategy.configure_round(1, server.clients[:2])
    assert (high.downlink["small"].nbytes, high.downlink["large"].nbytes) == (SMALL_BYTES, LARGE_BYTES)
    assert list(low.downlink) == ["small"] and low.downlink["small"].nbytes == SMALL_BYTES == 310 * 4
    update = client_update(strategy, server, high)
    assert {role: sent.nbytes for role, sent in update.uplink.items()} == {"small": SMALL_BYTES, "large": LARGE_BYTES}


def test_fedavg_ledger_counts_the_model_each_way_and_resumes_exactly(tmp_path):
    """Four rounds of 4 sampled clients (TINY: 8 clients, half sampled) stopped after round 2 and resumed equal the
    uninterrupted run; each client gets and returns the 2,410-number MLP every round."""
    rows = metrics_rows(check_resume(tmp_path, write_recipe(tmp_path / "fedavg.yaml"), stop_after=2))
    assert [(r["round"], int(r["comm/round_uplink_bytes"])) for r in rows] == [
        ("2", 4 * TINY_BYTES),
        ("4", 4 * TINY_BYTES),
    ]
    assert int(rows[-1]["comm/uplink_bytes"]) == int(rows[-1]["comm/downlink_bytes"]) == 16 * TINY_BYTES == 154_240
