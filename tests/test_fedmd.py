"""FedMD: transfer learning on the labeled public set, the consensus, the digest step and the sizes sent."""

import pytest
import torch
from conftest import ROOT, aggregate_phase, client_update, method_env, phase_tasks, read_summary, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.data import DigitsData
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientTask, ClientUpdate, TensorPayload
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedMD

CONSTANT = {"m": ModelSpec("conftest.constant_logits_model")}  # logits = head bias = (0, 1, ..., 9)


@pytest.fixture(autouse=True)
def _trust_conftest_builders(monkeypatch):
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "conftest")


def _env(strategy, training=None, data=None):
    data = data or DigitsData(server_fraction=0.2)
    return method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=training, data=data)


def _sgd(batch_size=32):
    return LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=1.0), local_steps=1, batch_size=batch_size)


def _logits_upload(client, value: float, n: int) -> ClientUpdate:
    return ClientUpdate(
        client, 1, {"public_logits": TensorPayload("public_logits", {"logits": torch.full((n, 10), value)})}
    )


def test_consensus_is_the_plain_mean_of_the_clients_logits():
    strategy = FedMD(public_size=4)
    server = _env(strategy)
    c = server.clients
    aggregate_phase(strategy, 2, [_logits_upload(c[1], 2.0, 4), _logits_upload(c[3], 5.0, 4)], "communicate")
    assert torch.allclose(strategy.consensus, torch.full((4, 10), 3.5))  # (2 + 5) / 2, unweighted
    tasks = phase_tasks(strategy, 2, c, "digest")  # only the two uploaders digest
    assert [t.client.id for t in tasks] == [c[1].id, c[3].id] and tasks[0].phase == "digest"
    assert tasks[0].downlink["consensus"].nbytes == 4 * 10 * 4


def test_transfer_learning_runs_once_on_every_client_and_learns_the_public_labels():
    strategy = FedMD(public_size=None, public_epochs=1, private_epochs=0)
    server = _env(strategy, training=_sgd(batch_size=512))  # one full batch over the public set
    tasks = phase_tasks(strategy, 1, server.clients[:1], "transfer")
    assert [t.client.id for t in tasks] == [c.id for c in server.clients] and tasks[0].downlink == {}
    assert phase_tasks(strategy, 2, server.clients, "transfer") == []
    state = {}
    assert client_update(strategy, server, tasks[0], state).uplink == {}
    # one SGD step (lr 1) of the batch-mean cross-entropy on the whole public set moves the constant
    # model's bias b = (0, ..., 9) by minus softmax(b) - (the public set's class frequencies)
    public_labels = server.data.y[server.data.server_idx]
    frequencies = torch.bincount(public_labels, minlength=10).float() / len(public_labels)
    bias = torch.arange(10.0)
    assert torch.allclose(state["weights"]["head.bias"], bias - (torch.softmax(bias, 0) - frequencies), atol=1e-6)


@pytest.mark.parametrize("loss", ["l1", "kl"])
def test_one_digest_step_by_hand(loss):
    strategy = FedMD(public_size=3, digest_loss=loss, digest_steps=1, digest_batch_size=3, revisit_steps=0)
    server = _env(strategy, training=_sgd())
    client = server.clients[0]
    bias = torch.arange(10.0)
    consensus = (bias + torch.tensor([1.0, -1.0] * 5)).expand(3, 10)  # above b on even classes, below on odd
    state = {"weights": server.initial_weights("m", client.id), "public_positions": torch.tensor([1, 2, 3])}
    task = ClientTask(client, 1, {"consensus": TensorPayload("consensus", {"logits": consensus})}, "digest")
    assert client_update(strategy, server, task, state).uplink == {}
    if loss == "l1":
        # mean |b - c| over 3 x 10 entries: the gradient on b_c is sign(b_c - c_c) / 10, SGD at lr 1 subtracts it
        expected = bias + torch.tensor([0.1, -0.1] * 5)
    else:  # KL(softmax(c) || softmax(b)), batch mean: the gradient on b is softmax(b) - softmax(c)
        expected = bias - (torch.softmax(bias, 0) - torch.softmax(consensus[0], 0))
    assert torch.allclose(state["weights"]["head.bias"], expected, atol=1e-6)
    assert "public_positions" not in state  # forgotten after the digest


def test_bytes_each_way_positions_logits_and_consensus():
    strategy = FedMD(public_size=5, public_epochs=0, private_epochs=0)
    server = _env(strategy, training=_sgd())
    client = server.clients[2]
    task = phase_tasks(strategy, 4, [client], "communicate")[0]
    assert task.downlink["public_positions"].nbytes == 5 * 4  # n int32 positions
    state = {}
    update = client_update(strategy, server, task, state)
    sent = update.uplink["public_logits"]
    assert sent.nbytes == 5 * 10 * 4  # n x C float32
    assert torch.allclose(sent.tensors["logits"], torch.arange(10.0).expand(5, 10))  # the constant model's scores
    aggregate_phase(strategy, 4, [update], "communicate")
    assert phase_tasks(strategy, 4, [client], "digest")[0].downlink["consensus"].nbytes == 5 * 10 * 4


def test_bad_settings_are_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="FedMD needs labeled public data on the server; set data.init_args.server"):
        _env(FedMD(), data=DigitsData())
    with pytest.raises(ConfigError, match="server set has no class labels"):
        _env(FedMD(public_size=None), data=DigitsData(server_dataset=DigitsData()))
    with pytest.raises(ConfigError, match="public_size 5000 must be between 1 and the public set's 287 examples"):
        _env(FedMD())


def test_fedmd_without_transfer_or_digest_is_exactly_standalone(tmp_path):
    """No transfer learning and no digest leave the revisit: every personal model must match Standalone's."""
    recipe = ["--config", str(ROOT / "recipes" / "digits_fedmd.yaml"), "--rounds", "3", "--eval_every", "3"]
    recipe += ["--runtime.progress", "false"]
    off = ["--strategy.init_args.public_epochs", "0", "--strategy.init_args.private_epochs", "0"]
    off += ["--strategy.init_args.digest_steps", "0"]
    assert run_cli("fit", *recipe, *off, "--output_dir", str(tmp_path / "md")) == 0
    standalone = ["--strategy", "fl_lightning.strategies.Standalone", "--output_dir", str(tmp_path / "sa")]
    assert run_cli("fit", *recipe, *standalone) == 0
    fedmd, alone = read_summary(tmp_path / "md"), read_summary(tmp_path / "sa")
    assert fedmd["per_client_acc"] == alone["per_client_acc"] and fedmd["final"] == alone["final"]
    assert alone["comm"]["uplink_bytes"] == 0  # the second run really is Standalone
    # 3 rounds x 10 clients x the public set's 287 examples x C float32, up and down
    assert fedmd["comm"]["uplink_bytes"] == fedmd["comm"]["downlink_bytes"] == 3 * 10 * 287 * 10 * 4
