"""FedHKD: the two hyper-knowledge losses, the privacy noise, the server's count-weighted hyper-knowledge and model
averages, the client's upload, sizes sent."""

import csv
import json
import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.knowledge.hyper_knowledge import (
    privacy_noise,
    representation_loss,
    soft_prediction_loss,
    soft_predictions,
)
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedHKD

D, C = 4, 10  # the tiny MLP's representation size; digits' classes
MLP = {"m": ModelSpec("digits_mlp", {"hidden": D})}
FROZEN = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.0), local_steps=1)


def test_soft_predictions_are_a_softmax_at_temperature():
    q = soft_predictions(torch.tensor([[0.0, math.log(2.0)]]), 0.5)  # logits / T = [0, 2 log 2]: e^0 : e^(log 4)
    assert torch.allclose(q, torch.tensor([[1 / 5, 4 / 5]]))


def test_soft_prediction_term_by_hand():
    head_soft = torch.tensor([[0.5, 0.5], [0.9, 0.1], [0.2, 0.8]])
    global_soft = torch.tensor([[1.0, 0.0], [0.6, 0.5], [0.0, 1.0]])
    available = torch.tensor([True, True, False])  # the third class has no hyper-knowledge: left out
    # paper: mean over the 2 available classes of ||.||_2: (sqrt(0.25 + 0.25) + sqrt(0.09 + 0.16)) / 2
    paper = soft_prediction_loss(head_soft, global_soft, available, "paper")
    assert paper.item() == pytest.approx((math.sqrt(0.5) + 0.5) / 2)
    # official: KLDivLoss's element-wise mean over the 2 x 2 entries of Q (log Q - log head), 0 log 0 = 0
    kl = 1.0 * math.log(1 / 0.5) + 0.6 * math.log(0.6 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    official = soft_prediction_loss(head_soft, global_soft, available, "official")
    assert official.item() == pytest.approx(kl / 4)


def test_representation_term_by_hand():
    features = torch.tensor([[3.0, 4.0], [1.0, 1.0], [5.0, 5.0]])
    labels = torch.tensor([0, 1, 2])
    means = torch.tensor([[0.0, 0.0], [1.0, 2.0], [0.0, 0.0]])
    available = torch.tensor([True, True, False])  # the third row's class has no mean: 0, but counts in B
    paper = representation_loss(features, labels, means, available, "paper")
    assert paper.item() == pytest.approx((5.0 + 1.0) / 3)  # ||(3, 4)|| and ||(0, -1)||, over B = 3
    official = representation_loss(features, labels, means, available, "official")
    assert official.item() == pytest.approx((25.0 + 1.0) / (3 * 2))  # MSE over B x D elements


def test_representation_term_has_a_finite_gradient_where_a_row_equals_its_mean():
    features = torch.tensor([[1.0, 2.0]], requires_grad=True)
    representation_loss(
        features, torch.tensor([0]), torch.tensor([[1.0, 2.0]]), torch.tensor([True]), "paper"
    ).backward()
    assert torch.isfinite(features.grad).all()


def test_privacy_noise_has_the_gaussian_mechanism_s_scale():
    means = torch.zeros(2, 3)
    noise = privacy_noise(means, torch.tensor([4.0, 1.0]), torch.tensor([8, 2]), 0.5, torch.Generator().manual_seed(3))
    draws = torch.randn(2, 3, generator=torch.Generator().manual_seed(3))
    # sigma * 2 zeta_j / n_j: 0.5 * 2 * 4 / 8 = 0.5 and 0.5 * 2 * 1 / 2 = 0.5; then 2 * 2 * 3 / 1 = 12
    assert torch.allclose(noise, draws * torch.tensor([[0.5], [0.5]]))
    one = privacy_noise(means[:1], torch.tensor([3.0]), torch.tensor([1]), 2.0, torch.Generator().manual_seed(3))
    assert torch.allclose(one, draws[:1] * 12.0)


def _upload(client, rows: dict[int, tuple[float, float, int]], weights=None) -> ClientUpdate:
    """Class c's mean representation has every entry ``rows[c][0]``, its soft prediction every entry
    ``rows[c][1]``, its count is ``rows[c][2]``."""
    labels = sorted(rows)
    vectors = {
        "representations": torch.tensor([[rows[c][0]] * D for c in labels]),
        "soft_predictions": torch.tensor([[rows[c][1]] * C for c in labels]),
        "counts": torch.tensor([[float(rows[c][2])] for c in labels]),
    }
    uplink = {"hyper_knowledge": ClassStatistics("hyper_knowledge", vectors, torch.tensor(labels, dtype=torch.int32))}
    if weights is not None:
        uplink["weights"] = ModelWeights("m", weights)
    return ClientUpdate(client, 10, uplink)


def test_server_averages_hyper_knowledge_by_class_counts_and_keeps_classes_nobody_sent():
    strategy = FedHKD(share_weights=False)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    assert "hyper_knowledge" not in strategy.configure_round(1, [c[0]])[0].downlink  # none before round 1
    # class 0: (1 x 1 + 4 x 3) / 4 = 3.25 and soft (0.1 + 0.3 x 3) / 4 = 0.25; class 1: client 0's alone
    strategy.aggregate(
        1, iter([_upload(c[0], {0: (1.0, 0.1, 1), 1: (2.0, 0.2, 2)}), _upload(c[1], {0: (4.0, 0.3, 3)})])
    )
    sent = strategy.configure_round(2, [c[2]])[0].downlink["hyper_knowledge"]
    assert sent.labels.tolist() == [0, 1] and sent.nbytes == 2 * (D + C + 1) * 4  # no counts go down
    assert torch.allclose(sent.vectors["representations"], torch.tensor([[3.25] * D, [2.0] * D]))
    assert torch.allclose(sent.vectors["soft_predictions"], torch.tensor([[0.25] * C, [0.2] * C]))
    strategy.aggregate(2, iter([_upload(c[0], {1: (6.0, 0.5, 1)})]))  # class 0 not sent: its last value stays
    assert torch.allclose(strategy.state.representations[:2], torch.tensor([[3.25] * D, [6.0] * D]))
    assert strategy.state.available.tolist() == [True, True] + [False] * (C - 2)
    saved = strategy.state_dict()
    assert set(saved) == {"global_weights", "representations", "soft_predictions", "available"}


@pytest.mark.parametrize("weighted, expected", [(True, 2.5), (False, 2.0)])
def test_server_averages_each_role_s_models_by_examples_or_uniformly(weighted, expected):
    strategy = FedHKD(weighted=weighted)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    ones = {k: torch.ones_like(v) for k, v in strategy.state.global_weights["m"].items()}
    first, second = (
        _upload(c[0], {0: (1.0, 0.1, 1)}, ones),
        _upload(c[1], {0: (1.0, 0.1, 1)}, {k: 3 * v for k, v in ones.items()}),
    )
    second.num_samples = 30  # (1 x 10 + 3 x 30) / 40 = 2.5 weighted; (1 + 3) / 2 uniformly
    strategy.aggregate(1, iter([first, second]))
    sent = strategy.configure_round(2, [c[2]])[0].downlink["weights"]
    assert all(torch.allclose(v.float(), torch.full_like(v.float(), expected)) for v in sent.state.values())


def test_client_uploads_eval_mode_class_means_of_representations_and_soft_predictions():
    strategy = FedHKD(temperature=0.5)
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=FROZEN)
    client = server.clients[0]
    task = strategy.configure_round(1, [client])[0]
    update = client_update(strategy, server, task)
    sent = update.uplink["hyper_knowledge"]
    model = server.model("m")
    model.load_state_dict(strategy.state.global_weights["m"])  # lr 0: the trained model is the global one
    model.eval()
    idx = server.data.clients[client.id].train
    x, y = server.data.x[idx], server.data.y[idx]
    with torch.no_grad():
        h = model.features(x)
        q = torch.softmax(model.head(h) / 0.5, dim=1)
    classes = sorted(set(y.tolist()))
    assert sent.labels.tolist() == classes and sent.nbytes == len(classes) * (D + C + 1 + 1) * 4
    assert torch.allclose(sent.vectors["representations"], torch.stack([h[y == k].mean(0) for k in classes]), atol=1e-6)
    assert torch.allclose(
        sent.vectors["soft_predictions"], torch.stack([q[y == k].mean(0) for k in classes]), atol=1e-6
    )
    assert sent.vectors["counts"][:, 0].tolist() == [float((y == k).sum()) for k in classes]
    weights = update.uplink["weights"].state
    assert all(torch.equal(v, strategy.state.global_weights["m"][k]) for k, v in weights.items())


