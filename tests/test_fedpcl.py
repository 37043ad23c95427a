"""FedPCL: the prototype-wise contrastive losses by hand, the frozen-backbone model, the prototypes exchanged (and
their bytes in the ledger), and nearest-prototype evaluation."""

import json
import math

import pytest
import torch
import yaml
from conftest import ROOT, TINY, client_update, method_env, metrics_rows, read_summary, run_cli

from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, exchanged_keys
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.knowledge.prototype_contrast import fill_missing, prototype_ce_loss, prototype_supcon_loss
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedPCL
from fl_lightning.strategies.fedproto import ABSENT_CLASS_LOGIT

D = 4  # the projection size of the tiny model below
BACKBONE = [{"builder": "digits_mlp", "args": {"hidden": 16}}]
MODELS = {"m": ModelSpec("frozen_backbones", {"backbones": BACKBONE, "projection_dim": D})}


def _upload(client, rows: dict[int, float]) -> ClientUpdate:
    """A compact upload: class c's prototype has every entry ``rows[c]``."""
    labels = sorted(rows)
    prototypes = torch.tensor([[rows[c]] * D for c in labels])
    stats = ClassStatistics("local_prototypes", {"prototypes": prototypes}, torch.tensor(labels, dtype=torch.int32))
    return ClientUpdate(client, 1, {"local_prototypes": stats})


# ---------------------------------------------------------------------------------------------- the losses
Z = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])  # unit projections of a batch of 3
Y = torch.tensor([0, 1, 0])
P = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # one set: class 0 along x, class 1 along y
ALL = torch.tensor([[True, True]])


def test_supcon_loss_is_minus_the_mean_log_softmax_of_each_anchors_class_over_the_batch():
    # rows 0 and 2 (class 0) anchor at P0 = [1, 0]: similarities to the batch [1, 0, 1], positives rows 0 and 2,
    # each with log-softmax 1 - log(2e + 1); row 1 anchors at P1: [0, 1, 0], its one positive 1 - log(e + 2)
    class0, class1 = math.log(2 * math.e + 1) - 1, math.log(math.e + 2) - 1
    expected = (2 * class0 + class1) / 3
    assert prototype_supcon_loss(Z, Y, P, ALL, 1.0).item() == pytest.approx(expected, rel=1e-6)
    # the sets are summed (the official code adds each client's term)
    two = prototype_supcon_loss(Z, Y, P.repeat(2, 1, 1), ALL.repeat(2, 1), 1.0)
    assert two.item() == pytest.approx(2 * expected, rel=1e-6)
    # a set without class 1 leaves row 1 out of its mean; the temperature divides the similarities
    only0 = prototype_supcon_loss(Z, Y, P, torch.tensor([[True, False]]), 0.5)
    assert only0.item() == pytest.approx(math.log(2 * math.e**2 + 1) - 2, rel=1e-6)


def test_prototype_ce_loss_is_the_cross_entropy_of_the_similarities_averaged_over_the_sets():
    # tau 0.5: row 0's logits [2, 0] -> log(1 + e^-2); row 1's [0, 2] the same; row 2 as row 0
    per_row = math.log(1 + math.exp(-2))
    assert prototype_ce_loss(Z, Y, P, ALL, 0.5).item() == pytest.approx(per_row, rel=1e-6)
    # a second set with the prototypes swapped: every row's logits [0, 2] for its own class -> log(1 + e^2)
    swapped = torch.cat([P, P.flip(1)])
    mean = (per_row + math.log(1 + math.exp(2))) / 2
    assert prototype_ce_loss(Z, Y, swapped, ALL.repeat(2, 1), 0.5).item() == pytest.approx(mean, rel=1e-6)
    # class 1 absent: left out of the softmax (rows 0 and 2 lose nothing) and row 1 out of the mean
    assert prototype_ce_loss(Z, Y, P, torch.tensor([[True, False]]), 0.5).item() == pytest.approx(0.0, abs=1e-6)


def test_missing_classes_of_a_clients_set_come_from_the_global_prototypes():
    sets = torch.tensor([[[1.0], [0.0], [0.0]]])
    has = torch.tensor([[True, False, False]])
    filled, available = fill_missing(sets, has, torch.tensor([[9.0], [8.0], [7.0]]), torch.tensor([True, True, False]))
    assert filled[0, :, 0].tolist() == [1.0, 8.0, 7.0] and available.tolist() == [[True, True, False]]


