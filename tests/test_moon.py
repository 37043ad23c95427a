"""MOON: the model-contrastive loss on hand-made vectors, the projection head, the client's previous model, sizes."""

import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, read_summary, run_cli

from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import MOON
from fl_lightning.strategies.moon import model_contrastive_loss

SMALL = {"small": ModelSpec("digits_cnn", {"width": 0.25}, projection_dim=256)}


def test_contrastive_loss_on_hand_made_vectors():
    z = torch.tensor([[1.0, 0.0], [2.0, 2.0]])
    z_global = torch.tensor([[3.0, 0.0], [1.0, 0.0]])  # cosines 1 and 1/sqrt(2)
    z_previous = torch.tensor([[0.0, 5.0], [-1.0, -1.0]])  # cosines 0 and -1
    # tau 0.5: sample 1 has logits [2, 0], -log(e^2 / (e^2 + 1)) = log(1 + e^-2) = 0.126928;
    # sample 2 has [1.414214, -2], log(1 + e^-3.414214) = 0.032373; the batch mean is 0.079650
    loss = model_contrastive_loss(z, z_global, [z_previous], temperature=0.5)
    assert loss.item() == pytest.approx(0.0796503, abs=1e-6)
    # tau 1: log(1 + e^-1) = 0.313262 and log(1 + e^-1.707107) = 0.166692
    loss = model_contrastive_loss(z, z_global, [z_previous], temperature=1.0)
    assert loss.item() == pytest.approx((math.log(1 + math.exp(-1)) + 0.166692) / 2, abs=1e-6)
    assert model_contrastive_loss(z, z_global, [], temperature=0.5).item() == 0.0  # no negative: nothing to push


def test_projection_head_sits_between_features_and_a_new_classifier():
    model = SMALL["small"].build(num_classes=10)
    # digits_cnn at width 0.25 has 16 features; MOON's head: Linear(16, 16), ReLU, Linear(16, 256)
    projection = list(model.features)[1:]
    assert [tuple(layer.weight.shape) for layer in projection[::2]] == [(16, 16), (256, 16)]
    assert model.feature_dim == model.projection_dim == 256 and tuple(model.head.weight.shape) == (10, 256)
    x = torch.randn(3, 1, 8, 8)
    assert model.features(x).shape == (3, 256) and torch.equal(model(x), model.head(model.features(x)))
    with pytest.raises(ConfigError, match="projection_dim must be a positive integer"):
        ModelSpec("digits_cnn", projection_dim=0).build(num_classes=10)


def test_missing_projection_head_or_several_models_are_refused():
    with pytest.raises(ConfigError, match="MOON needs a projection head"):
        method_env(MOON(), {"m": ModelSpec("digits_mlp", {"hidden": 8})}, [Tier("all", ["m"])])
    two = {"a": SMALL["small"], "b": SMALL["small"]}
    with pytest.raises(ConfigError, match="MOON is homogeneous"):
        method_env(MOON(), two, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="MOON temperature must be > 0, got 0.0."):
        MOON(temperature=0.0)


def test_previous_model_enters_the_loss_from_the_clients_second_round():
    """Round 1 has no previous model, so l_con is 0 and mu changes nothing; afterwards it does."""
    results = {}
    for mu in (0.0, 5.0):
        strategy = MOON(mu=mu)
        server = method_env(strategy, SMALL, [Tier("all", ["small"])])
        state: dict = {}
        first = client_update(strategy, server, strategy.configure_round(1, [server.clients[0]])[0], state)
        assert torch.equal(state["previous"]["head.weight"], first.uplink["small"].state["head.weight"])
        second = client_update(strategy, server, strategy.configure_round(2, [server.clients[0]])[0], state)
        results[mu] = first.uplink["small"].state, second.uplink["small"].state
    assert all(torch.equal(results[0.0][0][k], results[5.0][0][k]) for k in results[0.0][0])
    assert not torch.equal(results[0.0][1]["head.weight"], results[5.0][1]["head.weight"])


def test_the_whole_model_goes_each_way():
    strategy = MOON()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    task = strategy.configure_round(1, [server.clients[0]])[0]
    # conv 1*4*9+4 = 40, conv 4*8*9+8 = 296, dense 128*16+16 = 2064, projection 16*16+16 = 272 and
    # 16*256+256 = 4352, classifier 256*10+10 = 2570: 9594 float32 numbers
    assert task.downlink["small"].nbytes == 9594 * 4
    assert client_update(strategy, server, task).uplink["small"].nbytes == 9594 * 4


def test_moon_without_contrastive_term_is_exactly_fedavg(tmp_path):
    recipe = ["--config", str(ROOT / "recipes" / "digits_moon.yaml"), "--rounds", "3", "--eval_every", "3"]
    recipe += ["--runtime.progress", "false"]
    assert run_cli("fit", *recipe, "--strategy.init_args.mu", "0", "--output_dir", str(tmp_path / "moon")) == 0
    fedavg = ["--strategy", "fl_lightning.strategies.FedAvg", "--output_dir", str(tmp_path / "fedavg")]
    assert run_cli("fit", *recipe, *fedavg) == 0
    moon, plain = read_summary(tmp_path / "moon"), read_summary(tmp_path / "fedavg")
    assert moon["final"] == plain["final"]
    assert moon["comm"]["uplink_bytes"] == 3 * 10 * 9594 * 4  # 3 rounds x 10 clients x the whole model
