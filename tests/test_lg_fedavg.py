"""LG-FedAvg: which part is global, how it is averaged and spliced into local models, sizes sent."""

import pytest
import torch
from conftest import client_update, method_env

from fl_lightning.client import LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import LGFedAvg

MLP = {"m": ModelSpec("digits_mlp", {"hidden": 4})}
FROZEN = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.0), local_steps=1)


def _upload(client, value: float, num_samples: int) -> ClientUpdate:
    head = {"head.weight": torch.full((10, 4), value), "head.bias": torch.full((10,), value)}
    return ClientUpdate(client, num_samples, {"global_layers": ModelWeights("global_layers", head)})


@pytest.mark.parametrize("weighted, expected", [(True, 4.0), (False, 3.0)])
def test_head_is_the_sample_weighted_or_plain_mean(weighted, expected):
    strategy = LGFedAvg(weighted=weighted)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_upload(c[0], 1.0, 1), _upload(c[1], 5.0, 3)]))
    # weighted: (1 x 1 + 5 x 3) / 4 = 4; plain: (1 + 5) / 2 = 3
    assert sorted(strategy.state.global_weights) == ["head.bias", "head.weight"]
    assert torch.allclose(strategy.state.global_weights["head.weight"], torch.full((10, 4), expected))


def test_client_trains_its_own_layers_under_the_global_head_and_sends_only_the_head():
    strategy = LGFedAvg()
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=FROZEN)
    client = server.clients[0]
    strategy.aggregate(1, iter([_upload(server.clients[1], 2.0, 1)]))
    task = strategy.configure_round(2, [client])[0]
    assert task.downlink["global_layers"].nbytes == (4 * 10 + 10) * 4  # D x C + C floats
    state = {}
    update = client_update(strategy, server, task, state)  # lr 0: what was loaded is what comes back
    sent = update.uplink["global_layers"]
    assert sent.nbytes == (4 * 10 + 10) * 4 and torch.equal(sent.state["head.weight"], torch.full((10, 4), 2.0))
    own = server.initial_weights("m", client.id)
    assert torch.equal(state["weights"]["features.1.weight"], own["features.1.weight"])  # its own, not global
    assert torch.equal(state["weights"]["head.bias"], torch.full((10,), 2.0))


def test_top_layers_are_matched_by_position_across_architectures():
    models = {
        "a": ModelSpec("digits_mlp", {"hidden": 4, "depth": 2}),  # features.3 is its last hidden layer
        "b": ModelSpec("digits_mlp", {"hidden": 4, "depth": 3}),  # features.5 is
    }
    strategy = LGFedAvg(global_layers=2)
    server = method_env(strategy, models, [Tier("a", ["a"], count=2), Tier("b", ["b"])], training=FROZEN)
    assert strategy.names == ["features.3.weight", "features.3.bias", "head.weight", "head.bias"]
    assert strategy.keys["b"] == ["features.5.weight", "features.5.bias", "head.weight", "head.bias"]
    strategy.state.global_weights = {k: torch.full_like(v, 7.0) for k, v in strategy.state.global_weights.items()}
    b_client = next(c for c in server.clients if c.tier == "b")
    task = strategy.configure_round(1, [b_client])[0]
    assert task.downlink["global_layers"].nbytes == (4 * 4 + 4 + 4 * 10 + 10) * 4
    state = {}
    update = client_update(strategy, server, task, state)
    assert torch.equal(state["weights"]["features.5.weight"], torch.full((4, 4), 7.0))
    assert sorted(update.uplink["global_layers"].state) == sorted(strategy.names)


def test_evaluation_uses_the_current_global_part_or_the_last_trained_model():
    for evaluate_with, expected in (("global", 3.0), ("local", 2.0)):
        strategy = LGFedAvg(evaluate_with=evaluate_with)
        server = method_env(strategy, MLP, [Tier("all", ["m"])])
        trained = {**server.initial_weights("m", 0), "head.bias": torch.full((10,), 2.0)}
        strategy.state.global_weights = {k: torch.full_like(v, 3.0) for k, v in strategy.state.global_weights.items()}
        _, weights = strategy.personal_weights(server.clients[0], {"weights": trained})
        assert torch.equal(weights["head.bias"], torch.full((10,), expected))
        assert torch.equal(weights["features.1.weight"], trained["features.1.weight"])


def test_global_part_must_have_one_shape():
    models = {"a": ModelSpec("digits_mlp", {"hidden": 4}), "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="same shapes"):
        method_env(LGFedAvg(), models, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="between 1 and the model's 2 layers"):
        method_env(LGFedAvg(global_layers=3), MLP, [Tier("all", ["m"])])
    with pytest.raises(ConfigError, match="exactly one model"):
        method_env(LGFedAvg(), models, [Tier("ab", ["a", "b"])])