# ---------------------------------------------------------------------------------------------- the model
def test_frozen_backbones_keep_one_backbone_for_every_build_and_train_only_the_projection():
    torch.manual_seed(1)
    first = ModelSpec("frozen_backbones", {"backbones": BACKBONE, "projection_dim": D}).build(num_classes=10)
    torch.manual_seed(2)
    second = ModelSpec("frozen_backbones", {"backbones": BACKBONE, "projection_dim": D}).build(num_classes=10)
    a, b = first.state_dict(), second.state_dict()
    backbone = [k for k in a if k.startswith("features.0.")]
    assert backbone and all(torch.equal(a[k], b[k]) for k in backbone)  # the same frozen network
    assert not torch.equal(a["features.1.weight"], b["features.1.weight"])  # each build's own projection
    assert not any(p.requires_grad for p in first.features[0].parameters())
    assert set(exchanged_keys(first)) == {"features.1.weight", "features.1.bias", "head.weight", "head.bias"}
    first.train()
    assert not first.features[0].extractors.training  # frozen: eval mode whatever the model's mode
    z = first.features(torch.randn(5, 1, 8, 8))
    assert z.shape == (5, D) and torch.allclose(z.norm(dim=1), torch.ones(5))


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_backbone_weights_are_read_from_a_local_state_dict(tmp_path, suffix):
    from safetensors.torch import save_file

    source = ModelSpec("digits_mlp", {"hidden": 16}).build(num_classes=10)
    with torch.no_grad():
        source.features[1].weight.fill_(0.5)
    path = tmp_path / f"mlp{suffix}"
    if suffix == ".safetensors":
        save_file(source.state_dict(), str(path))
    else:
        torch.save(source.state_dict(), path)
    backbones = [{"builder": "digits_mlp", "args": {"hidden": 16}, "weights": str(path)}]
    model = ModelSpec("frozen_backbones", {"backbones": backbones}).build(num_classes=10)
    assert torch.equal(model.features[0].extractors[0][1].weight, torch.full((16, 64), 0.5))


def test_backbone_weights_that_are_absent_or_do_not_fit_are_refused(tmp_path):
    missing = [{"builder": "digits_mlp", "weights": str(tmp_path / "none.safetensors")}]
    with pytest.raises(ConfigError, match="not found"):
        ModelSpec("frozen_backbones", {"backbones": missing}).build(num_classes=10)
    torch.save(ModelSpec("digits_mlp", {"hidden": 8}).build(num_classes=10).state_dict(), tmp_path / "small.pt")
    wrong = [{"builder": "digits_mlp", "args": {"hidden": 16}, "weights": str(tmp_path / "small.pt")}]
    with pytest.raises(ConfigError, match="do not fit"):
        ModelSpec("frozen_backbones", {"backbones": wrong}).build(num_classes=10)
    with pytest.raises(ConfigError, match="builder and optionally args and weights"):
        ModelSpec("frozen_backbones", {"backbones": [{"model": "digits_mlp"}]}).build(num_classes=10)


# ---------------------------------------------------------------------------------------------- the strategy
def test_round_one_trains_nothing_and_uploads_the_class_means_of_the_projections():
    strategy = FedPCL()
    server = method_env(strategy, MODELS, [Tier("all", ["m"])])
    client = server.clients[0]
    task = strategy.configure_round(1, [client])[0]
    assert sum(p.nbytes for p in task.downlink.values()) == 0  # no prototype exists yet
    state = {}
    update = client_update(strategy, server, task, state)
    initial = server.initial_weights("m", client.id)
    assert all(torch.equal(state["weights"][k], v) for k, v in initial.items())  # not trained
    idx = server.data.clients[0].train
    model = server.model("m").eval()
    model.load_state_dict(initial)
    with torch.no_grad():
        z, y = model.features(server.data.x[idx]), server.data.y[idx]
    sent = update.uplink["local_prototypes"]
    classes = sorted(set(y.tolist()))
    assert sent.labels.tolist() == classes and sent.nbytes == len(classes) * (D + 1) * 4
    expected = torch.stack([z[y == c].mean(0) for c in classes])
    assert torch.allclose(sent.vectors["prototypes"], expected, atol=1e-6)


def test_the_server_averages_a_rounds_uploads_and_keeps_each_clients_latest_set():
    strategy = FedPCL()
    server = method_env(strategy, MODELS, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_upload(c[0], {0: 1.0, 1: 2.0}), _upload(c[1], {0: 4.0})]))
    strategy.aggregate(2, iter([_upload(c[1], {2: 6.0})]))  # client 1's new set replaces its old one
    task = strategy.configure_round(3, [c[2]])[0]
    received = task.downlink["global_prototypes"]  # round 2's uploads only
    assert received.labels.tolist() == [2] and torch.equal(received.vectors["prototypes"], torch.full((1, D), 6.0))
    sets = task.downlink["client_prototypes"]
    assert sets.tensors["owners"].tolist() == [0, 0, 1] and sets.tensors["labels"].tolist() == [0, 1, 2]
    assert sets.tensors["prototypes"][:, 0].tolist() == [1.0, 2.0, 6.0]
    assert received.nbytes == 1 * (D + 1) * 4 and sets.nbytes == 3 * (D + 2) * 4  # R(D + 1) and M(D + 2)
    strategy.aggregate(3, iter([_upload(c[0], {0: 1.0}), _upload(c[1], {0: 3.0})]))
    assert torch.equal(strategy.state.global_prototypes[0], torch.full((D,), 2.0))  # unweighted: (1 + 3) / 2


