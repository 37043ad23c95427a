"""FedL2G: the guided loss and the meta step's gradient by hand, the server's step on the guiding vectors, the quiz
set held out of training, warm-up rounds, the bytes sent."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import ROOT, client_update, method_env, metrics_rows, run_cli
from torch import nn

from fl_lightning.client import ClientContext, LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.knowledge.guidance import ClassGradientMean, clipped_sgd_step, guide_gradients, guide_loss
from fl_lightning.models import FeatureClassifier, ModelSpec
from fl_lightning.strategies import FedL2G

D = 4  # the representation size of the tiny MLPs below
MLP = {"m": ModelSpec("digits_mlp", {"hidden": D})}
ONE = [Tier("all", ["m"])]
TRAINING = LocalTraining(local_steps=2, batch_size=8)


def test_guide_loss_is_the_mean_squared_distance_to_the_class_vectors():
    outputs = torch.tensor([[1.0, 2.0], [0.0, 0.0]])
    vectors = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    # ((1 + 4) + (1 + 1)) / (B x D = 4)
    assert guide_loss(outputs, torch.tensor([0, 1]), vectors).item() == pytest.approx(7 / 4)


def _linear_logits() -> FeatureClassifier:
    """``logits = W x`` with ``x`` one number and ``W`` ``[2, 1]`` zero: nothing else to differentiate."""
    head = nn.Linear(1, 2, bias=False)
    nn.init.zeros_(head.weight)
    return FeatureClassifier(nn.Flatten(), head, 1, 2)


def test_the_meta_gradient_of_the_logit_guide_by_hand():
    """Study (x = 1, y = 0), quiz (x = 1, y = 1), W = 0, g = 0, lr 0.5, weight 1, C = 2.

    The study gradient of W is ``(p - e_0) + (2 / C) (W x - g_0) = [-0.5, 0.5]``: the step gives ``W' = [0.25,
    -0.25]``. ``W'`` depends on ``g_0`` through ``+ lr (2 / C) g_0 x``, so ``d CE_quiz / d g_0 = lr (2 / C) x x_q
    (softmax(W' x_q) - e_1) = 0.5 [s, -s]`` with ``s = sigmoid(0.5)``; class 1 is not studied: its row is 0.
    """
    model = _linear_logits()
    study, quiz = [(torch.ones(1, 1), torch.tensor([0]))], [(torch.ones(1, 1), torch.tensor([1]))]
    gradient = guide_gradients(model, study, quiz, torch.zeros(2, 2), lr=0.5, weight=1.0, target="logit")
    s = 1 / (1 + math.exp(-0.5))
    assert gradient.flatten().tolist() == pytest.approx([0.5 * s, -0.5 * s, 0.0, 0.0])
    assert torch.equal(model.head.weight, torch.zeros(2, 1))  # the model itself did not step


def _quiz_loss_after_a_plain_step(model, study, quiz, vectors, lr, weight):
    """The quiz loss of a copy of ``model`` after one SGD step of the guided feature loss: no functional call."""
    stepped = copy.deepcopy(model)
    loss = 0.0
    for x, y in study:
        features = stepped.features(x)
        loss = loss + F.cross_entropy(stepped.head(features), y) + weight * F.mse_loss(features, vectors[y])
    grads = torch.autograd.grad(loss / len(study), list(stepped.parameters()))
    with torch.no_grad():
        for p, g in zip(stepped.parameters(), grads):
            p.sub_(lr * g)
        return sum(F.cross_entropy(stepped(x), y) for x, y in quiz).item() / len(quiz)


def test_the_meta_gradient_of_the_feature_guide_matches_finite_differences():
    """Through an MLP with batch norm, in float64: the gradient equals central differences of the quiz loss after a
    plain (non-differentiable) step, and the model's weights and batch-norm statistics stay as they were."""
    torch.manual_seed(0)
    features = nn.Sequential(nn.Flatten(), nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU())
    model = FeatureClassifier(features, nn.Linear(4, 3), 4, 3).double().train()
    before = copy.deepcopy(model.state_dict())
    study = [(torch.randn(6, 3, dtype=torch.float64), torch.tensor([0, 1, 0, 1, 0, 0]))] * 2
    quiz = [(torch.randn(5, 3, dtype=torch.float64), torch.tensor([0, 1, 2, 1, 0]))]
    vectors = torch.randn(3, 4, dtype=torch.float64)
    gradient = guide_gradients(model, study, quiz, vectors, lr=0.3, weight=2.0, target="feature")
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    numeric = torch.zeros_like(vectors)
    for c in range(3):
        for d in range(4):
            up, down = vectors.clone(), vectors.clone()
            up[c, d] += 1e-6
            down[c, d] -= 1e-6
            after = [_quiz_loss_after_a_plain_step(model, study, quiz, v, 0.3, 2.0) for v in (up, down)]
            numeric[c, d] = (after[0] - after[1]) / 2e-6
    assert torch.allclose(gradient, numeric, atol=1e-7)
    assert gradient[2].abs().sum() == 0 and gradient[:2].abs().sum() > 0  # class 2 is quizzed, never studied


def test_the_server_averages_each_class_over_its_senders_clips_and_steps():
    mean = ClassGradientMean(num_classes=3, dim=2)
    mean.add(torch.tensor([0, 2], dtype=torch.int32), torch.tensor([[3.0, 0.0], [0.0, 4.0]]))
    mean.add(torch.tensor([0], dtype=torch.int32), torch.tensor([[1.0, 0.0]]))
    assert mean.mean().tolist() == [[2.0, 0.0], [0.0, 0.0], [0.0, 4.0]]  # class 1: nobody sent it
    vectors = torch.ones(3, 2)
    # norm sqrt(2^2 + 4^2) = sqrt(20) > 1: scaled by 1 / (sqrt(20) + 1e-6), then SGD at 0.5
    stepped = clipped_sgd_step(vectors, mean.mean(), lr=0.5, max_norm=1.0)
    scale = 0.5 / (math.sqrt(20) + 1e-6)
    assert stepped.flatten().tolist() == pytest.approx([1 - 2 * scale, 1.0, 1.0, 1.0, 1.0, 1 - 4 * scale])
    unclipped = clipped_sgd_step(vectors, mean.mean(), lr=0.5, max_norm=100.0)
    assert unclipped.flatten().tolist() == pytest.approx([0.0, 1.0, 1.0, 1.0, 1.0, -1.0])


def test_aggregate_applies_the_mean_class_gradients_to_the_guiding_vectors():
    strategy = FedL2G(server_lr=0.5, server_clip=100.0)
    server = method_env(strategy, MLP, ONE)
    before = strategy.state.vectors.clone()
    c = server.clients

    def upload(client, labels, value):
        rows = torch.full((len(labels), D), value)
        stats = ClassStatistics("guide_gradients", {"gradients": rows}, torch.tensor(labels, dtype=torch.int32))
        return ClientUpdate(client, 1, {"guide_gradients": stats})

    metrics = strategy.aggregate(1, iter([upload(c[0], [3], 1.0), upload(c[1], [3, 5], 3.0)]))
    assert metrics == {"server/classes_guided": 2.0}
    expected = before.clone()
    expected[3] -= 0.5 * 2.0  # (1 + 3) / 2
    expected[5] -= 0.5 * 3.0
    assert torch.allclose(strategy.state.vectors, expected)


def test_the_guiding_vectors_start_seeded_standard_normal_of_the_right_shape():
    feature, logit = FedL2G(), FedL2G(target="logit")
    method_env(feature, MLP, ONE, seed=3)
    method_env(logit, MLP, ONE, seed=3)
    assert feature.state.vectors.shape == (10, D) and logit.state.vectors.shape == (10, 10)
    again = FedL2G()
    method_env(again, MLP, ONE, seed=3)
    assert torch.equal(again.state.vectors, feature.state.vectors)
    assert abs(feature.state.vectors.mean()) < 0.5 and 0.5 < feature.state.vectors.std() < 1.5


def _recorded_batches(monkeypatch):
    """Every ``ClientContext.batches`` call's indices, steps and labels drawn, in order."""
    calls, batches = [], ClientContext.batches

    def recording(self, *args, **kwargs):
        drawn = list(batches(self, *args, **kwargs))
        calls.append((kwargs.get("indices"), kwargs.get("steps"), [y for _, y in drawn]))
        return iter(drawn)

    monkeypatch.setattr(ClientContext, "batches", recording)
    return calls


@pytest.mark.parametrize("target", ["feature", "logit"])
def test_a_client_trains_without_its_quiz_set_then_sends_the_studied_classes_gradients(monkeypatch, target):
    strategy = FedL2G(target=target, quiz_batches=2)
    server = method_env(strategy, MLP, ONE, training=TRAINING)
    client = server.clients[0]
    calls = _recorded_batches(monkeypatch)
    state = {}
    update = client_update(strategy, server, strategy.configure_round(1, [client])[0], state)
    train = server.data.clients[client.id].train
    quiz, study = train[:16], train[16:]  # 2 quiz batches of 8
    (trained, steps, _), (studied, one, study_labels), (quizzed, two, _) = calls
    assert torch.equal(trained, study) and steps == 2  # training.local_steps
    assert torch.equal(studied, study) and one == 1 and torch.equal(quizzed, quiz) and two == 2
    sent = update.uplink["guide_gradients"]
    dim = D if target == "feature" else 10
    studied_classes = torch.unique(study_labels[0])
    assert sent.labels.tolist() == studied_classes.tolist()
    assert sent.vectors["gradients"].shape == (len(studied_classes), dim)
    assert sent.nbytes == len(studied_classes) * (dim + 1) * 4 and update.num_samples == len(study)
    assert "weights" in state and list(update.metrics) == ["m/loss"]


def test_in_warm_up_rounds_a_client_takes_only_the_meta_step():
    strategy = FedL2G(warm_up_rounds=1)
    server = method_env(strategy, MLP, ONE, training=TRAINING, rounds=2)
    client = server.clients[0]
    state = {}
    update = client_update(strategy, server, strategy.configure_round(1, [client])[0], state)
    assert state == {} and update.metrics == {} and len(update.uplink["guide_gradients"].labels) > 0
    client_update(strategy, server, strategy.configure_round(2, [client])[0], state)
    assert "weights" in state


def test_the_set_up_is_checked():
    with pytest.raises(ConfigError, match="warm_up_rounds .2. cover all 2 rounds"):
        method_env(FedL2G(warm_up_rounds=2), MLP, ONE, rounds=2)
    mixed = {"a": ModelSpec("digits_mlp", {"hidden": 4}), "b": ModelSpec("digits_mlp", {"hidden": 8})}
    two = [Tier("a", ["a"], count=2), Tier("b", ["b"])]
    with pytest.raises(ConfigError, match=r"same feature size; got \{'a': 4, 'b': 8\}"):
        method_env(FedL2G(), mixed, two)
    method_env(FedL2G(target="logit"), mixed, two)  # logits are C wide whatever the model
    with pytest.raises(ConfigError, match="quiz_batches x batch_size = 4000 training examples"):
        method_env(FedL2G(quiz_batches=1000), MLP, ONE, training=LocalTraining(batch_size=4))
    with pytest.raises(ConfigError, match="FedL2G guide_weight must be >= 0, got -1.0."):
        FedL2G(guide_weight=-1.0)
    with pytest.raises(ConfigError, match="FedL2G study_batches must be >= 1, got 0."):
        FedL2G(study_batches=0)


def test_the_ledger_counts_the_vectors_down_and_one_gradient_per_studied_class_up(tmp_path):
    """One class per client: each sends one gradient row with its label, (C + 1) numbers of the logit variant, and
    receives the C x C guiding vectors."""
    out = tmp_path / "run"
    one_class = "{class_path: fl_lightning.data.PathologicalPartitioner, init_args: {classes_per_client: 1}}"
    tiny = ["--data.init_args.partitioner", one_class, "--strategy.init_args.target", "logit"]
    tiny += ["--training.local_steps", "1", "--rounds", "3", "--eval_every", "1", "--runtime.progress", "false"]
    code = run_cli("fit", "--config", str(ROOT / "recipes/digits_fedl2g.yaml"), *tiny, "--output_dir", str(out))
    assert code == 0
    rows = metrics_rows(out)
    assert [int(r["comm/round_downlink_bytes"]) for r in rows] == [15 * 10 * 10 * 4] * 3
    assert [int(r["comm/round_uplink_bytes"]) for r in rows] == [15 * (10 + 1) * 4] * 3
