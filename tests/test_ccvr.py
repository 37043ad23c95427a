"""CCVR: class moments, their pooling and the virtual features by hand, the server's calibration step, the phases."""

import pytest
import torch
from conftest import ROOT, client_update, method_env, phase_tasks, read_summary, run_cli

from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, TensorPayload
from fl_lightning.knowledge.virtual_features import class_moments, pooled_moments, virtual_features
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import CCVR

SMALL = {"small": ModelSpec("digits_cnn", {"width": 0.25})}  # 16 features, a Linear(16, 10) classifier


def test_class_moments_are_counts_means_and_unbiased_covariances():
    features = torch.tensor([[0.0, 1.0], [2.0, 3.0], [4.0, 4.0], [7.0, 7.0]])
    counts, means, covs = class_moments(features, torch.tensor([0, 0, 1, 2]), num_classes=4)
    assert counts.tolist() == [2, 1, 1, 0]
    assert means.tolist() == [[1.0, 2.0], [4.0, 4.0], [7.0, 7.0], [0.0, 0.0]]
    # class 0: deviations (-1, -1) and (1, 1), summed outer products [[2, 2], [2, 2]] / (2 - 1); one feature: 0
    assert covs[0].tolist() == [[2.0, 2.0], [2.0, 2.0]]
    assert covs[1:].abs().sum() == 0


def test_pooled_moments_are_those_of_the_union_of_the_clients_features():
    # class 0 on client A: {0, 2} (mean 1, variance 2), on client B: {4} (mean 4, variance 0); the union {0, 2, 4}
    # has mean 2 and variance (4 + 0 + 4) / 2 = 4: 1/2 x 2 + (2 x 1 + 1 x 16) / 2 - 3/2 x 4 = 1 + 9 - 6
    counts = torch.tensor([[2.0], [1.0]], dtype=torch.float64)
    means = torch.tensor([[[1.0]], [[4.0]]], dtype=torch.float64)
    covs = torch.tensor([[[[2.0]]], [[[0.0]]]], dtype=torch.float64)
    n, mu, sigma = pooled_moments(counts, means, covs)
    assert n.tolist() == [3.0] and mu.tolist() == [[2.0]] and sigma.tolist() == [[[4.0]]]
    # in 3 dimensions over 3 clients and 2 classes, against the moments of all features at once
    generator = torch.Generator().manual_seed(0)
    parts = [(torch.randn(n, 3, generator=generator), torch.tensor(labels)) for n, labels in ((4, [0, 1, 1, 0]),
             (3, [1, 1, 1]), (2, [0, 1]))]  # fmt: skip
    stacked = [torch.stack(m) for m in zip(*(class_moments(f, y, 2) for f, y in parts))]
    pooled = pooled_moments(*stacked)
    union = class_moments(torch.cat([f for f, _ in parts]), torch.cat([y for _, y in parts]), 2)
    for mine, theirs in zip(pooled, union):
        assert torch.allclose(mine, theirs, atol=1e-12)


def test_virtual_features_follow_each_class_gaussian_and_skip_classes_seen_once():
    counts = torch.tensor([5.0, 1.0, 3.0])
    means = torch.tensor([[1.0, -1.0], [9.0, 9.0], [0.0, 2.0]])
    covs = torch.stack([torch.zeros(2, 2), torch.eye(2), torch.diag(torch.tensor([4.0, 0.25]))])
    x, y = virtual_features(counts, means, covs, 4000, torch.Generator().manual_seed(0))
    assert y.tolist() == [0] * 4000 + [2] * 4000  # class 1 (one feature: no covariance) gives none
    assert torch.equal(x[:4000], means[0].expand(4000, 2))  # a zero covariance: the mean itself
    drawn = x[4000:]
    assert torch.allclose(drawn.mean(0), means[2], atol=0.1)
    assert torch.allclose(torch.cov(drawn.T), covs[2], atol=0.15)


