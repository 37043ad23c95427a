"""FedTGP: the adaptive margin, the margin contrastive loss, the server's trainable prototypes, sizes sent."""

import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, metrics_rows, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.knowledge.trainable_prototypes import TrainablePrototypes, adaptive_margin, margin_contrastive_loss
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedTGP

D, C = 4, 10  # the tiny MLP's representation size; digits' classes
MLP = {"m": ModelSpec("digits_mlp", {"hidden": D})}
FROZEN = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.0), local_steps=1)


def test_adaptive_margin_is_the_largest_gap_to_the_nearest_other_class_capped_by_tau():
    means = torch.tensor([[0.0, 0.0], [3.0, 4.0], [0.0, 1.0], [9.0, 9.0]])
    present = torch.tensor([True, True, True, False])  # class 3 was not uploaded: not a neighbour
    # gaps: class 0 -> 1 (to class 2), class 1 -> sqrt(9 + 9) (to class 2), class 2 -> 1
    assert adaptive_margin(means, present, 100.0) == pytest.approx(math.sqrt(18))
    assert adaptive_margin(means, present, 2.0) == 2.0
    assert adaptive_margin(means, torch.tensor([True, False, False, False]), 7.0) == 7.0  # no pair: tau


def test_margin_contrastive_loss_by_hand():
    uploaded = torch.tensor([[0.0, 0.0]])
    prototypes = torch.tensor([[0.0, 1.0], [3.0, 4.0]])  # distances 1 and 5
    # logits -(1 + 2) for the own class and -5 for the other: CE = log(1 + e^(-2))
    loss = margin_contrastive_loss(uploaded, torch.tensor([0]), prototypes, 2.0)
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-2.0)))
    labelled_one = margin_contrastive_loss(uploaded, torch.tensor([1]), prototypes, 0.0)
    assert labelled_one.item() == pytest.approx(math.log(1 + math.exp(4.0)))  # logits [-1, -5], class 1


def test_prototype_network_maps_each_class_embedding():
    network = TrainablePrototypes(3, 2, hidden_dim=5)
    every = network()
    assert every.shape == (3, 2)
    # equal up to rounding: a CPU with AVX-512 sums a one-row product in another order than a three-row one
    torch.testing.assert_close(network(torch.tensor([1])), every[1:2], rtol=1e-6, atol=1e-7)
    assert [tuple(p.shape) for p in network.parameters()] == [(3, 2), (5, 2), (5,), (2, 5), (2,)]


def _upload(client, rows: dict[int, list[float]]) -> ClientUpdate:
    labels = sorted(rows)
    vectors = torch.tensor([rows[c] for c in labels])
    stats = ClassStatistics("local_prototypes", {"prototypes": vectors}, torch.tensor(labels, dtype=torch.int32))
    return ClientUpdate(client, 1, {"local_prototypes": stats})


def test_server_trains_persistent_prototypes_with_the_margin_of_the_uploads():
    strategy = FedTGP(server_epochs=3, server_batch_size=2)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    assert strategy.configure_round(1, [c[0]])[0].downlink == {}  # nothing to send before the first round
    before = {k: v.clone() for k, v in strategy.state.network.state_dict().items()}
    # class means over the clients: class 0 -> (0, 0, 0, 0), class 1 -> (3, 4, 0, 0): one gap of 5
    uploads = [_upload(c[0], {0: [1.0, 0, 0, 0], 1: [3.0, 4, 0, 0]}), _upload(c[1], {0: [-1.0, 0, 0, 0]})]
    metrics = strategy.aggregate(1, iter(uploads))
    assert metrics["server/margin"] == pytest.approx(5.0)
    after = strategy.state.network.state_dict()
    assert not torch.equal(after["embedding.weight"], before["embedding.weight"])
    strategy.state.network.eval()
    assert torch.allclose(strategy.state.prototypes, strategy.state.network().detach())
    sent = strategy.configure_round(2, [c[0]])[0].downlink["global_prototypes"]
    assert sent.labels.tolist() == list(range(C)) and sent.nbytes == C * (D + 1) * 4  # every class's prototype
    saved = strategy.state_dict()
    assert set(saved) == {"network", "prototypes"} and torch.equal(saved["network"]["fc.bias"], after["fc.bias"])


