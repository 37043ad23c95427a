"""FedGH: the class-mean representations (LARs) a client uploads, the server header's one step per LAR, the
model each client is evaluated with, the bytes sent each way, and a run that resumes exactly."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import check_resume, client_update, method_env, metrics_rows

from fl_lightning.client import LocalTraining
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedGH

MLP = {"m": ModelSpec("digits_mlp", {"hidden": 8})}
FROZEN = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), local_epochs=1, batch_size=16)


def test_fedgh_lars_are_class_means_of_representations():
    models = {"m": ModelSpec("digits_mlp", {"hidden": 8})}
    strategy = FedGH(header_lr=0.0)
    server = method_env(strategy, models, [Tier("all", ["m"])], training=FROZEN)
    task = strategy.configure_round(1, [server.clients[1]])[0]
    update = client_update(strategy, server, task)
    lars = update.uplink["lars"]
    module = server._loop.slots["m"].module.eval()
    idx = server.data.clients[1].train
    with torch.no_grad():
        reps = module.features(server.data.x[idx])
    y = server.data.y[idx]
    for row, label in zip(lars.vectors["representations"], lars.labels.tolist()):
        assert torch.allclose(row, reps[y == label].mean(0), atol=1e-6)
    assert lars.nbytes == len(lars.labels) * (8 + 1) * 4  # S x (D + 1) numbers


def test_fedgh_takes_one_header_step_per_lar_in_order():
    strategy = FedGH(header_lr=0.1)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    strategy.state.header = {"weight": torch.zeros(10, 8), "bias": torch.zeros(10)}
    reps = torch.eye(8)[:2]  # LAR of class 0 = e0, LAR of class 1 = e1
    lars = ClassStatistics("lars", {"representations": reps}, torch.tensor([0, 1], dtype=torch.int32))
    strategy.aggregate(1, iter([ClientUpdate(server.clients[0], 1, {"lars": lars})]))
    # step 1 (e0, class 0): logits 0, softmax 0.1 each; grad = p - onehot(0); W[:, 0] = b = -0.1 grad
    first = -0.1 * (torch.full((10,), 0.1) - F.one_hot(torch.tensor(0), 10))
    # step 2 (e1, class 1): logits = W e1 + b = b = first; grad = softmax(first) - onehot(1)
    p1 = math.exp(-0.01) / (math.exp(0.09) + 9 * math.exp(-0.01))
    second = -0.1 * (F.softmax(first, 0) - F.one_hot(torch.tensor(1), 10))
    assert strategy.state.header["weight"][1, 1].item() == pytest.approx(0.1 * (1 - p1), rel=1e-5)  # 0.0901
    assert torch.allclose(strategy.state.header["weight"][:, 0], first)
    assert torch.allclose(strategy.state.header["weight"][:, 1], second)
    assert torch.allclose(strategy.state.header["bias"], first + second)
    assert torch.equal(strategy.state.header["weight"][:, 2:], torch.zeros(10, 6))

    per_client = FedGH(header_lr=0.1, header_update="per_client")  # one step on the mean loss (before)
    method_env(per_client, MLP, [Tier("all", ["m"])])
    per_client.state.header = {"weight": torch.zeros(10, 8), "bias": torch.zeros(10)}
    per_client.aggregate(1, iter([ClientUpdate(server.clients[0], 1, {"lars": lars})]))
    assert per_client.state.header["weight"][1, 1].item() == pytest.approx(0.1 * 0.9 / 2)


def test_fedgh_evaluates_each_clients_locally_trained_model():
    training = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=3, batch_size=16)
    strategy = FedGH()
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=training)
    client = server.clients[0]
    state = {}
    client_update(strategy, server, strategy.configure_round(1, [client])[0], state)
    trained = {k: v.clone() for k, v in server._loop.slots["m"].module.model.state_dict().items()}
    strategy.aggregate(1, iter([]))  # the header is unchanged without uploads: it is still the initial one
    role, weights = strategy.personal_weights(client, state)
    assert role == "m" and weights.keys() == trained.keys()
    assert all(torch.equal(weights[k], trained[k]) for k in trained)  # extractor and header after training
    assert not torch.equal(weights["head.weight"], strategy.state.header["weight"])

    option = FedGH(evaluate_with="global_header")
    method_env(option, MLP, [Tier("all", ["m"])], training=training)
    _, global_header = option.personal_weights(client, state)
    assert torch.equal(global_header["head.weight"], option.state.header["weight"])
    assert torch.equal(global_header["features.1.weight"], trained["features.1.weight"])


def test_fedgh_sends_lars_up_and_the_header_down_and_resumes_exactly(tmp_path):
    """A two-round run stopped after round 1 and resumed equals the uninterrupted one; each round's ledger
    counts S x (D + 1) numbers up per client (S = 2 classes, D = 64) and the global header down."""
    rows = metrics_rows(
        check_resume(tmp_path, "digits_fedgh", "--rounds", "2", "--eval_every", "1", "--training.local_epochs", "1")
    )
    assert int(rows[0]["comm/round_uplink_bytes"]) == 15 * 2 * (64 + 1) * 4  # S(D+1) per client, S = 2 classes
    assert int(rows[0]["comm/round_downlink_bytes"]) == 15 * (64 * 10 + 10) * 4  # the header
    assert int(rows[1]["comm/downlink_bytes"]) == 2 * 15 * (64 * 10 + 10) * 4
