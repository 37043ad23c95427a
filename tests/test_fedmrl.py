"""FedMRL: the fused representation and the Matryoshka losses by hand, the projector that stays with its client,
the small model's average, the fused model that gets evaluated, the bytes sent."""

import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, metrics_rows, run_cli
from torch import nn

from fl_lightning.client import LocalTraining
from fl_lightning.client.evaluation import Evaluator
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.knowledge.matryoshka import FusedModel, fuse, matryoshka_losses
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedMRL, fedmrl

MODELS = {"own": ModelSpec("digits_mlp", {"hidden": 8}), "small": ModelSpec("digits_mlp", {"hidden": 4})}
PAIR = [Tier("all", ["own", "small"])]
SMALL_NUMBERS = (64 * 4 + 4) + (4 * 10 + 10)  # digits_mlp(hidden=4): Linear(64, 4) and the head Linear(4, 10)
TRAINING = LocalTraining(local_steps=3, batch_size=16)


def _linear(weight, bias) -> nn.Linear:
    layer = nn.Linear(len(weight[0]), len(weight))
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(weight))
        layer.bias.copy_(torch.tensor(bias))
    return layer


def test_fusion_and_the_two_heads_losses_by_hand():
    # d1 = 1 (small), d2 = 2 (own): [r_small ‖ r_own] = [2, 1, -1]
    projector = _linear([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]], [0.5, -0.5])
    fused = fuse(projector, torch.tensor([[2.0]]), torch.tensor([[1.0, -1.0]]))
    assert fused.tolist() == [[3.5, -0.5]]  # [2 + 1 + 0.5, 1 - 1 - 0.5]
    local_head = _linear([[1.0, 0.0], [0.0, 1.0]], [0.0, 0.0])  # logits = fused: [3.5, -0.5]
    global_head = _linear([[1.0], [-1.0]], [0.0, 0.0])  # reads fused[:, :1] = 3.5: logits [3.5, -3.5]
    local_loss, global_loss = matryoshka_losses(fused, torch.tensor([1]), local_head, global_head, global_dim=1)
    assert local_loss.item() == pytest.approx(math.log(1 + math.exp(4.0)))  # -log softmax(-0.5 vs 3.5)
    assert global_loss.item() == pytest.approx(math.log(1 + math.exp(7.0)))  # -log softmax(-3.5 vs 3.5)


def test_the_fused_model_is_the_own_head_on_the_fused_features():
    torch.manual_seed(0)
    server = method_env(FedMRL(), MODELS, PAIR)
    small, own = server.model("small"), server.model("own")
    projector = nn.Linear(4 + 8, 8)
    x = torch.randn(5, 1, 8, 8)
    expected = own.head(projector(torch.cat((small.features(x), own.features(x)), 1)))
    assert torch.equal(FusedModel(small, own, projector)(x), expected)


def test_the_projector_stays_with_its_client_and_goes_on_training(monkeypatch):
    """The projector a client trained is where its next round starts (HtFLlib reloads its random initial one),
    it differs between clients, and it is never sent."""
    strategy = FedMRL()
    server = method_env(strategy, MODELS, PAIR, training=TRAINING)
    client = server.clients[0]
    started = []
    joint = fedmrl.fit_jointly

    def recording(ctx, roles, step, helpers=()):
        started.append({k: v.clone() for k, v in helpers[0].state_dict().items()})
        return joint(ctx, roles, step, helpers)

    monkeypatch.setattr(fedmrl, "fit_jointly", recording)
    state = {}
    first = client_update(strategy, server, strategy.configure_round(1, [client])[0], state)
    assert list(first.uplink) == ["small"]
    trained = {k: v.clone() for k, v in state["projector"].items()}
    initial = strategy.projector_of("own", client.id).state_dict()
    assert all(torch.equal(started[0][k], initial[k]) for k in initial)
    assert not torch.equal(trained["weight"], initial["weight"])
    client_update(strategy, server, strategy.configure_round(2, [client])[0], state)
    assert all(torch.equal(started[1][k], trained[k]) for k in trained)
    other = strategy.projector_of("own", server.clients[1].id).state_dict()
    assert not torch.equal(other["weight"], initial["weight"])


