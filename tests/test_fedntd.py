"""FedNTD: the not-true distillation loss on hand-made logits, the round's frozen global model, the FedAvg server."""

import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, read_summary, run_cli

from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.knowledge.distillation import not_true_distillation_loss, not_true_logits
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedNTD

SMALL = {"small": ModelSpec("digits_cnn", {"width": 0.25})}


def _kl(p: list[float], q: list[float]) -> float:
    return sum(a * math.log(a / b) for a, b in zip(p, q))


def test_not_true_logits_drop_each_row_s_label_column():
    logits = torch.tensor([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0]])
    kept = not_true_logits(logits, torch.tensor([0, 2, 1]))
    assert torch.equal(kept, torch.tensor([[1.0, 2.0], [3.0, 4.0], [6.0, 8.0]]))


def test_not_true_distillation_on_hand_made_logits():
    student = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    teacher = torch.tensor([[9.0, 0.0, 1.0], [1.0, 2.0, 0.0]])
    labels = torch.tensor([0, 2])
    # row 0 keeps classes 1, 2: student (2, 3) and teacher (0, 1) differ by a constant, the same softmax, KL 0
    # (with the true class the teacher's 9 would dominate); row 1 keeps classes 0, 1: teacher softmax(1, 2) =
    # (0.268941, 0.731059) against the student's (0.5, 0.5), KL 0.110944; the batch mean 0.055472
    p = [1 / (1 + math.e), math.e / (1 + math.e)]
    loss = not_true_distillation_loss(student, teacher, labels, temperature=1.0)
    assert loss.item() == pytest.approx(_kl(p, [0.5, 0.5]) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.0554720, abs=1e-6)
    # tau 2: the teacher softmax(0.5, 1), times tau^2 = 4: 0.060600
    p2 = [1 / (1 + math.exp(0.5)), math.exp(0.5) / (1 + math.exp(0.5))]
    loss = not_true_distillation_loss(student, teacher, labels, temperature=2.0)
    assert loss.item() == pytest.approx(4 * _kl(p2, [0.5, 0.5]) / 2, abs=1e-6)
    assert loss.item() == pytest.approx(0.0605997, abs=1e-6)


def test_the_true_class_logit_gets_no_gradient_from_the_not_true_term():
    student = torch.tensor([[1.0, 2.0, 3.0], [0.5, -1.0, 0.0]], requires_grad=True)
    teacher = torch.tensor([[0.0, 3.0, 1.0], [1.0, 2.0, 0.0]])
    not_true_distillation_loss(student, teacher, torch.tensor([0, 2]), temperature=1.0).backward()
    grad = student.grad
    assert grad[0, 0] == 0 and grad[1, 2] == 0
    assert grad[0, 1:].abs().sum() > 0 and grad[1, :2].abs().sum() > 0


def test_several_architectures_and_bad_options_are_refused():
    two = {"a": SMALL["small"], "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="FedNTD is defined for one architecture"):
        method_env(FedNTD(), two, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="FedNTD tau must be > 0, got 0.0."):
        FedNTD(tau=0.0)
    with pytest.raises(ConfigError, match="FedNTD beta must be >= 0, got -1.0."):
        FedNTD(beta=-1.0)


def test_the_server_averages_the_uploads_weighted_by_examples():
    strategy = FedNTD()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    c = server.clients
    uploads = []
    for client, value, n in ((c[0], 1.0, 1), (c[1], 3.0, 3)):
        state = {k: torch.full_like(v, value) for k, v in server.initial_weights("small").items()}
        uploads.append(ClientUpdate(client, n, {"small": ModelWeights("small", state)}))
    strategy.aggregate(1, iter(uploads))
    # (1 x 1 + 3 x 3) / 4 = 2.5 in every tensor
    weights = strategy.state.global_weights["small"]
    assert all(torch.allclose(w, torch.full_like(w, 2.5)) for w in weights.values())


def test_the_teacher_is_the_round_s_global_model_frozen_once_per_round():
    strategy = FedNTD()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    task = strategy.configure_round(1, [server.clients[0]])[0]
    first = client_update(strategy, server, task)
    ((done, teacher),) = strategy._global.values()
    assert done == 1 and not teacher.training and not any(p.requires_grad for p in teacher.parameters())
    received = task.downlink["small"].state
    assert all(torch.equal(teacher.state_dict()[k], v) for k, v in received.items())  # not the trained one
    assert not torch.equal(first.uplink["small"].state["head.weight"], received["head.weight"])
    client_update(strategy, server, strategy.configure_round(1, [server.clients[1]])[0])
    assert strategy._global["small"] == (1, teacher)  # the same object for the round's other clients
    strategy.aggregate(1, iter([first]))
    client_update(strategy, server, strategy.configure_round(2, [server.clients[1]])[0])
    again, same = strategy._global["small"]
    assert again == 2 and same is teacher  # refilled in place with the new global model
    assert torch.equal(teacher.state_dict()["head.weight"], first.uplink["small"].state["head.weight"])


def test_the_not_true_term_changes_the_local_model():
    uploads = {}
    for beta in (0.0, 5.0):
        strategy = FedNTD(beta=beta)
        server = method_env(strategy, SMALL, [Tier("all", ["small"])])
        server_weights = strategy.state.global_weights["small"]
        server_weights["head.weight"] = server_weights["head.weight"] + 0.5  # a teacher other than the start
        uploads[beta] = client_update(strategy, server, strategy.configure_round(1, [server.clients[0]])[0])
    assert not torch.equal(
        uploads[0.0].uplink["small"].state["head.weight"], uploads[5.0].uplink["small"].state["head.weight"]
    )


def test_the_whole_model_goes_each_way():
    strategy = FedNTD()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    task = strategy.configure_round(1, [server.clients[0]])[0]
    # conv 1*4*9+4 = 40, conv 4*8*9+8 = 296, dense 128*16+16 = 2064, classifier 16*10+10 = 170: 2570 float32
    assert task.downlink["small"].nbytes == 2570 * 4
    assert client_update(strategy, server, task).uplink["small"].nbytes == 2570 * 4


def test_fedntd_without_its_term_is_exactly_fedavg(tmp_path):
    recipe = ["--config", str(ROOT / "recipes" / "digits_fedntd.yaml"), "--rounds", "2", "--eval_every", "2"]
    recipe += ["--runtime.progress", "false"]
    assert run_cli("fit", *recipe, "--strategy.init_args.beta", "0", "--output_dir", str(tmp_path / "ntd")) == 0
    fedavg = ["--strategy", "fl_lightning.strategies.FedAvg", "--output_dir", str(tmp_path / "fedavg")]
    assert run_cli("fit", *recipe, *fedavg) == 0
    ntd, plain = read_summary(tmp_path / "ntd"), read_summary(tmp_path / "fedavg")
    assert ntd["final"] == plain["final"]
    assert ntd["comm"]["uplink_bytes"] == ntd["comm"]["downlink_bytes"] == 2 * 10 * 2570 * 4  # the ledger
