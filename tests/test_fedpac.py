"""FedPAC: the feature statistics, the classifier-collaboration quadratic program, the server's extractors,
prototypes and combined heads, the two-stage local training, sizes sent."""

import csv
import json

import pytest
import torch
from conftest import ROOT, client_update, method_env, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights, TensorPayload
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.knowledge.classifier_collaboration import (
    FeatureStatistics,
    collaboration_matrix,
    head_weights,
    project_to_simplex,
    simplex_quadratic,
)
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedPAC
from fl_lightning.strategies.fedpac import aligned_step, head_step

D, C = 4, 10  # the tiny MLP's representation size; digits' classes
MLP = {"m": ModelSpec("digits_mlp", {"hidden": D})}


def test_feature_statistics_by_hand():
    stats = FeatureStatistics(3, 2)
    # class 0: (1, 0) and (3, 0), mean (2, 0), E||f||^2 = 5; class 2: (0, 2), mean (0, 2), E||f||^2 = 4
    stats.add(torch.tensor([[1.0, 0.0], [0.0, 2.0]]), torch.tensor([0, 2]))
    stats.add(torch.tensor([[3.0, 0.0]]), torch.tensor([0]))
    variance, h = stats.result()
    # shares 2/3 and 1/3: V = (2/3 5 - 4/9 4 + 1/3 4 - 1/9 4) / 3
    assert variance == pytest.approx((10 / 3 - 16 / 9 + 4 / 3 - 4 / 9) / 3)
    assert torch.allclose(h, torch.tensor([[4 / 3, 0.0], [0.0, 0.0], [0.0, 2 / 3]]))


def test_collaboration_matrix_is_the_variances_plus_the_bias_gram():
    h = torch.tensor([[[1.0, 0.0]], [[0.0, 0.0]], [[1.0, 2.0]]])  # 3 clients, 1 class, D = 2
    p = collaboration_matrix(0, torch.tensor([0.1, 0.2, 0.3]), h)
    # gaps h_0 - h_j: (0, 0), (1, 0), (0, -2): their inner products, plus V on the diagonal
    expected = torch.tensor([[0.1, 0.0, 0.0], [0.0, 1.2, 0.0], [0.0, 0.0, 4.3]], dtype=torch.float64)
    assert torch.allclose(p, expected)


def test_simplex_projection_and_the_two_client_program_by_hand():
    assert torch.allclose(project_to_simplex(torch.tensor([0.5, 0.5, 0.5])), torch.full((3,), 1 / 3))
    assert torch.allclose(project_to_simplex(torch.tensor([2.0, 0.0])), torch.tensor([1.0, 0.0]))
    # min a^T P a on a1 + a2 = 1: a1 = (P22 - P12) / (P11 + P22 - 2 P12)
    alpha = simplex_quadratic(torch.tensor([[1.0, 0.2], [0.2, 3.0]]))
    assert alpha.tolist() == pytest.approx([2.8 / 3.6, 0.8 / 3.6])
    # a corner: the unconstrained optimum has a negative weight, the simplex's is all on the first client
    assert simplex_quadratic(torch.tensor([[1.0, 2.0], [2.0, 5.0]])).tolist() == pytest.approx([1.0, 0.0], abs=1e-9)
    assert head_weights(torch.tensor([0.6, 0.3995, 0.0005]), 1e-3).tolist() == pytest.approx(
        [0.6 / 0.9995, 0.3995 / 0.9995, 0]
    )


def _update(server, client, value: float, stats: tuple[float, float], classes: dict[int, tuple[float, int]]):
    """Client ``client``'s upload: every weight ``value``, V and every entry of h from ``stats``, class c's
    prototype every entry ``classes[c][0]`` with count ``classes[c][1]``."""
    model = {k: torch.full_like(v, value) for k, v in server.initial_weights("m").items()}
    labels = sorted(classes)
    vectors = {
        "prototypes": torch.tensor([[classes[c][0]] * D for c in labels]),
        "counts": torch.tensor([[float(classes[c][1])] for c in labels]),
    }
    statistics = {"v": torch.tensor([stats[0]]), "h": torch.full((C, D), stats[1])}
    uplink = {
        "model": ModelWeights("m", model),
        "local_prototypes": ClassStatistics("prototypes", vectors, torch.tensor(labels, dtype=torch.int32)),
        "statistics": TensorPayload("feature_statistics", statistics),
    }
    return ClientUpdate(client, 10, uplink)


