"""FPL: FINCH's partitions by hand, the server's cluster prototypes, the two losses by hand, the client's
prototypes of the last local epoch, sizes sent."""

import csv
import json
import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.client.module import ClientModule
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.knowledge.clustered_prototypes import clustered_prototypes, fpl_loss, unbiased_prototypes
from fl_lightning.knowledge.finch import finch, first_neighbours, first_partition
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FPL

D, C = 4, 10  # the tiny MLP's representation size; digits' classes
MLP = {"m": ModelSpec("digits_mlp", {"hidden": D})}


def _angle(degrees: float) -> list[float]:
    return [math.cos(math.radians(degrees)), math.sin(math.radians(degrees))]


def test_first_partition_links_first_neighbours_by_cosine_distance():
    # unit vectors at 0, 10, 90, 100, 180 degrees: first neighbours 1, 0, 3, 2 and, for 180, 100 (80 degrees
    # away, closer than 0's 180): so {0, 1} and {2, 3, 4}
    rows = torch.tensor([_angle(a) for a in (0, 10, 90, 100, 180)])
    assert first_neighbours(rows).tolist() == [1, 0, 3, 2, 3]
    assert first_partition(rows).tolist() == [0, 0, 1, 1, 1]
    # lengths do not count (cosine): 0 degrees at length 5 is still row 1's first neighbour
    assert first_partition(rows * torch.tensor([[5.0], [1], [1], [1], [1]])).tolist() == [0, 0, 1, 1, 1]
    assert first_partition(rows[:1]).tolist() == [0]


def test_finch_merges_cluster_means_until_one_would_remain():
    # four tight pairs at 0/5, 20/25, 90/95, 110/115 degrees: first partition the four pairs; their means
    # (2.5, 22.5, 92.5, 112.5 degrees) pair up again into two; a third step would leave one, so two partitions
    rows = torch.tensor([_angle(a) for a in (0, 5, 20, 25, 90, 95, 110, 115)])
    partitions = finch(rows)
    assert [p.tolist() for p in partitions] == [[0, 0, 1, 1, 2, 2, 3, 3], [0, 0, 0, 0, 1, 1, 1, 1]]
    # two rows are one cluster: one partition
    assert [p.tolist() for p in finch(rows[:2])] == [[0, 0]]


def test_server_clusters_each_class_s_prototypes_and_keeps_a_single_one():
    prototypes = torch.tensor([[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0], [2.0, 2.0]])
    labels = torch.tensor([3, 3, 3, 3, 7])
    clusters, cluster_labels = clustered_prototypes(prototypes, labels, C)
    # class 3: {0, 1} and {2, 3} (one partition: the two means would merge into one), each replaced by its mean
    assert cluster_labels.tolist() == [3, 3, 7]
    assert torch.allclose(clusters, torch.tensor([[1.0, 0.05], [0.05, 1.0], [2.0, 2.0]]))
    unbiased, available = unbiased_prototypes(clusters, cluster_labels, C)
    assert torch.allclose(unbiased[3], torch.tensor([0.525, 0.525])) and torch.allclose(unbiased[7], clusters[2])
    assert available.nonzero().flatten().tolist() == [3, 7]


def test_the_two_losses_by_hand():
    clusters = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]])  # classes 0, 0, 1
    cluster_labels = torch.tensor([0, 0, 1])
    unbiased, available = unbiased_prototypes(clusters, cluster_labels, 3)  # class 0: (0.5, 0.5); class 2: none
    h = torch.tensor([[2.0, 0.0], [0.0, 3.0]])
    labels = torch.tensor([0, 2])  # the second row's class has no prototype: it adds 0 but counts in the mean
    tau = 0.5
    # row 0: cosines 1, 0, -1; InfoNCE -log((e^2 + e^0) / (e^2 + e^0 + e^-2)); MSE ((1.5^2 + 0.5^2) / 2)
    contrastive = -math.log((math.exp(2) + 1) / (math.exp(2) + 1 + math.exp(-2)))
    consistency = (1.5**2 + 0.5**2) / 2
    loss = fpl_loss(h, labels, clusters, cluster_labels, unbiased, available, tau)
    assert loss.item() == pytest.approx((contrastive + consistency) / 2, rel=1e-5)
    weighted = fpl_loss(h, labels, clusters, cluster_labels, unbiased, available, tau, contrastive=2, consistency=0)
    assert weighted.item() == pytest.approx(contrastive, rel=1e-5)


