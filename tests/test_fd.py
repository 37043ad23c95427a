"""FD (federated distillation): the teacher leaves out the client's own upload; sizes of what is sent."""

import torch
from conftest import ROOT, client_update, method_env, read_summary, run_cli

from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FD

CONSTANT_MODELS = {"m": ModelSpec("conftest.constant_logits_model")}


def _upload(client, rows: dict[int, float]) -> ClientUpdate:
    """A client's per-label means: label c's logits all equal ``rows[c]``; other labels absent."""
    logits = torch.zeros(10, 10)
    present = torch.zeros(10, dtype=torch.bool)
    for label, value in rows.items():
        logits[label], present[label] = value, True
    return ClientUpdate(
        client, 1, {"class_logits": ClassStatistics.padded("class_logits", {"logits": logits}, present)}
    )


def _teacher(strategy, client):
    received = strategy.configure_round(2, [client])[0].downlink["teacher_logits"]
    return received.vectors["logits"], received.labels.tolist()


def test_teacher_is_the_other_clients_average_per_label():
    strategy = FD(exclude_own=True)
    server = method_env(strategy, CONSTANT_MODELS, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_upload(c[0], {0: 1.0, 1: 2.0}), _upload(c[1], {0: 3.0}), _upload(c[2], {0: 8.0})]))
    logits, labels = _teacher(strategy, c[0])
    assert torch.allclose(logits[0], torch.full((10,), 5.5))  # (3 + 8) / 2: client 0's own 1.0 left out
    assert labels[:3] == [0, -1, -1]  # label 1 was only client 0's: no teacher for it
    logits, labels = _teacher(strategy, c[3])  # did not upload: the mean of all three
    assert torch.allclose(logits[0], torch.full((10,), 4.0)) and torch.allclose(logits[1], torch.full((10,), 2.0))
    assert labels[:3] == [0, 1, -1]


def test_plain_mean_when_own_upload_is_kept():
    strategy = FD(exclude_own=False)
    server = method_env(strategy, CONSTANT_MODELS, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_upload(c[0], {0: 1.0}), _upload(c[1], {0: 3.0})]))
    logits, labels = _teacher(strategy, c[0])
    assert torch.allclose(logits[0], torch.full((10,), 2.0)) and labels[0] == 0


def test_each_direction_sends_c_times_c_plus_one_numbers():
    strategy = FD()
    server = method_env(strategy, CONSTANT_MODELS, [Tier("all", ["m"])])
    task = strategy.configure_round(1, [server.clients[0]])[0]
    assert task.downlink["teacher_logits"].nbytes == 10 * 11 * 4
    update = client_update(strategy, server, task)
    sent = update.uplink["class_logits"]
    assert sent.nbytes == 10 * 11 * 4
    counts = torch.bincount(server.data.y[server.data.clients[0].train], minlength=10)
    assert sent.labels.tolist() == [c if n > 0 else -1 for c, n in enumerate(counts.tolist())]


def test_fd_without_distillation_is_exactly_standalone(tmp_path):
    """lam = 0 leaves cross-entropy alone: every personal model must match the Standalone baseline's."""
    recipe = ["--config", str(ROOT / "recipes" / "digits_fd.yaml"), "--rounds", "4", "--eval_every", "4"]
    recipe += ["--runtime.progress", "false"]
    assert run_cli("fit", *recipe, "--strategy.init_args.lam", "0", "--output_dir", str(tmp_path / "fd")) == 0
    standalone = ["--strategy", "fl_lightning.strategies.Standalone", "--output_dir", str(tmp_path / "sa")]
    assert run_cli("fit", *recipe, *standalone) == 0
    fd, sa = read_summary(tmp_path / "fd"), read_summary(tmp_path / "sa")
    assert fd["per_client_acc"] == sa["per_client_acc"] and fd["final"] == sa["final"]
    assert fd["comm"]["uplink_bytes"] == 4 * 6 * 10 * 11 * 4  # 4 rounds x 6 clients x C (C + 1) numbers