def test_server_averages_extractors_and_prototypes_and_combines_heads_by_the_program():
    strategy = FedPAC()
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    first = _update(server, c[0], 1.0, (1.0, 0.0), {0: (1.0, 1), 1: (2.0, 2)})
    second = _update(server, c[1], 4.0, (3.0, 0.0), {0: (4.0, 3)})
    second.num_samples = 30
    strategy.aggregate(1, iter([first, second]))
    # extractors by examples: (1 x 10 + 4 x 30) / 40 = 3.25; prototypes by class counts: (1 + 12) / 4 and 2
    assert all(torch.allclose(v.float(), torch.full_like(v.float(), 3.25)) for v in strategy.state.bodies["m"].values())
    assert torch.allclose(strategy.state.prototypes[:2], torch.tensor([[3.25] * D, [2.0] * D]))
    assert strategy.state.available.tolist() == [True, True] + [False] * (C - 2)
    # equal h: P = diag(1, 3) for both clients: alpha = (3/4, 1/4), each head 0.75 x 1 + 0.25 x 4 = 1.75
    for client in (0, 1):
        head = strategy.state.heads[c[client].id]
        assert set(head) == {"weight", "bias"} and torch.allclose(head["weight"], torch.full((C, D), 1.75))
    task = strategy.configure_round(2, [c[0], c[2]])
    assert set(task[0].downlink) == {"global_prototypes", "body", "head"}  # c[2] sent nothing: no head yet
    assert set(task[1].downlink) == {"global_prototypes", "body"}
    assert task[0].downlink["head"].nbytes == (C * D + C) * 4
    assert task[0].downlink["global_prototypes"].nbytes == 2 * (D + 1) * 4
    assert "head.weight" not in task[0].downlink["body"].state
    saved = strategy.state_dict()
    assert set(saved) == {"bodies", "prototypes", "available", "heads"}


def test_without_collaboration_every_head_stays_its_own():
    strategy = FedPAC(collaborate=False)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_update(server, c[0], 1.0, (1.0, 0.0), {0: (1.0, 1)})]))
    assert strategy.state.heads == {} and "head" not in strategy.configure_round(2, [c[0]])[0].downlink


@pytest.mark.parametrize("stage, moved, kept", [("head", "head.", "features."), ("features", "features.", "head.")])
def test_the_head_stage_trains_the_head_only_and_the_feature_stage_the_extractor_only(stage, moved, kept):
    from fl_lightning.client.module import ClientModule

    model = MLP["m"].build(num_classes=C, in_channels=1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    module = ClientModule(model, None)
    step = head_step if stage == "head" else aligned_step(1.0, torch.ones(C, D), torch.ones(C, dtype=torch.bool))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9, weight_decay=0.1)
    x, y = torch.rand(6, 1, 8, 8), torch.arange(6)
    for _ in range(2):  # the loop's order: gradients set to None, the step's loss backward, the optimizer's step
        optimizer.zero_grad(set_to_none=True)
        step(module, (x, y), 0).backward()
        optimizer.step()
    for key, value in model.state_dict().items():
        if key.startswith(kept):  # not even weight decay moves the frozen part: its gradient is None
            assert torch.equal(value, start[key]), key
        elif key.startswith(moved) and value.is_floating_point():
            assert not torch.equal(value, start[key]), key


