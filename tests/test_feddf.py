"""FedDF: distillation starts from the FedAvg'd model and follows the plain mean of all clients' logits."""

import pytest
import torch
from conftest import ROOT, client_update, method_env, read_summary, run_cli

from fl_lightning.data import DigitsData
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedDF

CONSTANT = ModelSpec("conftest.constant_logits_model")  # logits = head bias for every input


@pytest.fixture(autouse=True)
def _trust_conftest_builders(monkeypatch):
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "conftest")


def _env(strategy, roles=("m",), num_clients=4):
    tiers = [Tier(role, [role], count=num_clients // len(roles)) for role in roles[:-1]] + [
        Tier(roles[-1], [roles[-1]])
    ]
    return method_env(strategy, {r: CONSTANT for r in roles}, tiers, num_clients, data=DigitsData(server_fraction=0.2))


def _upload(server, client, first_logit: float, num_samples: int) -> ClientUpdate:
    """A client's model whose logits are ``(first_logit, 0, ..., 0)`` on every input."""
    role = client.roles[0]
    state = server.initial_weights(role)
    state["head.bias"] = torch.zeros(10)
    state["head.bias"][0] = first_logit
    return ClientUpdate(client, num_samples, {role: ModelWeights(role, state)})


def test_teacher_is_the_plain_mean_of_logits_and_the_start_the_weighted_average():
    strategy = FedDF(steps=0)
    server = _env(strategy)
    c = server.clients
    strategy.aggregate(1, iter([_upload(server, c[0], 2.0, 1), _upload(server, c[1], 0.0, 3)]))
    # teacher: softmax of the unweighted mean logits (1, 0, ..., 0) on every server example
    first = torch.e / (torch.e + 9)
    expected = torch.tensor([first] + [(1 - first) / 9] * 9)
    assert strategy.teacher.shape == (len(server.data.server_idx), 10)
    assert torch.allclose(strategy.teacher, expected.expand_as(strategy.teacher), atol=1e-6)
    # no distillation steps: the global model is FedAvg's (1 x 2 + 3 x 0) / 4 = 0.5
    bias = strategy.state.global_weights["m"]["head.bias"]
    assert torch.allclose(bias, torch.tensor([0.5] + [0.0] * 9))


def test_one_adam_step_moves_the_averaged_model_towards_the_ensemble():
    strategy = FedDF(steps=1, lr=1e-3)
    server = _env(strategy)
    c = server.clients
    strategy.aggregate(1, iter([_upload(server, c[0], 2.0, 1), _upload(server, c[1], 0.0, 3)]))
    # start 0.5 < teacher 1 on class 0: its probability is too low, the KL's gradient p - q is negative
    # there and positive elsewhere; Adam's first step moves each coordinate by lr against the sign
    bias = strategy.state.global_weights["m"]["head.bias"]
    assert torch.allclose(bias, torch.tensor([0.501] + [-0.001] * 9), atol=1e-6)


def test_each_prototype_learns_from_the_ensemble_of_all_prototypes():
    strategy = FedDF(steps=1, lr=1e-3)
    server = _env(strategy, roles=("a", "b"))
    a = next(c for c in server.clients if c.roles == ("a",))
    b = next(c for c in server.clients if c.roles == ("b",))
    strategy.aggregate(1, iter([_upload(server, a, 2.0, 1), _upload(server, b, 0.0, 1)]))
    # teacher (1, 0, ...): a starts above it on class 0 and moves down, b starts below and moves up
    assert torch.allclose(
        strategy.state.global_weights["a"]["head.bias"], torch.tensor([1.999] + [0.001] * 9), atol=1e-6
    )
    assert torch.allclose(
        strategy.state.global_weights["b"]["head.bias"], torch.tensor([0.001] + [-0.001] * 9), atol=1e-6
    )


def test_the_model_goes_each_way_and_nothing_else():
    strategy = FedDF(steps=1)
    server = _env(strategy)
    task = strategy.configure_round(1, [server.clients[0]])[0]
    model_bytes = (64 * 4 + 4 + 4 * 10 + 10) * 4  # Linear(64, 4) and Linear(4, 10) in float32
    assert sum(p.nbytes for p in task.downlink.values()) == model_bytes
    update = client_update(strategy, server, task)
    assert sum(p.nbytes for p in update.uplink.values()) == model_bytes


def test_without_server_data_it_says_how_to_get_some():
    with pytest.raises(ConfigError, match="FedDF needs unlabeled server data; set data.init_args.server_fraction"):
        method_env(FedDF(), {"m": CONSTANT}, [Tier("all", ["m"])])


def test_feddf_without_distillation_is_exactly_fedavg(tmp_path):
    """steps = 0 leaves the weighted average alone: the run must match FedAvg's, traffic included."""
    recipe = ["--config", str(ROOT / "recipes" / "digits_feddf.yaml"), "--rounds", "3", "--eval_every", "3"]
    recipe += ["--runtime.progress", "false"]
    assert run_cli("fit", *recipe, "--strategy.init_args.steps", "0", "--output_dir", str(tmp_path / "df")) == 0
    fedavg = ["--strategy", "fl_lightning.strategies.FedAvg", "--output_dir", str(tmp_path / "avg")]
    assert run_cli("fit", *recipe, *fedavg) == 0
    feddf, avg = read_summary(tmp_path / "df"), read_summary(tmp_path / "avg")
    assert feddf["final"] == avg["final"] and feddf["comm"] == avg["comm"]
    assert "FedDF" in (tmp_path / "df" / "config.yaml").read_text()
    assert "FedDF" not in (tmp_path / "avg" / "config.yaml").read_text()  # the second run really is FedAvg
