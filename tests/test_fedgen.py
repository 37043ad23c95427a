"""FedGen: the generator's losses, the server step, the trained generator reaching clients, sizes sent."""

import io
import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, metrics_rows, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights, TensorPayload
from fl_lightning.knowledge.feature_generator import (
    diversity_loss,
    ensemble_teacher_loss,
    heads_logits,
    label_distribution,
    label_shares,
    label_weighted_teacher_loss,
    regularised_loss,
    with_generated_features,
)
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedGen

D, C = 4, 10  # the tiny MLP's representation size; digits' classes
MLP = {"m": ModelSpec("digits_mlp", {"hidden": D})}
FROZEN = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=0.0), local_steps=2)
SMALL = {"noise_dim": 3, "hidden_dim": 5, "generator_steps": 2, "generator_batch_size": 4}


def _generator_bytes(noise: int, hidden: int) -> int:
    """Linear(noise + C, hidden), BatchNorm1d(hidden) (weight, bias, running mean and variance: float32; its
    int64 batch count), Linear(hidden, D)."""
    floats = (noise + C) * hidden + hidden + 4 * hidden + hidden * D + D
    return floats * 4 + 8


HEAD_BYTES = (D * C + C) * 4


def test_diversity_loss_by_hand():
    noise = torch.tensor([[0.0], [1.0]])
    features = torch.tensor([[0.0, 0.0], [2.0, 4.0]])
    # noise distances (mean squared) [[0, 1], [1, 0]]; feature distances (mean absolute) [[0, 3], [3, 0]]
    assert diversity_loss(noise, features).item() == pytest.approx(math.exp(-(3 + 3) / 4))


