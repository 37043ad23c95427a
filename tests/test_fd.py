"""FD (federated distillation): the loss by hand, the teacher leaves out the client's own upload, and what is
sent: each client's own labels' logits, as paper 004 counts them."""

import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, read_summary, run_cli

from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, TensorPayload
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FD
from fl_lightning.strategies.fd import fd_loss

CONSTANT_MODELS = {"m": ModelSpec("conftest.constant_logits_model")}


def test_loss_is_ce_plus_lam_t_squared_kl_from_teacher_to_student_by_hand():
    # 2 examples x 3 classes at T = 2, lam = 0.5; example 0 (label 0) against a uniform teacher, example 1
    # (label 2) against the teacher row of label 2, softmax((0, 1, 0) / 2)
    z = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 4.0]])
    y = torch.tensor([0, 2])
    targets = torch.tensor([[0.0, 0.0, 0.0], [9.0, 9.0, 9.0], [0.0, 2.0, 0.0]])  # row 1: no example has label 1
    both = torch.tensor([True, False, True])
    # CE: log(e^3 + 2) - 3 = 0.094923 and log(2 + e^4) - 4 = 0.035976, mean 0.065450
    ce = (math.log(math.exp(3) + 2) - 3 + math.log(2 + math.exp(4)) - 4) / 2
    # example 0: KL(uniform || softmax(1.5, 0, 0)) = log(e^1.5 + 2) - log 3 - 1.5 / 3 = 0.270369
    kl0 = math.log(math.exp(1.5) + 2) - math.log(3) - 0.5
    # example 1: p = (1, e, 1) / (e + 2), q = (1, 1, e^2) / (e^2 + 2):
    # KL(p || q) = log(e^2 + 2) - log(e + 2) + (e - 2) / (e + 2) = 0.840334
    kl1 = math.log(math.exp(2) + 2) - math.log(math.e + 2) + (math.e - 2) / (math.e + 2)
    assert kl0 == pytest.approx(0.270369, abs=1e-6) and kl1 == pytest.approx(0.840334, abs=1e-6)
    # the KL averaged over the examples that have a teacher, times T^2 = 4 and lam = 0.5: 1.176152
    assert fd_loss(z, y, targets, both, 0.5, 2.0).item() == pytest.approx(ce + 0.5 * 4 * (kl0 + kl1) / 2, abs=1e-5)
    # KL(student || teacher) would give 1.111605, a lost T^2 0.343125: both fail the line above
    # only label 0 has a teacher: example 1 adds nothing and the mean is over example 0 alone (0.606188)
    only0 = torch.tensor([True, False, False])
    assert fd_loss(z, y, targets, only0, 0.5, 2.0).item() == pytest.approx(ce + 0.5 * 4 * kl0, abs=1e-5)
    nothing = torch.zeros(3, dtype=torch.bool)
    assert fd_loss(z, y, targets, nothing, 0.5, 2.0).item() == pytest.approx(ce, abs=1e-6)  # plain CE


def _upload(client, rows: dict[int, float]) -> ClientUpdate:
    """A client's compact upload: label c's logits all equal ``rows[c]``."""
    labels = sorted(rows)
    logits = torch.stack([torch.full((10,), rows[c]) for c in labels])
    stats = ClassStatistics("class_logits", {"logits": logits}, torch.tensor(labels, dtype=torch.int32))
    return ClientUpdate(client, 1, {"class_logits": stats})


def _downlink(strategy, client):
    return strategy.configure_round(2, [client])[0].downlink["teacher_logits"]


def test_teacher_is_the_other_clients_average_of_the_clients_own_labels():
    strategy = FD(exclude_own=True)
    server = method_env(strategy, CONSTANT_MODELS, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_upload(c[0], {0: 1.0, 1: 2.0}), _upload(c[1], {0: 3.0}), _upload(c[2], {0: 8.0})]))
    # client 1 uploaded label 0 only, which others have: the rows alone, in its upload's order, (1 + 8) / 2
    sent = _downlink(strategy, c[1])
    assert isinstance(sent, TensorPayload) and torch.equal(sent.tensors["logits"], torch.full((1, 10), 4.5))
    # client 0: label 1 was only its own, so it has no teacher; label 0's (3 + 8) / 2, sent with its label
    sent = _downlink(strategy, c[0])
    assert isinstance(sent, ClassStatistics) and sent.labels.tolist() == [0]
    assert torch.equal(sent.vectors["logits"], torch.full((1, 10), 5.5))
    # client 3 did not upload: every label that has a teacher, the mean of all three, with the labels
    sent = _downlink(strategy, c[3])
    assert isinstance(sent, ClassStatistics) and sent.labels.tolist() == [0, 1]
    assert torch.equal(sent.vectors["logits"], torch.tensor([[4.0] * 10, [2.0] * 10]))
    task = strategy.configure_round(2, [c[3]])[0]
    targets, available = strategy.received_teacher(task, _context(server, task, {}))  # read by the labels sent
    assert available.tolist() == [True, True] + [False] * 8
    assert torch.equal(targets[:2], torch.tensor([[4.0] * 10, [2.0] * 10])) and not targets[2:].any()