def test_threshold_keeps_classes_below_the_share_at_home():
    strategy = FedHKD(threshold=0.3)
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=FROZEN)
    client = server.clients[0]
    y = server.data.y[server.data.clients[client.id].train]
    counts = torch.bincount(y, minlength=C)
    kept = [k for k in range(C) if counts[k] > 0 and counts[k] >= 0.3 * len(y)]
    sent = client_update(strategy, server, strategy.configure_round(1, [client])[0]).uplink["hyper_knowledge"]
    assert sent.labels.tolist() == kept and len(kept) < int((counts > 0).sum())


def test_the_distillation_terms_enter_the_local_loss_once_hyper_knowledge_exists():
    losses = {}
    for gamma in (0.0, 10.0):
        strategy = FedHKD(lam=0.0, gamma=gamma, share_weights=False)
        server = method_env(strategy, MLP, [Tier("all", ["m"])], training=FROZEN)
        strategy.state.representations = torch.full((C, D), 100.0)  # far from every representation
        strategy.state.available = torch.ones(C, dtype=torch.bool)
        task = strategy.configure_round(2, [server.clients[0]])[0]
        losses[gamma] = client_update(strategy, server, task).metrics["m/loss"]
    assert losses[10.0] > losses[0.0] + 10 * 100  # ||h - 100|| >= 200 - ||h||: far above 100 per row