def test_label_weighted_teacher_loss_weighs_each_head_by_its_share_of_the_label():
    # head 0 gives class 0 probability 3/4 on sample 0; every other row is uniform over two classes
    logits = torch.tensor([[[math.log(3.0), 0.0], [0.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    labels = torch.tensor([0, 1])
    shares = torch.tensor([[1.0, 0.25], [0.0, 0.75]], dtype=torch.float64)  # [K, C]
    # head 0: mean(1 x ln(4/3), 0.25 x ln 2); head 1: mean(0 x ln 2, 0.75 x ln 2)
    expected = (math.log(4 / 3) + 0.25 * math.log(2)) / 2 + 0.75 * math.log(2) / 2
    assert label_weighted_teacher_loss(logits, labels, shares).item() == pytest.approx(expected)


def test_ensemble_teacher_loss_is_the_cross_entropy_of_the_weighted_logits():
    logits = torch.tensor([[[4.0, 0.0]], [[0.0, 0.0]]])
    # 0.25 x [4, 0] + 0.75 x [0, 0] = [1, 0]
    loss = ensemble_teacher_loss(logits, torch.tensor([0]), torch.tensor([0.25, 0.75]))
    assert loss.item() == pytest.approx(math.log(1 + math.exp(-1.0)))


def test_every_uploaded_head_on_the_generated_features_at_once():
    heads = {"weight": torch.stack([torch.eye(2), 2 * torch.eye(2)]), "bias": torch.tensor([[0.0, 0.0], [1.0, 1.0]])}
    logits = heads_logits(torch.nn.Linear(2, 2), heads, torch.tensor([[1.0, 2.0]]))
    assert logits.tolist() == [[[1.0, 2.0]], [[3.0, 5.0]]]  # [K, B, C]: I x + 0 and 2 I x + 1


def test_label_distribution_and_shares_from_counts():
    counts = torch.tensor([[1, 0, 2], [3, 0, 2]])
    assert label_distribution(counts.sum(0), "uniform").tolist() == [0.5, 0.0, 0.5]
    assert label_distribution(counts.sum(0), "counts").tolist() == [0.5, 0.0, 0.5]
    assert label_distribution(torch.tensor([1, 0, 3]), "counts").tolist() == [0.25, 0.0, 0.75]
    assert label_shares(counts.double()).tolist() == [[0.25, 0.0, 0.5], [0.75, 0.0, 0.5]]


def test_client_loss_adds_the_generated_cross_entropy_and_the_kl_term():
    logits = torch.tensor([[math.log(3.0), 0.0]])  # p = [3/4, 1/4] on the real example of class 0
    generated = torch.tensor([[0.0, 0.0]])  # the head on a generated feature of class 1: ln 2
    label_logits = torch.tensor([[0.0, 0.0]])  # uniform target for the KL term
    ce, kl = math.log(4 / 3), 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)
    y, y_hat = torch.tensor([0]), torch.tensor([1])
    assert regularised_loss(logits, y, generated, y_hat, 2.0).item() == pytest.approx(ce + 2 * math.log(2))
    full = regularised_loss(logits, y, generated, y_hat, 2.0, 3.0, label_logits).item()
    assert full == pytest.approx(ce + 2 * math.log(2) + 3 * kl)


def test_generated_batches_carry_one_feature_per_example_of_the_drawn_labels():
    generate = lambda noise, labels: labels[:, None].float().expand(-1, D) + 0 * noise[:, :1]  # noqa: E731
    batches = [(torch.zeros(3, 8), torch.tensor([4, 4, 5])), (torch.zeros(1, 8), torch.tensor([6]))]
    only_two = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    out = list(with_generated_features(batches, generate, only_two, 3, torch.Generator().manual_seed(0), True))
    (x, y, generated, drawn, own), last = out
    assert x.shape == (3, 8) and generated.shape == (3, D) and len(last) == 5 and len(last[2]) == 1
    assert set(drawn.tolist()) <= {2, 9} and torch.equal(generated[:, 0], drawn.float())
    assert torch.equal(own[:, 0], y.float())  # features generated for the batch's own labels


def _upload(client, value: float, num_samples: int, counts: list[int]) -> ClientUpdate:
    head = {"head.weight": torch.full((C, D), value), "head.bias": torch.full((C,), value)}
    label_counts = TensorPayload("label_counts", {"counts": torch.tensor(counts, dtype=torch.int32)})
    return ClientUpdate(client, num_samples, {"head": ModelWeights("head", head), "label_counts": label_counts})


def test_server_averages_heads_trains_the_generator_and_sends_the_trained_one():
    strategy = FedGen(**SMALL)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    c = server.clients
    first = strategy.configure_round(1, [c[0]])[0]
    assert list(first.downlink) == ["head"] and first.downlink["head"].nbytes == HEAD_BYTES  # no generator yet
    initial = {k: v.clone() for k, v in strategy.state.generator.state_dict().items()}
    counts0, counts1 = [2] + [0] * 9, [0, 0, 6] + [0] * 7
    metrics = strategy.aggregate(1, iter([_upload(c[0], 1.0, 1, counts0), _upload(c[1], 5.0, 3, counts1)]))
    assert "server/generator_loss" in metrics and strategy.state.trainings == 1
    # heads weighted by examples: (1 x 1 + 5 x 3) / 4 = 4
    assert torch.allclose(strategy.state.head["head.weight"], torch.full((C, D), 4.0))
    assert strategy.state.label_distribution.tolist() == [0.5, 0.0, 0.5] + [0.0] * 7  # the classes held
    task = strategy.configure_round(2, [c[2]])[0]
    sent = task.downlink["generator"].state
    trained = strategy.state.generator.state_dict()
    assert all(torch.equal(sent[k], trained[k]) for k in trained)  # the trained generator travels ...
    assert not torch.equal(sent["out.weight"], initial["out.weight"])  # ... not the initial one
    assert task.downlink["generator"].nbytes == _generator_bytes(3, 5)
    assert task.downlink["label_distribution"].nbytes == C * 4


def test_the_generator_and_its_adam_moments_are_checkpointed_state():
    strategy = FedGen(**SMALL)
    server = method_env(strategy, MLP, [Tier("all", ["m"])])
    strategy.aggregate(1, iter([_upload(server.clients[0], 1.0, 1, [1] * C)]))
    saved = strategy.state_dict()
    assert saved["trainings"] == 1 and saved["optimizer"]["state"]  # the moments after the first training
    file = io.BytesIO()
    torch.save(saved, file)  # as a checkpoint holds it: plain data, loaded without running code
    file.seek(0)
    restored = FedGen(**SMALL)
    method_env(restored, MLP, [Tier("all", ["m"])])
    restored.load_state_dict(torch.load(file, weights_only=True))
    uploads = [_upload(server.clients[1], 2.0, 2, [3] * C)]
    torch.manual_seed(1)
    strategy.aggregate(2, iter(uploads))
    torch.manual_seed(1)
    restored.aggregate(2, iter(uploads))
    for name, value in strategy.state.generator.state_dict().items():
        assert torch.equal(restored.state.generator.state_dict()[name], value), name


def test_client_trains_under_the_global_head_and_sends_its_head_and_label_counts():
    strategy = FedGen(**SMALL)
    server = method_env(strategy, MLP, [Tier("all", ["m"])], training=FROZEN)
    client = server.clients[0]
    strategy.aggregate(1, iter([_upload(server.clients[1], 2.0, 1, [1] * C)]))
    state = {}
    update = client_update(strategy, server, strategy.configure_round(2, [client])[0], state)
    counts = torch.bincount(server.data.y[server.data.clients[0].train], minlength=C)
    assert update.uplink["label_counts"].tensors["counts"].tolist() == counts.tolist()
    assert update.uplink["label_counts"].nbytes == C * 4 and update.uplink["head"].nbytes == HEAD_BYTES
    assert torch.equal(update.uplink["head"].state["head.bias"], torch.full((C,), 2.0))  # lr 0: the global head
    own = server.initial_weights("m", client.id)
    assert torch.equal(state["weights"]["features.1.weight"], own["features.1.weight"])


def test_the_generated_term_enters_the_local_loss_from_the_second_round():
    losses = {}
    for alpha in (0.0, 1000.0):
        strategy = FedGen(alpha=alpha, beta=0.0, **SMALL)
        server = method_env(strategy, MLP, [Tier("all", ["m"])], training=FROZEN)
        strategy.aggregate(1, iter([_upload(server.clients[1], 0.0, 1, [1] * C)]))  # a zero head: CE ln 10
        task = strategy.configure_round(2, [server.clients[0]])[0]
        losses[alpha] = client_update(strategy, server, task).metrics["m/loss"]
    # alpha_2 = 1000 x 0.98: the generated features' cross-entropy under a zero head is ln 10
    assert losses[1000.0] - losses[0.0] == pytest.approx(1000 * 0.98 * math.log(C), rel=1e-5)


def test_regulariser_weights_decay_per_round_to_the_official_floor():
    strategy = FedGen(alpha=10.0, beta=0.0, decay=0.5)
    assert strategy.regulariser_weights(1) == (10.0, 0.0)
    assert strategy.regulariser_weights(3) == (2.5, 0.0)
    assert strategy.regulariser_weights(40)[0] == 1e-4


def test_evaluation_uses_the_global_head_or_the_last_trained_model():
    for evaluate_with, expected in (("global", 3.0), ("local", 2.0)):
        strategy = FedGen(evaluate_with=evaluate_with, **SMALL)
        server = method_env(strategy, MLP, [Tier("all", ["m"])])
        trained = {**server.initial_weights("m", 0), "head.bias": torch.full((C,), 2.0)}
        strategy.state.head = {k: torch.full_like(v, 3.0) for k, v in strategy.state.head.items()}
        _, weights = strategy.personal_weights(server.clients[0], {"weights": trained})
        assert torch.equal(weights["head.bias"], torch.full((C,), expected))


def test_heads_must_match_and_options_must_be_in_range():
    models = {"a": ModelSpec("digits_mlp", {"hidden": 4}), "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="same parameters and shapes"):
        method_env(FedGen(), models, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match=r"^FedGen generator_batch_size must be >= 2, got 1\.$"):
        FedGen(generator_batch_size=1)
    with pytest.raises(ConfigError, match=r"^FedGen decay must be in \(0, 1\], got 0\.0\.$"):
        FedGen(decay=0.0)


def _round_bytes(out):
    rows = metrics_rows(out)
    return [(int(r["comm/round_downlink_bytes"]), int(r["comm/round_uplink_bytes"])) for r in rows]


def test_ledger_counts_the_head_the_generator_and_the_label_counts_per_round(tmp_path):
    out = tmp_path / "fedgen"
    argv = ["--config", str(ROOT / "recipes" / "digits_fedgen.yaml"), "--output_dir", str(out), "--rounds", "2"]
    argv += ["--eval_every", "1", "--runtime.progress", "false", "--training.local_steps", "1"]
    argv += ["--strategy.init_args.generator_steps", "1", "--strategy.init_args.noise_dim", "3"]
    argv += ["--strategy.init_args.hidden_dim", "5"]
    assert run_cli("fit", *argv) == 0
    head, generator = (64 * C + C) * 4, (3 + C) * 5 * 4 + 5 * 4 + 4 * 5 * 4 + (5 * 64 + 64) * 4 + 8
    clients = 15  # every client, every round
    up = clients * (head + C * 4)  # the head and the int32 label counts
    # round 1: the head; round 2: the head, the trained generator and the label distribution (C floats)
    assert _round_bytes(out) == [(clients * head, up), (clients * (head + generator + C * 4), up)]