def test_client_uploads_its_model_prototypes_and_the_statistics_of_the_model_it_received():
    strategy = FedPAC()
    frozen = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.0), local_steps=1)
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=frozen)
    client = server.clients[0]
    update = client_update(strategy, server, strategy.configure_round(1, [client])[0])
    model = server.model("m")
    model.load_state_dict(server.initial_weights("m"))  # lr 0: the trained model is the one received
    model.eval()
    idx = server.data.clients[client.id].train
    x, y = server.data.x[idx], server.data.y[idx]
    with torch.no_grad():
        h = model.features(x)
    classes = sorted(set(y.tolist()))
    sent = update.uplink["local_prototypes"]
    assert sent.labels.tolist() == classes and sent.nbytes == len(classes) * (D + 1 + 1) * 4
    assert torch.allclose(sent.vectors["prototypes"], torch.stack([h[y == k].mean(0) for k in classes]), atol=1e-6)
    statistics = update.uplink["statistics"].tensors
    expected = FeatureStatistics(C, D)
    expected.add(h, y)
    variance, h_ref = expected.result()
    assert statistics["v"].item() == pytest.approx(variance, rel=1e-5)
    assert torch.allclose(statistics["h"], h_ref, atol=1e-6)
    assert update.uplink["statistics"].nbytes == (1 + C * D) * 4


def test_alignment_enters_the_feature_stage_once_prototypes_exist():
    losses = {}
    for lam in (0.0, 10.0):
        strategy = FedPAC(lam=lam, head_epochs=0)
        frozen = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.0), local_steps=1)
        server = method_env(strategy, MLP, [Tier("all", ["m"])], training=frozen)
        strategy.state.prototypes = torch.full((C, D), 100.0)
        strategy.state.available = torch.ones(C, dtype=torch.bool)
        task = strategy.configure_round(2, [server.clients[0]])[0]
        losses[lam] = client_update(strategy, server, task).metrics["m/loss"]
    assert losses[10.0] > losses[0.0] + 10 * 90**2


def test_needs_one_representation_size_and_linear_heads():
    models = {"a": ModelSpec("digits_mlp", {"hidden": 4}), "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="same feature size"):
        method_env(FedPAC(), models, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="FedPAC lam must be >= 0, got -1.0."):
        FedPAC(lam=-1.0)


def test_ledger_counts_models_prototypes_statistics_and_heads(tmp_path):
    out = tmp_path / "fedpac"
    argv = ["--config", str(ROOT / "recipes" / "digits_fedpac.yaml"), "--output_dir", str(out), "--rounds", "2"]
    argv += ["--eval_every", "1", "--runtime.progress", "false", "--training.local_steps", "1"]
    argv += ["--strategy.init_args.head_epochs", "0"]
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
    head = (C * 64 + C) * 4
    counts = torch.tensor([c["class_counts"] for c in json.loads((out / "partition.json").read_text())["clients"]])
    held, known = int((counts > 0).sum()), int((counts > 0).any(0).sum())
    up = models + held * (64 + 1 + 1) * 4 + 12 * (1 + C * 64) * 4  # model, prototypes with counts, V and h
    bodies = models - 12 * head  # every client gets its role's extractor, from round 2 its head and the prototypes
    assert sent == [(bodies, up), (bodies + 12 * head + 12 * known * (64 + 1) * 4, up)]


def test_every_client_starts_from_its_role_s_initial_head_and_the_feature_stage_leaves_it():
    """Round 1: whatever the client before it trained into the role's instance, a client starts from the role's
    initial head; with no head stage its uploaded head is that one (frozen through the feature stage, in the real
    loop)."""
    strategy = FedPAC(head_epochs=1)
    training = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.5, weight_decay=0.1), local_steps=2)
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=training)
    initial = server.initial_weights("m")
    first, second = server.clients[:2]
    trained = client_update(strategy, server, strategy.configure_round(1, [first])[0]).uplink["model"].state
    assert not torch.equal(trained["head.weight"], initial["head.weight"])  # the instance now holds a trained head
    strategy.head_epochs = 0
    model = client_update(strategy, server, strategy.configure_round(1, [second])[0]).uplink["model"].state
    assert torch.equal(model["head.weight"], initial["head.weight"])
    assert not torch.equal(model["features.1.weight"], initial["features.1.weight"])