def test_evaluation_reports_personalized_and_global_models():
    strategy = FedHKD()
    method_env(strategy, MLP, [Tier("all", ["m"])])

    class Evaluator:
        def personalized(self, weights_of, split):
            assert split == "test"
            return {"personal/test_acc": 0.5}

        def global_model(self, role, weights):
            assert weights is strategy.state.global_weights[role]
            return {"acc": 0.25}

    assert FedHKD.monitor.fget(strategy) == "personal/test_acc"
    assert strategy.evaluate(Evaluator()) == {"personal/test_acc": 0.5, "m/test_acc": 0.25}


def test_needs_one_representation_size_and_valid_options():
    models = {"a": ModelSpec("digits_mlp", {"hidden": 4}), "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="same feature size"):
        method_env(FedHKD(), models, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="FedHKD temperature must be > 0, got 0.0."):
        FedHKD(temperature=0.0)
    with pytest.raises(ConfigError, match="FedHKD threshold must be"):
        FedHKD(threshold=1.5)


def test_ledger_counts_models_and_hyper_knowledge_each_way_per_round(tmp_path):
    out = tmp_path / "fedhkd"
    argv = ["--config", str(ROOT / "recipes" / "digits_fedhkd.yaml"), "--output_dir", str(out), "--rounds", "2"]
    argv += ["--eval_every", "1", "--runtime.progress", "false", "--training.local_steps", "1"]
    assert run_cli("fit", *argv) == 0
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    sent = [(int(r["comm/round_downlink_bytes"]), int(r["comm/round_uplink_bytes"])) for r in rows]
    specs = {
        "cnn_small": ModelSpec("digits_cnn", {"channels": 16, "hidden": 64}),
        "cnn_large": ModelSpec("digits_cnn", {"channels": 48, "hidden": 64}),
        "mlp": ModelSpec("digits_mlp", {"hidden": 64, "depth": 2}),
    }
    states = [spec.build(num_classes=C, in_channels=1).state_dict() for spec in specs.values()]
    # 4 clients per architecture, each its role's model each way
    models = 4 * sum(v.numel() * v.element_size() for state in states for v in state.values())
    counts = torch.tensor([c["class_counts"] for c in json.loads((out / "partition.json").read_text())["clients"]])
    held = int((counts > 0).sum())  # classes held, over the 12 clients
    known = int((counts > 0).any(0).sum())  # classes with global hyper-knowledge after round 1
    up = models + held * (64 + C + 1 + 1) * 4  # per class held: H, Q and the count, floats, and the int32 label
    assert sent == [(models, up), (models + 12 * known * (64 + C + 1) * 4, up)]
