"""On-device KD: the strong clients' distillation loss from the auxiliary model, the server's averages of both
phases and the ramp-up of the KD weight, the models each phase sends each way, and a run that resumes exactly."""

import math

import pytest
import torch
from conftest import aggregate_phase, check_resume, client_update, method_env, phase_tasks, read_summary
from test_fedavg import LARGE_BYTES, SMALL_BYTES

from fl_lightning.client import LocalTraining
from fl_lightning.data import DigitsData
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import OnDeviceKD

CONSTANT = ModelSpec("conftest.constant_logits_model")  # logits = head bias = (0, 1, ..., 9)
MLPS = {"aux": ModelSpec("digits_mlp", {"hidden": 4}), "target": ModelSpec("digits_mlp", {"hidden": 8})}
TIERS = [Tier("strong", ["aux", "target"], count=2), Tier("weak", ["aux"])]
# one step on all of a client's data, weights unchanged: the reported loss is the loss of that batch
ONE_FROZEN_BATCH = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), local_steps=1, batch_size=10_000)


def test_strong_clients_distill_the_auxiliary_models_softened_outputs():
    """With the auxiliary model's logits all 0 (a uniform teacher) and the target's (0, ..., 9), the KD loss on
    every unlabeled example is w T^2 KL(uniform || softmax(z / T)); the CE step before it is on labeled data."""
    strategy = OnDeviceKD(temperature=2.0, kd_weight=0.5)
    models = {"aux": CONSTANT, "target": CONSTANT}
    data = DigitsData(unlabeled_fraction=0.5)
    server = method_env(strategy, models, [Tier("strong", ["aux", "target"])], training=ONE_FROZEN_BATCH, data=data)
    strategy.state.global_weights["aux"]["head.bias"] = torch.zeros(10)
    task = phase_tasks(strategy, 1, server.clients[:1], "target")[0]
    metrics = client_update(strategy, server, task).metrics
    z = torch.arange(10.0)
    p = torch.softmax(z / 2.0, 0)
    kl = sum(0.1 * math.log(0.1 / p[j].item()) for j in range(10))
    assert metrics["target/kd_loss"] == pytest.approx(0.5 * 4.0 * kl, rel=1e-5)
    y = data.y[data.clients[0].train]
    assert metrics["target/loss"] == pytest.approx((torch.logsumexp(z, 0) - z[y]).mean().item(), rel=1e-5)


@pytest.mark.parametrize("weighted, expected", [(False, (1 + 4) / 2), (True, (1 + 4 * 3) / 4)])
def test_both_phases_average_uniformly_or_by_example_count(weighted, expected):
    strategy = OnDeviceKD(weighted=weighted, kd_weight=1.0, ramp_rounds=10)
    server = method_env(strategy, MLPS, TIERS)
    c = server.clients
    for phase, role in (("auxiliary", "aux"), ("target", "target")):

        def upload(client, value, n, role=role):
            state = {k: torch.full_like(v, value) for k, v in strategy.state.global_weights[role].items()}
            return ClientUpdate(client, n, {role: ModelWeights(role, state)})

        metrics = aggregate_phase(strategy, 6, [upload(c[0], 1.0, 1), upload(c[1], 4.0, 3)], phase)
        weights = strategy.state.global_weights[role]
        assert all(torch.allclose(v, torch.full_like(v, expected)) for v in weights.values())
    # the KD weight after round 6 of a 10-round ramp: 0-based round 5, exp(-5 (1 - 5/10)^2)
    assert metrics == {"server/kd_weight": pytest.approx(math.exp(-1.25))}
    assert aggregate_phase(strategy, 11, [], "target") == {"server/kd_weight": 1.0}


def test_each_phase_sends_its_models_down_and_back():
    strategy = OnDeviceKD()
    server = method_env(strategy, MLPS, TIERS)
    weak = server.clients[-1]
    auxiliary = phase_tasks(strategy, 1, [server.clients[0], weak], "auxiliary")
    assert [{r: p.nbytes for r, p in t.downlink.items()} for t in auxiliary] == [{"aux": SMALL_BYTES}] * 2
    assert {r: p.nbytes for r, p in client_update(strategy, server, auxiliary[1]).uplink.items()} == {
        "aux": SMALL_BYTES
    }
    target = phase_tasks(strategy, 1, [weak], "target")  # every strong client, sampled or not
    assert [t.client.id for t in target] == [0, 1]
    assert {r: p.nbytes for r, p in target[0].downlink.items()} == {"aux": SMALL_BYTES, "target": LARGE_BYTES}
    uplink = client_update(strategy, server, target[0]).uplink
    assert {r: p.nbytes for r, p in uplink.items()} == {"target": LARGE_BYTES}  # the auxiliary model stays


def test_ondevice_kd_resumes_exactly(tmp_path):
    """Two rounds stopped after round 1 and resumed equal the uninterrupted run."""
    argv = ("--rounds", "2", "--eval_every", "1", "--training.local_steps", "2")
    comm = read_summary(check_resume(tmp_path, "digits_ondevice_kd", *argv))["comm"]
    assert comm["uplink_bytes"] < comm["downlink_bytes"]  # strong clients get the auxiliary model twice a round