def test_several_architectures_and_bad_options_are_refused():
    two = {"a": SMALL["small"], "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="CCVR is defined for one architecture"):
        method_env(CCVR(), two, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="CCVR virtual_per_class must be >= 1, got 0."):
        CCVR(virtual_per_class=0)
    with pytest.raises(ConfigError, match="CCVR calibration_lr must be > 0, got 0.0."):
        CCVR(calibration_lr=0.0)


def test_statistics_go_to_every_client_in_calibration_rounds_only():
    strategy = CCVR(calibrate_every=2)
    server = method_env(strategy, SMALL, [Tier("all", ["small"])], rounds=5)
    sampled = server.clients[:1]
    assert [phase_tasks(strategy, r, sampled, "statistics") != [] for r in range(1, 6)] == [
        False, True, False, True, True,  # every 2nd round and the last
    ]  # fmt: skip
    tasks = phase_tasks(strategy, 5, sampled, "statistics")
    assert [t.client.id for t in tasks] == [c.id for c in server.clients]


def test_a_client_uploads_the_moments_of_its_classes_features():
    strategy = CCVR()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    task = phase_tasks(strategy, 1, server.clients, "statistics")[0]
    update = client_update(strategy, server, task)
    sent = update.sent("class_moments", TensorPayload).tensors
    model = server.model("small").eval()
    idx = server.data.clients[task.client.id].train
    with torch.no_grad():
        counts, means, covs = class_moments(model.features(server.data.x[idx]), server.data.y[idx], 10)
    held = torch.nonzero(counts).flatten()
    assert torch.equal(sent["labels"], held) and torch.equal(sent["counts"], counts[held].float())
    assert torch.allclose(sent["means"], means[held].float(), atol=1e-5)
    assert torch.allclose(sent["covariances"], covs[held].float(), atol=1e-5)
    s = len(held)  # per class held: its label (int64), count, 16 means and 16 x 16 covariances (float32)
    assert update.uplink["class_moments"].nbytes == s * 8 + s * (1 + 16 + 256) * 4


def _moments(server, client, means: dict[int, torch.Tensor]) -> ClientUpdate:
    """An upload of 2 features per class at ``means`` with a zero covariance."""
    labels = torch.tensor(sorted(means))
    tensors = {
        "labels": labels,
        "counts": torch.full((len(labels),), 2.0),
        "means": torch.stack([means[c] for c in sorted(means)]),
        "covariances": torch.zeros(len(labels), 16, 16),
    }
    return ClientUpdate(client, 2 * len(labels), {"class_moments": TensorPayload("ccvr", tensors)})


def test_one_calibration_step_moves_the_classifier_alone_by_the_hand_computed_gradient():
    strategy = CCVR(virtual_per_class=1, calibration_lr=1.0, calibration_batch_size=2)
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    weights = strategy.state.global_weights["small"]
    weights["head.weight"], weights["head.bias"] = torch.zeros(10, 16), torch.zeros(10)
    m0, m1 = torch.zeros(16), torch.zeros(16)
    m0[0], m1[1] = 2.0, 4.0
    c = server.clients
    # client 0 holds class 0 at 2 e_0, client 1 class 1 at 4 e_1: pooled means the same, covariances 0, so the
    # two virtual features are the means; one SGD step at lr 1 on the batch of both from a zero head
    metrics = strategy.calibrate(1, iter([_moments(server, c[0], {0: m0}), _moments(server, c[1], {1: m1})]))
    assert metrics["calibration/virtual_features"] == 2.0
    head_weight = strategy.state.calibrated["small"]["head.weight"]
    head_bias = strategy.state.calibrated["small"]["head.bias"]
    # softmax 0.1 everywhere: bias gradient 0.1 - 1/2 on classes 0 and 1, 0.1 elsewhere; minus that
    assert torch.allclose(head_bias, torch.tensor([0.4, 0.4] + [-0.1] * 8), atol=1e-6)
    # weight gradient (1/2) sum_i (p_i - y_i) f_i^T: row 0 = (-0.9 x 2 e_0 + 0.1 x 4 e_1) / 2, row 1 =
    # (0.1 x 2 e_0 - 0.9 x 4 e_1) / 2, other rows (0.1 x 2 e_0 + 0.1 x 4 e_1) / 2
    expected = torch.zeros(10, 16)
    expected[:, 0], expected[:, 1] = -0.1, -0.2
    expected[0, 0], expected[1, 1] = 0.9, 1.8
    assert torch.allclose(head_weight, expected, atol=1e-6)
    for name, value in weights.items():  # the features untouched, the global model itself not calibrated
        if not name.startswith("head."):
            assert torch.equal(strategy.state.calibrated["small"][name], value), name
    assert torch.equal(weights["head.bias"], torch.zeros(10))


def test_a_calibrated_run_reports_both_models_and_the_ledger_counts_the_statistics(tmp_path):
    recipe = ["--config", str(ROOT / "recipes" / "digits_ccvr.yaml"), "--rounds", "2", "--eval_every", "1"]
    assert run_cli("fit", *recipe, "--runtime.progress", "false", "--output_dir", str(tmp_path / "run")) == 0
    summary = read_summary(tmp_path / "run")
    final = summary["final"]
    assert "small/test_acc" in final and "uncalibrated/small/test_acc" in final
    # up: 2 rounds x 10 clients x the model (2,570 float32), then every client's 2 classes: 2 labels (int64),
    # 2 counts, 2 x 16 means, 2 x 256 covariances; down: the model to 20 more clients in the last round
    comm = summary["comm"]
    assert comm["by_payload"]["uplink"] == {"small": 2 * 10 * 2570 * 4, "class_moments": 20 * (16 + 2 * 273 * 4)}
    assert comm["by_payload"]["downlink"] == {"small": (2 * 10 + 20) * 2570 * 4}