def test_the_small_model_is_averaged_by_examples_or_uniformly_and_is_all_that_is_sent():
    for weighted, expected in ((True, 4.0), (False, 3.0)):
        strategy = FedMRL(weighted=weighted)
        server = method_env(strategy, MODELS, PAIR, training=TRAINING)
        c = server.clients
        task = strategy.configure_round(1, [c[0]])[0]
        assert list(task.downlink) == ["small"] and task.downlink["small"].nbytes == SMALL_NUMBERS * 4
        update = client_update(strategy, server, task)
        assert update.uplink["small"].nbytes == SMALL_NUMBERS * 4
        ones = {k: torch.full_like(v, 1.0) for k, v in strategy.state.small_weights.items()}
        fives = {k: torch.full_like(v, 5.0) for k, v in strategy.state.small_weights.items()}
        updates = [ClientUpdate(c[0], 1, {"small": ModelWeights("small", ones)})]
        updates.append(ClientUpdate(c[1], 3, {"small": ModelWeights("small", fives)}))
        strategy.aggregate(1, iter(updates))
        # (1 + 5 x 3) / 4 by examples (the official code), (1 + 5) / 2 uniformly (HtFLlib)
        assert torch.equal(strategy.state.small_weights["head.bias"], torch.full((10,), expected))


def _built(role, weights):
    model = MODELS[role].build(num_classes=10, in_channels=1)
    model.load_state_dict(weights)
    return model


@pytest.mark.parametrize("evaluate_small", ["local", "global"])
def test_each_client_is_evaluated_with_its_own_head_on_the_fused_representation(evaluate_small):
    strategy = FedMRL(evaluate_small=evaluate_small, split="global")
    server = method_env(strategy, MODELS, PAIR, training=TRAINING)
    client = server.clients[0]
    state = {}
    client_update(strategy, server, strategy.configure_round(1, [client])[0], state)
    strategy.state.small_weights = server.initial_weights("small", 7)  # the global model moved on since
    metrics = strategy.evaluate(Evaluator(server._loop, server.data, [client], {client.id: state}))

    small = _built("small", state["small"] if evaluate_small == "local" else strategy.state.small_weights)
    own, projector = _built("own", state["weights"]), nn.Linear(4 + 8, 8)
    projector.load_state_dict(state["projector"])
    x, y = server.data.test_x, server.data.test_y
    with torch.no_grad():
        fused_logits = own.head(projector(torch.cat((small.features(x), own.features(x)), 1)))
        alone_logits = _built("small", strategy.state.small_weights)(x)
    assert metrics["personal/test_acc"] == pytest.approx((fused_logits.argmax(1) == y).float().mean().item())
    assert metrics["small/test_acc"] == pytest.approx((alone_logits.argmax(1) == y).float().mean().item())


def test_a_client_that_never_trained_is_evaluated_with_its_initial_models():
    strategy = FedMRL(split="global")
    server = method_env(strategy, MODELS, PAIR)
    client = server.clients[2]
    role, weights = strategy.fused_weights(client, {})
    assert role == "own"
    assert torch.equal(weights["local_model.head.weight"], server.initial_weights("own", client.id)["head.weight"])
    assert torch.equal(weights["global_model.head.bias"], strategy.state.small_weights["head.bias"])
    assert torch.equal(weights["projector.weight"], strategy.projector_of("own", client.id).weight)


def test_the_set_up_is_checked():
    with pytest.raises(ConfigError, match="no tier lists the small role 'small'"):
        method_env(FedMRL(), MODELS, [Tier("all", ["own"])])
    bigger = {**MODELS, "small": ModelSpec("digits_mlp", {"hidden": 16})}
    with pytest.raises(ConfigError, match=r"d1 = 16 .* roles \{'own': 8\}"):
        method_env(FedMRL(), bigger, PAIR)


def test_the_ledger_counts_the_small_model_each_way_per_client_and_round(tmp_path):
    out = tmp_path / "run"
    tiers = "[{name: a, roles: [cnn_small, small], count: 3}, {name: b, roles: [mlp, small], count: 3}]"
    tiny = ["--population.num_clients", "6", "--population.tiers", tiers, "--training.local_steps", "1"]
    tiny += ["--rounds", "2", "--eval_every", "1", "--runtime.progress", "false"]
    code = run_cli("fit", "--config", str(ROOT / "recipes/digits_fedmrl.yaml"), *tiny, "--output_dir", str(out))
    assert code == 0
    # digits_mlp(hidden=32, depth=1): Linear(64, 32) and the head Linear(32, 10); 6 clients, every round
    small = (64 * 32 + 32) + (32 * 10 + 10)
    rows = metrics_rows(out)
    assert [int(r["comm/round_downlink_bytes"]) for r in rows] == [6 * small * 4] * 2
    assert [int(r["comm/round_uplink_bytes"]) for r in rows] == [6 * small * 4] * 2