def test_trained_prototypes_classify_the_uploads_and_the_loss_falls():
    strategy = FedTGP(server_epochs=1, server_batch_size=4, server_lr=0.1)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    rows = {0: [5.0, 0.0, 0.0, 0.0], 1: [0.0, 5.0, 0.0, 0.0], 2: [0.0, 0.0, 5.0, 0.0]}
    uploads = [_upload(server.clients[0], rows)]
    first = strategy.aggregate(1, iter(uploads))["server/prototype_loss"]
    strategy.server_epochs = 100
    last = strategy.aggregate(2, iter(uploads))["server/prototype_loss"]
    assert last < first
    nearest = torch.cdist(torch.tensor(list(rows.values())), strategy.state.prototypes).argmin(1)
    assert nearest.tolist() == [0, 1, 2]  # each class's upload is nearest its own global prototype


def test_client_uploads_eval_mode_class_means_of_its_training_data():
    strategy = FedTGP()
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=FROZEN)
    client = server.clients[0]
    update = client_update(strategy, server, strategy.configure_round(1, [client])[0])
    sent = update.uplink["local_prototypes"]
    model = server.model("m")
    model.load_state_dict(server.initial_weights("m", client.id))  # lr 0: the trained model is the initial one
    model.eval()
    idx = server.data.clients[client.id].train
    x, y = server.data.x[idx], server.data.y[idx]
    with torch.no_grad():
        h = model.features(x)
    classes = sorted(set(y.tolist()))
    assert sent.labels.tolist() == classes and sent.nbytes == len(classes) * (D + 1) * 4
    expected = torch.stack([h[y == k].mean(0) for k in classes])
    assert torch.allclose(sent.vectors["prototypes"], expected, atol=1e-6)


def test_the_regulariser_enters_the_local_loss_once_prototypes_exist():
    losses = {}
    for lam in (0.0, 10.0):
        strategy = FedTGP(lam=lam)
        server = method_env(strategy, MLP, [Tier("all", ["m"])], training=FROZEN)
        strategy.state.prototypes = torch.full((C, D), 100.0)  # far from every representation
        task = strategy.configure_round(2, [server.clients[0]])[0]
        losses[lam] = client_update(strategy, server, task).metrics["m/loss"]
    assert losses[10.0] > losses[0.0] + 10 * 90**2


def test_evaluation_classifies_by_the_nearest_global_prototype():
    strategy = FedTGP()
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    client = server.clients[0]
    _, before = strategy.personal_weights(client, {})  # no prototypes yet: the client's own head
    assert torch.equal(before["head.weight"], server.initial_weights("m", client.id)["head.weight"])
    strategy.state.prototypes = torch.arange(C * D, dtype=torch.float32).view(C, D)
    _, weights = strategy.personal_weights(client, {})
    h = torch.full((1, D), 13.0)  # nearest to prototype 3 = [12, 13, 14, 15]
    logits = h @ weights["head.weight"].T + weights["head.bias"]
    assert logits.argmax().item() == 3
    local = FedTGP(inference="local_head")
    method_env(local, MLP, [Tier("all", ["m"])])
    local.state.prototypes = strategy.state.prototypes
    assert torch.equal(local.personal_weights(client, {})[1]["head.weight"], before["head.weight"])


def test_needs_one_representation_size_and_valid_options():
    models = {"a": ModelSpec("digits_mlp", {"hidden": 4}), "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="same feature size"):
        method_env(FedTGP(), models, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="FedTGP server_lr must be > 0, got 0.0."):
        FedTGP(server_lr=0.0)
    with pytest.raises(ConfigError, match=r"FedTGP hidden_dim must be >= 1 \(or null\), got 0."):
        FedTGP(hidden_dim=0)


def test_ledger_counts_the_class_prototypes_each_way_per_round(tmp_path):
    out = tmp_path / "fedtgp"
    argv = ["--config", str(ROOT / "recipes" / "digits_fedtgp.yaml"), "--output_dir", str(out), "--rounds", "2"]
    argv += ["--eval_every", "1", "--runtime.progress", "false", "--training.local_steps", "1"]
    argv += ["--strategy.init_args.server_epochs", "1"]
    assert run_cli("fit", *argv) == 0
    rows = metrics_rows(out)
    sent = [(int(r["comm/round_downlink_bytes"]), int(r["comm/round_uplink_bytes"])) for r in rows]
    clients, row = 15, (64 + 1) * 4  # every client every round; a prototype of D = 64 floats and its int32 label
    # each client holds 2 classes (pathological partition): 2 rows up; the server sends all C rows from round 2
    assert sent == [(0, clients * 2 * row), (clients * C * row, clients * 2 * row)]
