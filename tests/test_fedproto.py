"""FedProto: the prototype regulariser, the global prototypes, nearest-prototype inference, sizes sent."""

import pytest
import torch
from conftest import client_update, method_env

from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedProto
from fl_lightning.strategies.fedproto import ABSENT_CLASS_LOGIT, prototype_head, prototype_loss

D = 4  # the representation size of the tiny MLP below
MLP = {"m": ModelSpec("digits_mlp", {"hidden": D})}


def _upload(client, rows: dict[int, tuple[float, int]]) -> ClientUpdate:
    """A compact upload: class c's prototype has every entry ``rows[c][0]``, its count is ``rows[c][1]``."""
    labels = sorted(rows)
    prototypes = torch.tensor([[rows[c][0]] * D for c in labels])
    counts = torch.tensor([[float(rows[c][1])] for c in labels])
    stats = ClassStatistics(
        "local_prototypes", {"prototypes": prototypes, "counts": counts}, torch.tensor(labels, dtype=torch.int32)
    )
    return ClientUpdate(client, 1, {"local_prototypes": stats})


def _received(strategy, client):
    return strategy.configure_round(2, [client])[0].downlink["global_prototypes"]


@pytest.mark.parametrize("weighting, class0", [("uniform", 2.5), ("samples", 3.25)])
def test_global_prototype_is_the_plain_or_the_count_weighted_mean(weighting, class0):
    strategy = FedProto(weighting=weighting)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_upload(c[0], {0: (1.0, 1), 1: (2.0, 2)}), _upload(c[1], {0: (4.0, 3)})]))
    received = _received(strategy, c[2])
    # uniform: (1 + 4) / 2; samples: (1 x 1 + 4 x 3) / (1 + 3); class 1 has one upload either way
    assert received.labels.tolist() == [0, 1]
    assert torch.allclose(received.vectors["prototypes"], torch.tensor([[class0] * D, [2.0] * D]))
    assert received.nbytes == 2 * (D + 1) * 4  # R classes with a prototype, D floats and an int32 label each


def test_prototypes_are_rebuilt_from_each_rounds_uploads_only():
    strategy = FedProto()
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_upload(c[0], {0: (1.0, 1), 1: (2.0, 1)})]))
    strategy.aggregate(2, iter([_upload(c[1], {1: (6.0, 1)})]))
    received = _received(strategy, c[0])
    assert received.labels.tolist() == [1] and torch.allclose(received.vectors["prototypes"], torch.full((1, D), 6.0))


def test_regulariser_is_the_squared_distance_over_every_element_of_the_batch():
    h = torch.tensor([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 0])
    prototypes = torch.tensor([[0.0, 0.0], [9.0, 9.0]])
    available = torch.tensor([True, False])  # class 1 has no prototype: the second row is skipped
    # rows 0 and 2: (1 + 4) + (0 + 1) = 6, divided by B x D = 6
    assert prototype_loss(h, y, prototypes, available).item() == pytest.approx(1.0)
    assert prototype_loss(h, y, prototypes, torch.tensor([False, False])).item() == 0.0


def test_nearest_prototype_head():
    prototypes = torch.tensor([[0.0, 0.0], [2.0, 0.0], [5.0, 5.0]])
    available = torch.tensor([True, True, False])
    head = prototype_head(prototypes, available)
    h = torch.tensor([[1.5, 0.0], [0.4, 0.0], [5.0, 5.0]])
    logits = h @ head["weight"].T + head["bias"]
    # h = [1.5, 0]: class 0 -> 0, class 1 -> 2 * (2 * 1.5) - 4 = 2, class 2 has no prototype
    assert logits[0].tolist() == [0.0, 2.0, ABSENT_CLASS_LOGIT]
    # [5, 5] sits on the absent class's vector; the nearest class with a prototype is 1 (34 < 50)
    assert logits.argmax(1).tolist() == [1, 0, 1]


def test_evaluation_swaps_in_the_nearest_prototype_head_or_keeps_the_local_one():
    strategy = FedProto()
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    client = server.clients[0]
    _, before = strategy.personal_weights(client, {})  # no prototype yet: the client's own head
    assert torch.equal(before["head.weight"], server.initial_weights("m", client.id)["head.weight"])
    strategy.aggregate(1, iter([_upload(server.clients[1], {3: (1.0, 1)})]))
    _, weights = strategy.personal_weights(client, {})
    assert torch.equal(weights["head.weight"][3], torch.full((D,), 2.0)) and weights["head.bias"][3] == -4.0
    assert weights["head.bias"][0] == ABSENT_CLASS_LOGIT
    local = FedProto(inference="local_head")
    method_env(local, MLP, [Tier("all", ["m"])])
    local.aggregate(1, iter([_upload(server.clients[1], {3: (1.0, 1)})]))
    assert torch.equal(local.personal_weights(client, {})[1]["head.weight"], before["head.weight"])


@pytest.mark.parametrize("weighting, extra", [("uniform", 1), ("samples", 2)])
def test_each_direction_sends_its_classes_prototypes(weighting, extra):
    strategy = FedProto(weighting=weighting)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    client = server.clients[0]
    task = strategy.configure_round(1, [client])[0]
    assert task.downlink["global_prototypes"].nbytes == 0  # nothing aggregated yet
    update = client_update(strategy, server, task)
    sent = update.uplink["local_prototypes"]
    counts = torch.bincount(server.data.y[server.data.clients[0].train], minlength=10)
    classes = [c for c, n in enumerate(counts.tolist()) if n > 0]
    assert sent.labels.tolist() == classes
    assert sent.nbytes == len(classes) * (D + extra) * 4  # S x (D + 1), plus the S counts when weighted
    if weighting == "samples":
        assert sent.vectors["counts"][:, 0].tolist() == [float(counts[c]) for c in classes]
    strategy.aggregate(1, iter([update]))
    assert strategy.configure_round(2, [client])[0].downlink["global_prototypes"].nbytes == len(classes) * (D + 1) * 4


def test_the_regulariser_enters_the_local_loss():
    losses = {}
    for lam in (0.0, 10.0):
        strategy = FedProto(lam=lam)
        server = method_env(strategy, MLP, [Tier("all", ["m"])])
        far = {c: (100.0, 1) for c in range(10)}  # prototypes far from any representation
        strategy.aggregate(1, iter([_upload(server.clients[1], far)]))
        task = strategy.configure_round(2, [server.clients[0]])[0]
        losses[lam] = client_update(strategy, server, task).metrics["m/loss"]
    assert losses[10.0] > losses[0.0] + 100.0  # lam * mean squared distance ~ 10 * 100^2


def test_needs_one_representation_size_and_one_model_per_client():
    models = {"a": ModelSpec("digits_mlp", {"hidden": 4}), "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="same feature size"):
        method_env(FedProto(), models, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="exactly one model"):
        method_env(FedProto(), models, [Tier("ab", ["a", "b"])])
