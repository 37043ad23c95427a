"""FedNH: the prototype update by hand, the orthogonal start, the clients' class means, the server, the traffic."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, client_update, method_env, read_summary, run_cli

from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights, TensorPayload
from fl_lightning.knowledge.cosine_classifier import cosine_logits
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedNH
from fl_lightning.strategies.fednh import prototype_update

SMALL = {"small": ModelSpec("digits_cnn", {"width": 0.25})}  # 16 features, 10 classes


def test_prototypes_move_toward_the_count_weighted_class_means():
    prototypes = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    # class 0: client A 1 example with mean (0, 1), client B 3 with mean (1, 0); class 1: nobody
    counts = torch.tensor([[1.0, 0.0], [3.0, 0.0]])
    means = torch.tensor([[[0.0, 1.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 0.0]]])
    updated = prototype_update(prototypes, counts, means, smoothing=0.9)
    # mean (3/4, 1/4) normalised: (0.948683, 0.316228); 0.9 (1, 0) + 0.1 of it = (0.994868, 0.031623), normalised
    a, b = 0.9 + 0.1 * 3 / math.sqrt(10), 0.1 * 1 / math.sqrt(10)
    assert torch.allclose(updated[0], torch.tensor([a, b]) / math.hypot(a, b), atol=1e-6)
    assert torch.equal(updated[1], prototypes[1])  # kept


def test_prototypes_start_orthogonal_from_the_run_s_seed_and_bad_set_ups_are_refused():
    strategy = FedNH()
    method_env(strategy, SMALL, [Tier("all", ["small"])])
    p = strategy.state.prototypes
    assert p.shape == (10, 16) and torch.allclose(p @ p.T, torch.eye(10), atol=1e-5)
    again = FedNH()
    method_env(again, SMALL, [Tier("all", ["small"])])
    assert torch.equal(again.state.prototypes, p)
    two = {"a": SMALL["small"], "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="FedNH is defined for one architecture"):
        method_env(FedNH(), two, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="FedNH smoothing must be"):
        FedNH(smoothing=1.5)


def test_a_client_sends_its_extractor_scale_and_unit_class_means():
    strategy = FedNH()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    task = strategy.configure_round(1, [server.clients[0]])[0]
    # the extractor without the unused head: 2,570 - 170 = 2,400 float32; the prototypes 10 x 16 and s
    assert task.downlink["small"].nbytes == 2400 * 4 and task.downlink["prototypes"].nbytes == 161 * 4
    update = client_update(strategy, server, task)
    assert not any(k.startswith("head.") for k in update.uplink["small"].state)
    assert update.uplink["scale"].tensors["scale"].item() != 1.0  # s trains with the extractor
    sent = update.uplink["class_means"].tensors
    model = server.model("small").eval()
    idx = server.data.clients[task.client.id].train
    labels = server.data.y[idx]
    with torch.no_grad():
        embedded = F.normalize(model.features(server.data.x[idx]), dim=1)
    held = torch.unique(labels)
    assert torch.equal(sent["labels"], held)
    assert sent["counts"].tolist() == [float((labels == c).sum()) for c in held]
    expected = F.normalize(torch.stack([embedded[labels == c].mean(0) for c in held]), dim=1)
    assert torch.allclose(sent["means"], expected, atol=1e-5)
    s = len(held)  # per class: its label (int64), count and 16-d mean (float32)
    assert update.uplink["class_means"].nbytes == s * 8 + s * 17 * 4


def test_a_fixed_scale_stays():
    strategy = FedNH(scale_init=30.0, learn_scale=False)
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    update = client_update(strategy, server, strategy.configure_round(1, [server.clients[0]])[0])
    assert update.uplink["scale"].tensors["scale"].item() == 30.0


def test_the_server_averages_uniformly_and_updates_the_prototypes():
    strategy = FedNH()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    before = strategy.state.prototypes.clone()
    uploads = []
    for client, value, n, cls in ((server.clients[0], 1.0, 1, 0), (server.clients[1], 3.0, 3, 1)):
        state = {k: torch.full_like(v, value) for k, v in strategy.extractor(server.initial_weights("small")).items()}
        means = {"labels": torch.tensor([cls]), "counts": torch.tensor([2.0]), "means": before[[cls + 2]]}
        uplink = {
            "small": ModelWeights("small", state),
            "scale": TensorPayload("scale", {"scale": torch.tensor(value)}),
            "class_means": TensorPayload("class_means", means),
        }
        uploads.append(ClientUpdate(client, n, uplink))
    assert strategy.aggregate(1, iter(uploads)) == {"prototypes/scale": 2.0}  # (1 + 3) / 2, not by examples
    weights = strategy.state.global_weights["small"]
    assert all(torch.allclose(v, torch.full_like(v, 2.0)) for k, v in weights.items() if not k.startswith("head."))
    # class 0 moves toward prototype 2, class 1 toward prototype 3, the others stay
    p = strategy.state.prototypes
    assert torch.allclose(p[0], F.normalize(0.9 * before[0] + 0.1 * before[2], dim=0), atol=1e-6)
    assert torch.allclose(p[1], F.normalize(0.9 * before[1] + 0.1 * before[3], dim=0), atol=1e-6)
    assert torch.equal(p[2:], before[2:])


def test_the_folded_model_predicts_the_nearest_prototype():
    strategy = FedNH()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    model = server.model("small").eval()
    x = server.data.x[:64]
    with torch.no_grad():
        fednh = cosine_logits(model.features(x), strategy.state.prototypes, strategy.state.scale)
        model.load_state_dict(strategy.folded(strategy.state.global_weights["small"]))
        folded = model(x)
    assert torch.equal(folded.argmax(1), fednh.argmax(1))


def test_a_run_counts_the_extractor_the_prototypes_and_the_class_means(tmp_path):
    recipe = ["--config", str(ROOT / "recipes" / "digits_fednh.yaml"), "--rounds", "2", "--eval_every", "2"]
    assert run_cli("fit", *recipe, "--runtime.progress", "false", "--output_dir", str(tmp_path / "run")) == 0
    comm = read_summary(tmp_path / "run")["comm"]["by_payload"]
    # 2 rounds x 10 clients of 2 classes each: per client the extractor (2,400 float32) and s up, with 2 labels
    # (int64), 2 counts and 2 x 16 means; the extractor, the 10 x 16 prototypes and s down
    assert comm["uplink"] == {"small": 20 * 2400 * 4, "scale": 20 * 4, "class_means": 20 * (16 + 2 * 17 * 4)}
    assert comm["downlink"] == {"small": 20 * 2400 * 4, "prototypes": 20 * 161 * 4}