def test_a_round_with_prototypes_trains_the_projection_and_leaves_the_backbone():
    for loss in ("supcon", "prototype_ce"):
        strategy = FedPCL(loss=loss)
        server = method_env(strategy, MODELS, [Tier("all", ["m"])])
        client = server.clients[0]
        strategy.aggregate(1, iter([client_update(strategy, server, t) for t in strategy.configure_round(1, [client])]))
        state = {}
        update = client_update(strategy, server, strategy.configure_round(2, [client])[0], state)
        initial = server.initial_weights("m", client.id)
        assert update.metrics["m/loss"] > 0
        assert not torch.equal(state["weights"]["features.1.weight"], initial["features.1.weight"])
        assert all(torch.equal(state["weights"][k], v) for k, v in initial.items() if k.startswith("features.0."))
        assert torch.equal(state["weights"]["head.weight"], initial["head.weight"])  # no loss reads the head


def test_evaluation_is_by_the_nearest_own_or_global_prototype():
    own, shared = FedPCL(inference="own"), FedPCL(inference="global")
    for strategy in (own, shared):
        server = method_env(strategy, MODELS, [Tier("all", ["m"])])
        c = server.clients
        _, before = strategy.personal_weights(c[0], {})  # no prototype yet: the model's own head
        assert torch.equal(before["head.weight"], server.initial_weights("m", c[0].id)["head.weight"])
        strategy.aggregate(1, iter([_upload(c[0], {3: 1.0}), _upload(c[1], {3: 3.0, 5: 0.5})]))
    _, weights = own.personal_weights(c[0], {})  # client 0's own set: class 3 at 1.0, nothing else
    assert torch.equal(weights["head.weight"][3], torch.full((D,), 2.0)) and weights["head.bias"][3] == -D
    assert weights["head.bias"][5] == ABSENT_CLASS_LOGIT
    _, weights = shared.personal_weights(c[0], {})  # global: class 3 at 2.0, class 5 at 0.5
    assert torch.equal(weights["head.weight"][3], torch.full((D,), 4.0)) and weights["head.bias"][5] == -D / 4
    _, weights = own.personal_weights(c[2], {})  # client 2 has uploaded nothing: the global prototypes
    assert weights["head.bias"][5] == -D / 4


def test_a_model_without_unit_length_features_or_a_bad_temperature_is_refused():
    with pytest.raises(ConfigError, match="unit-length projections"):
        method_env(FedPCL(), {"m": ModelSpec("digits_mlp", {"hidden": D})}, [Tier("all", ["m"])])
    with pytest.raises(ConfigError, match="FedPCL tau must be > 0, got 0.0."):
        FedPCL(tau=0.0)


def test_the_ledger_counts_the_prototypes_each_way(tmp_path):
    recipe = dict(TINY, rounds=2, eval_every=1)
    recipe.update(
        models={"global": {"builder": "frozen_backbones", "args": {"backbones": BACKBONE, "projection_dim": D}}},
        sampler={"class_path": "fl_lightning.federation.sampling.UniformSampler", "init_args": {"fraction": 1.0}},
        strategy={"class_path": "fl_lightning.strategies.FedPCL", "init_args": {"split": "global"}},
    )
    recipe["population"] = {"num_clients": 4, "tiers": [{"name": "all", "roles": ["global"]}]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert run_cli("fit", "--config", str(tmp_path / "r.yaml"), "--output_dir", str(tmp_path / "run")) == 0
    clients = json.loads((tmp_path / "run" / "partition.json").read_text())["clients"]
    held = [{c for c, n in enumerate(client["class_counts"]) if n} for client in clients]
    rows = sum(len(classes) for classes in held)  # M: every client's set, S_j rows each
    union = len(set().union(*held))  # R: the classes of the global prototypes
    metrics = metrics_rows(tmp_path / "run")
    assert [int(r["comm/round_uplink_bytes"]) for r in metrics] == [rows * (D + 1) * 4] * 2
    down = 4 * (union * (D + 1) + rows * (D + 2)) * 4  # each of 4 clients: the global set and every client's
    assert [int(r["comm/round_downlink_bytes"]) for r in metrics] == [0, down]


@pytest.mark.slow  # two digits runs
def test_the_projection_learns_beyond_the_random_frozen_features(tmp_path):
    """Under Dirichlet(0.5) label skew (a client's test split holds up to 10 classes) the nearest own prototype of
    the untrained projection (round 1 trains nothing) reaches 0.713; ten rounds of the contrastive loss 0.813."""
    skew = "{class_path: fl_lightning.data.DirichletPartitioner, init_args: {alpha: 0.5}}"
    accuracy = {}
    for rounds in (1, 10):
        out = tmp_path / str(rounds)
        argv = ["--config", str(ROOT / "recipes" / "digits_fedpcl.yaml"), "--data.init_args.partitioner", skew]
        argv += ["--rounds", str(rounds), "--eval_every", str(rounds), "--runtime.progress", "false"]
        assert run_cli("fit", *argv, "--output_dir", str(out)) == 0
        accuracy[rounds] = read_summary(out)["final"]["personal/test_acc"]
    assert accuracy[10] >= accuracy[1] + 0.05, accuracy