def test_plain_mean_when_own_upload_is_kept():
    strategy = FD(exclude_own=False)
    server = method_env(strategy, CONSTANT_MODELS, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_upload(c[0], {0: 1.0}), _upload(c[1], {0: 3.0})]))
    assert torch.equal(_downlink(strategy, c[0]).tensors["logits"], torch.full((1, 10), 2.0))


def test_a_client_sends_its_labels_logits_and_reads_the_rows_it_gets_back_by_them():
    strategy = FD()
    server = method_env(strategy, CONSTANT_MODELS, [Tier("all", ["m"])])
    a, b = server.clients[0], server.clients[1]
    task = strategy.configure_round(1, [a, b])
    assert [t.downlink["teacher_logits"].nbytes for t in task] == [0, 0]  # no teacher before any upload
    states = {a.id: {}, b.id: {}}
    updates = [client_update(strategy, server, t, states[t.client.id]) for t in task]
    for update in updates:
        held = torch.bincount(server.data.y[server.data.clients[update.client.id].train], minlength=10)
        sent = update.uplink["class_logits"]
        assert sent.labels.tolist() == [c for c in range(10) if held[c] > 0]  # its own labels, no padding
        assert sent.nbytes == len(sent.labels) * (10 + 1) * 4  # S x (C + 1) numbers
    strategy.aggregate(1, iter(updates))
    a_labels = updates[0].uplink["class_logits"].labels.tolist()
    assert a_labels == updates[1].uplink["class_logits"].labels.tolist() == list(range(10))  # digits: every label
    task = strategy.configure_round(2, [a])[0]
    received = task.downlink["teacher_logits"]
    assert isinstance(received, TensorPayload) and received.nbytes == 10 * 10 * 4  # S x C numbers, no labels
    targets, available = strategy.received_teacher(task, _context(server, task, states[a.id]))
    assert bool(available.all())
    assert torch.equal(targets, updates[1].uplink["class_logits"].vectors["logits"])  # b's logits, a's own left out
    states[a.id]["sent_labels"] = torch.arange(9)  # a client that kept other labels is told so, not misled
    with pytest.raises(
        RuntimeError, match="received 10 teacher rows for the labels of its last upload, but it holds 9"
    ):
        strategy.received_teacher(task, _context(server, task, states[a.id]))


def _context(server, task, state):
    from fl_lightning.client import ClientContext

    return ClientContext(task.client, task.round, server._loop, server.data, state, 0)


def test_paper_004_cifar10_traffic_is_2_labels_logits_each_way_and_the_labels_up():
    """Paper 004's 0.16 KB per client and round (2 labels x 10 logits each way, 160 bytes): each client sends its
    2 labels' logits and the labels (88 bytes) and gets the 2 teacher rows back (80 bytes): 0.164 KiB."""
    strategy = FD()
    server = method_env(strategy, CONSTANT_MODELS, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_upload(c[0], {3: 1.0, 7: 2.0}), _upload(c[1], {3: 3.0, 7: 5.0})]))
    down = _downlink(strategy, c[0])
    up = _upload(c[0], {3: 1.0, 7: 2.0}).uplink["class_logits"]
    assert (up.nbytes, down.nbytes) == (2 * 11 * 4, 2 * 10 * 4)
    assert round((up.nbytes + down.nbytes) / 1024, 2) == 0.16


def test_fd_without_distillation_is_exactly_standalone(tmp_path):
    """lam = 0 leaves cross-entropy alone: every personal model must match the Standalone baseline's."""
    recipe = ["--config", str(ROOT / "recipes" / "digits_fd.yaml"), "--rounds", "4", "--eval_every", "4"]
    recipe += ["--runtime.progress", "false"]
    assert run_cli("fit", *recipe, "--strategy.init_args.lam", "0", "--output_dir", str(tmp_path / "fd")) == 0
    standalone = ["--strategy", "fl_lightning.strategies.Standalone", "--output_dir", str(tmp_path / "sa")]
    assert run_cli("fit", *recipe, *standalone) == 0
    fd, sa = read_summary(tmp_path / "fd"), read_summary(tmp_path / "sa")
    assert fd["per_client_acc"] == sa["per_client_acc"] and fd["final"] == sa["final"]
    assert fd["comm"]["uplink_bytes"] > 0 and sa["comm"]["uplink_bytes"] == 0