def _update(server, client, value: float, classes: dict[int, list[float]]):
    model = {k: torch.full_like(v, value) for k, v in server.initial_weights("m").items()}
    labels = sorted(classes)
    vectors = {"prototypes": torch.tensor([classes[c] for c in labels])}
    uplink = {
        "m": ModelWeights("m", model),
        "local_prototypes": ClassStatistics("prototypes", vectors, torch.tensor(labels, dtype=torch.int32)),
    }
    return ClientUpdate(client, 10, uplink)


def test_server_averages_models_clusters_prototypes_and_sends_them():
    strategy = FPL()
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    assert set(strategy.configure_round(1, [c[0]])[0].downlink) == {"m"}  # no prototype yet
    first = _update(server, c[0], 1.0, {0: [1.0, 0, 0, 0], 1: [0, 1.0, 0, 0]})
    second = _update(server, c[1], 4.0, {0: [1.0, 0.1, 0, 0]})
    third = _update(server, c[2], 0.0, {0: [0, 0, 1.0, 0]})
    second.num_samples = 30
    strategy.aggregate(1, iter([first, second, third]))
    # models by examples: (1 x 10 + 4 x 30 + 0 x 10) / 50 = 2.6
    assert all(
        torch.allclose(v.float(), torch.full_like(v.float(), 2.6)) for v in strategy.state.global_weights["m"].values()
    )
    # class 0: first neighbours 1, 0, 0 (the third is orthogonal to both; the first comes first): one cluster
    assert strategy.state.cluster_labels.tolist() == [0, 1]
    assert torch.allclose(strategy.state.clusters[0], torch.tensor([2 / 3, 0.1 / 3, 1 / 3, 0]))
    task = strategy.configure_round(2, [c[0]])[0]
    assert set(task.downlink) == {"m", "cluster_prototypes"}
    assert task.downlink["cluster_prototypes"].nbytes == 2 * (D + 1) * 4
    assert set(strategy.state_dict()) == {"global_weights", "clusters", "cluster_labels"}


def test_client_uploads_the_class_means_of_its_last_epoch_s_training_representations():
    strategy = FPL()
    frozen = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.0), local_epochs=2)
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=frozen)
    client = server.clients[0]
    update = client_update(strategy, server, strategy.configure_round(1, [client])[0])
    model = server.model("m")
    model.load_state_dict(server.initial_weights("m"))  # lr 0: every step's model is the one received
    model.train()  # the digits MLP has no dropout or batch norm: training mode gives the eval-mode values
    idx = server.data.clients[client.id].train
    x, y = server.data.x[idx], server.data.y[idx]
    with torch.no_grad():
        h = model.features(x)
    classes = sorted(set(y.tolist()))
    sent = update.uplink["local_prototypes"]
    assert sent.labels.tolist() == classes and sent.nbytes == len(classes) * (D + 1) * 4
    assert torch.allclose(sent.vectors["prototypes"], torch.stack([h[y == k].mean(0) for k in classes]), atol=1e-5)


