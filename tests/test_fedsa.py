"""FedSA: the anchors' initialisation and margin, the three anchor-based losses by hand, the server's anchor update,
the client's margin and prototypes, sizes sent."""

import csv
import json
import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.knowledge.semantic_anchors import (
    anchor_distances,
    anchor_regularisation,
    classifier_calibration,
    initial_anchors,
    margin_contrastive_loss,
    mean_nearest_distance,
)
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedSA

D, C = 4, 10  # the tiny MLP's representation size; digits' classes
MLP = {"m": ModelSpec("digits_mlp", {"hidden": D})}


def test_initial_anchors_are_the_projected_random_rows_and_follow_the_seed():
    anchors = initial_anchors(C, D, 7)
    assert anchors.shape == (C, D) and bool((anchors >= 0).all())  # after a ReLU
    # batch norm over the C rows, then ReLU: each column's non-zero entries are the positive standardised ones
    assert torch.equal(anchors, initial_anchors(C, D, 7)) and not torch.equal(anchors, initial_anchors(C, D, 8))
    state = torch.get_rng_state()
    initial_anchors(C, D, 7)
    assert torch.equal(state, torch.get_rng_state())  # the run's own random stream is not touched


def test_mean_nearest_distance_by_hand():
    rows = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0]])
    # nearest distances: 1 (row 2), sqrt(9 + 9) (row 2), 1 (row 0)
    assert mean_nearest_distance(rows) == pytest.approx((1 + math.sqrt(18) + 1) / 3)
    assert mean_nearest_distance(rows[:1]) == float("-inf")


def test_the_three_losses_by_hand():
    anchors = torch.tensor([[0.0, 0.0], [3.0, 4.0]])
    h = torch.tensor([[0.0, 1.0], [3.0, 0.0]])
    y = torch.tensor([0, 1])
    assert torch.allclose(anchor_distances(h, anchors), torch.tensor([[1.0, math.sqrt(18)], [3.0, 4.0]]))
    # regularisation: MSE to the own anchor: ((0 + 1) + (0 + 16)) / 4
    assert anchor_regularisation(h, y, anchors).item() == pytest.approx(17 / 4)
    # margin contrastive, gap 2: row 0 logits -(1 + 2), -sqrt(18); row 1 logits -3, -(4 + 2)
    row0 = 3.0 + math.log(math.exp(-3.0) + math.exp(-math.sqrt(18)))
    row1 = 6.0 + math.log(math.exp(-3.0) + math.exp(-6.0))
    assert margin_contrastive_loss(h, y, anchors, 2.0).item() == pytest.approx((row0 + row1) / 2, rel=1e-5)
    logits = torch.tensor([[2.0, 0.0], [1.0, 1.0]])
    expected = (-math.log(math.exp(2) / (math.exp(2) + 1)) + math.log(2)) / 2
    assert classifier_calibration(logits).item() == pytest.approx(expected, rel=1e-6)


def _update(client, rows: dict[int, float]) -> ClientUpdate:
    labels = sorted(rows)
    vectors = {"prototypes": torch.tensor([[rows[c]] * D for c in labels])}
    upload = ClassStatistics("local_prototypes", vectors, torch.tensor(labels, dtype=torch.int32))
    return ClientUpdate(client, 10, {"local_prototypes": upload})


def test_server_averages_prototypes_and_moves_the_uploaded_classes_anchors():
    strategy = FedSA(momentum=0.75)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    before = strategy.state.anchors.clone()
    assert torch.equal(before, initial_anchors(C, D, server.seed))
    strategy.aggregate(1, iter([_update(c[0], {0: 1.0, 1: 2.0}), _update(c[1], {0: 3.0})]))
    # class 0: the plain mean 2; class 1: 2; the others keep their anchors
    assert torch.allclose(strategy.state.anchors[0], 0.75 * before[0] + 0.25 * 2.0)
    assert torch.allclose(strategy.state.anchors[1], 0.75 * before[1] + 0.25 * 2.0)
    assert torch.equal(strategy.state.anchors[2:], before[2:])
    task = strategy.configure_round(2, [c[0]])[0]
    assert set(task.downlink) == {"semantic_anchors"} and task.downlink["semantic_anchors"].nbytes == C * D * 4
    assert set(strategy.state_dict()) == {"bank", "anchors"}


def test_client_keeps_its_prototypes_margin_and_uploads_its_class_means():
    strategy = FedSA()
    frozen = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.0), local_epochs=1)
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=frozen)
    client = server.clients[0]
    state: dict = {}
    update = client_update(strategy, server, strategy.configure_round(1, [client])[0], state)
    model = server.model("m")
    model.load_state_dict(server.initial_weights("m"))  # lr 0: every step's model is the one received
    idx = server.data.clients[client.id].train
    x, y = server.data.x[idx], server.data.y[idx]
    with torch.no_grad():
        h = model.features(x)
    classes = sorted(set(y.tolist()))
    sent = update.uplink["local_prototypes"]
    means = torch.stack([h[y == k].mean(0) for k in classes])
    assert sent.labels.tolist() == classes and sent.nbytes == len(classes) * (D + 1) * 4
    assert torch.allclose(sent.vectors["prototypes"], means, atol=1e-5)
    assert float(state["local_gap"]) == pytest.approx(mean_nearest_distance(means), rel=1e-4)


def test_every_anchor_term_enters_the_client_loss():
    def loss(**weights):
        strategy = FedSA(**weights)
        frozen = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.0), local_steps=1)
        server = method_env(strategy, MLP, [Tier("all", ["m"])], training=frozen)
        strategy.state.anchors = torch.full((C, D), 100.0) * torch.eye(C, D)
        return client_update(strategy, server, strategy.configure_round(1, [server.clients[0]])[0]).metrics["m/loss"]

    off = {"lam": 0.0, "margin_contrastive": 0.0, "calibration": 0.0}
    base = loss(**off)
    assert loss(**{**off, "lam": 1.0}) > base + 100**2 / D / 2  # half the rows' own anchor is 100 away
    assert loss(**{**off, "margin_contrastive": 1.0}) > base + 1
    assert loss(**{**off, "calibration": 1.0}) > base + 1  # the head's logits of anchors 100 long are far off


def test_needs_one_representation_size_and_a_momentum_fraction():
    models = {"a": ModelSpec("digits_mlp", {"hidden": 4}), "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="same feature size"):
        method_env(FedSA(), models, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="FedSA momentum must be in"):
        FedSA(momentum=1.5)


def test_ledger_counts_anchors_and_prototypes(tmp_path):
    out = tmp_path / "fedsa"
    argv = ["--config", str(ROOT / "recipes" / "digits_fedsa.yaml"), "--output_dir", str(out), "--rounds", "2"]
    argv += ["--eval_every", "1", "--runtime.progress", "false", "--training.local_epochs", "1"]
    assert run_cli("fit", *argv) == 0
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    sent = [(int(r["comm/round_downlink_bytes"]), int(r["comm/round_uplink_bytes"])) for r in rows]
    counts = torch.tensor([c["class_counts"] for c in json.loads((out / "partition.json").read_text())["clients"]])
    up = int((counts > 0).sum()) * (64 + 1) * 4  # a whole epoch: every class a client holds
    assert sent == [(15 * C * 64 * 4, up)] * 2  # the anchors to all 15 clients; no model travels


def test_anchor_margin_is_reported():
    strategy = FedSA()
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    metrics = strategy.aggregate(1, iter([_update(server.clients[0], {0: 1.0})]))
    assert metrics["server/anchor_margin"] == pytest.approx(mean_nearest_distance(strategy.state.anchors))