def test_the_uploaded_prototypes_are_the_last_epoch_s(monkeypatch):
    """Trained for two epochs (the model moves), the upload is the class means of the second epoch's training-mode
    representations, each taken before its step, and not those of both epochs."""
    import fl_lightning.strategies.fpl as fpl

    seen, original = [], fpl.ce_step

    def recording(module, batch, i):  # the round-1 step (not marked pure: the sequential loop), its records kept
        loss, record = original(module, batch, i)
        seen.append(tuple(t.detach().clone() for t in record))
        return loss, record

    monkeypatch.setattr(fpl, "ce_step", recording)
    strategy = FPL()
    training = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.5), local_epochs=2, batch_size=16)
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=training)
    client = server.clients[0]
    sent = client_update(strategy, server, strategy.configure_round(1, [client])[0]).uplink["local_prototypes"]
    per_epoch = len(seen) // 2
    assert per_epoch == -(-len(server.data.clients[client.id].train) // 16) and len(seen) == 2 * per_epoch

    def means(records):
        y, h = torch.cat([r[0] for r in records]), torch.cat([r[1] for r in records])
        return torch.stack([h[y == k].mean(0) for k in sent.labels.tolist()])

    assert torch.allclose(sent.vectors["prototypes"], means(seen[per_epoch:]), atol=1e-6)
    assert not torch.allclose(sent.vectors["prototypes"], means(seen), atol=1e-3)
    # with drop_last an epoch is its full batches only: the last epoch's are still the upload
    seen.clear()
    training.drop_last = True
    sent = client_update(strategy, server, strategy.configure_round(1, [client])[0]).uplink["local_prototypes"]
    per_epoch = len(seen) // 2
    assert per_epoch == len(server.data.clients[client.id].train) // 16 and len(seen) == 2 * per_epoch
    assert torch.allclose(sent.vectors["prototypes"], means(seen[per_epoch:]), atol=1e-6)


def test_prototype_terms_enter_the_client_loss_once_clusters_exist():
    losses = {}
    for weight in (0.0, 1.0):
        strategy = FPL(contrastive=weight, consistency=weight)
        frozen = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.0), local_steps=1)
        server = method_env(strategy, MLP, [Tier("all", ["m"])], training=frozen)
        strategy.state.clusters = torch.full((C, D), 100.0)
        strategy.state.cluster_labels = torch.arange(C)
        task = strategy.configure_round(2, [server.clients[0]])[0]
        losses[weight] = client_update(strategy, server, task).metrics["m/loss"]
    assert losses[1.0] > losses[0.0] + 90**2  # the consistency term alone: (100 - h)^2 with h small


def test_step_trains_the_whole_model():
    strategy = FPL()
    model = MLP["m"].build(num_classes=C, in_channels=1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    clusters, labels = torch.randn(C, D), torch.arange(C)
    unbiased, available = unbiased_prototypes(clusters, labels, C)
    step = strategy.local_step(clusters, labels, unbiased, available)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    loss, (y, h) = step(ClientModule(model, None), (torch.rand(6, 1, 8, 8), torch.arange(6)), 0)
    loss.backward()
    optimizer.step()
    assert y.tolist() == list(range(6)) and h.shape == (6, D)
    assert all(not torch.equal(v, start[k]) for k, v in model.state_dict().items() if v.is_floating_point())


def test_needs_one_representation_size():
    models = {"a": ModelSpec("digits_mlp", {"hidden": 4}), "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="same feature size"):
        method_env(FPL(), models, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="FPL tau must be > 0, got 0.0."):
        FPL(tau=0.0)


def test_ledger_counts_models_prototypes_and_clusters(tmp_path):
    out = tmp_path / "fpl"
    argv = ["--config", str(ROOT / "recipes" / "digits_fpl.yaml"), "--output_dir", str(out), "--rounds", "2"]
    argv += ["--eval_every", "1", "--runtime.progress", "false", "--training.local_epochs", "1"]
    assert run_cli("fit", *argv) == 0
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    sent = [(int(r["comm/round_downlink_bytes"]), int(r["comm/round_uplink_bytes"])) for r in rows]
    specs = {
        "cnn_small": ModelSpec("digits_cnn", {"channels": 16, "hidden": 64}),
        "cnn_large": ModelSpec("digits_cnn", {"channels": 48, "hidden": 64}),
        "mlp": ModelSpec("digits_mlp", {"hidden": 64, "depth": 2}),
    }
    states = [spec.build(num_classes=C, in_channels=1).state_dict() for spec in specs.values()]
    models = 4 * sum(v.numel() * v.element_size() for state in states for v in state.values())  # 4 per architecture
    counts = torch.tensor([c["class_counts"] for c in json.loads((out / "partition.json").read_text())["clients"]])
    up = models + int((counts > 0).sum()) * (64 + 1) * 4  # a whole epoch: every class a client holds is uploaded
    # round 1's clusters, as its metrics count them, go to all 12 clients in round 2
    first = rows[0]
    clusters = round(float(first["server/classes_with_prototype"]) * float(first["server/clusters_per_class"]))
    assert clusters >= int((counts > 0).any(0).sum())
    assert sent == [(models, up), (models + 12 * clusters * (64 + 1) * 4, up)]
