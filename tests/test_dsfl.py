"""DS-FL: entropy reduction aggregation, the open batch, the distillation step and the sizes sent."""

import math

import pytest
import torch
from conftest import ROOT, aggregate_phase, client_update, method_env, phase_tasks, read_summary, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.data import DigitsData
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientTask, ClientUpdate, TensorPayload
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import DSFL
from fl_lightning.strategies.dsfl import entropy_reduction

CONSTANT = {"m": ModelSpec("conftest.constant_logits_model")}  # logits = head bias = (0, 1, ..., 9)


@pytest.fixture(autouse=True)
def _trust_conftest_builders(monkeypatch):
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "conftest")


def _env(strategy, training=None):
    data = DigitsData(server_fraction=0.2)
    return method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=training, data=data)


def test_era_sharpens_at_t_01_and_flattens_at_t_1():
    mean = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]])
    # T = 0.1: softmax of (5, 3, 2) and (2, 2, 6)
    row0 = [math.exp(5), math.exp(3), math.exp(2)]
    row1 = [math.exp(2), math.exp(2), math.exp(6)]
    expected = torch.tensor([[v / sum(row0) for v in row0], [v / sum(row1) for v in row1]])
    sharp = entropy_reduction(mean, 0.1)
    assert torch.allclose(sharp, expected, atol=1e-6)
    assert abs(sharp[0, 0].item() - 0.84379) < 1e-5 and abs(sharp[1, 2].item() - 0.96466) < 1e-5
    # T = 1 on probabilities (one reading of paper 001's Table 13): softmax of the probabilities, flatter
    flat = entropy_reduction(mean, 1.0)
    assert abs(flat[0, 0].item() - math.exp(0.5) / (math.exp(0.5) + math.exp(0.3) + math.exp(0.2))) < 1e-6
    assert flat[0, 0] < 0.5 and sharp[0, 0] > 0.5


def _probs_upload(client, first: float, n: int) -> ClientUpdate:
    """A client's softmax outputs: ``first`` on class 0 and the rest spread evenly, for all n examples."""
    probs = torch.full((n, 10), (1 - first) / 9)
    probs[:, 0] = first
    return ClientUpdate(client, 1, {"open_outputs": TensorPayload("open_outputs", {"outputs": probs})})


@pytest.mark.parametrize("aggregation", ["era", "sa"])
def test_server_averages_over_clients_then_applies_era(aggregation):
    strategy = DSFL(open_size=4, aggregation=aggregation, era_temperature=0.1)
    server = _env(strategy)
    c = server.clients
    aggregate_phase(strategy, 1, [_probs_upload(c[0], 1.0, 4), _probs_upload(c[2], 0.1, 4)], "train")
    # average: 0.55 on class 0, 0.05 elsewhere; ERA: softmax of (5.5, 0.5, ..., 0.5)
    if aggregation == "era":
        first = math.exp(5.5) / (math.exp(5.5) + 9 * math.exp(0.5))
        assert abs(first - 0.942825) < 1e-6
        expected = torch.tensor([first] + [(1 - first) / 9] * 9)
    else:
        expected = torch.tensor([0.55] + [0.05] * 9)
    assert torch.allclose(strategy.global_probs, expected.expand(4, 10), atol=1e-6)
    tasks = phase_tasks(strategy, 1, c, "distill")  # only the two uploaders distill
    assert [t.client.id for t in tasks] == [c[0].id, c[2].id] and tasks[0].phase == "distill"


def test_bytes_each_way_open_positions_predictions_and_soft_labels():
    strategy = DSFL(open_size=5)
    server = _env(strategy, training=LocalTraining(local_steps=1))
    client = server.clients[0]
    task = phase_tasks(strategy, 3, [client], "train")[0]
    positions = task.downlink["open_positions"].tensors["positions"]
    assert task.downlink["open_positions"].nbytes == 5 * 4  # n int32 positions
    assert positions.tolist() == sorted(set(positions.tolist())) and int(positions.max()) < strategy.exchange.num_public
    assert torch.equal(
        positions, phase_tasks(strategy, 3, [client], "train")[0].downlink["open_positions"].tensors["positions"]
    )
    state = {}
    update = client_update(strategy, server, task, state)
    assert update.uplink["open_outputs"].nbytes == 5 * 10 * 4  # n x C float32
    assert torch.allclose(update.uplink["open_outputs"].tensors["outputs"].sum(1), torch.ones(5))
    assert torch.equal(state["open_positions"], positions)  # remembered for the distill phase
    aggregate_phase(strategy, 3, [update], "train")
    distill = phase_tasks(strategy, 3, [client], "distill")[0]
    assert distill.downlink["global_soft_labels"].nbytes == 5 * 10 * 4
    assert client_update(strategy, server, distill, state).uplink == {} and "open_positions" not in state


def test_the_whole_open_set_sends_no_positions():
    strategy = DSFL(open_size=None)
    server = _env(strategy)
    assert phase_tasks(strategy, 1, [server.clients[0]], "train")[0].downlink == {}


def test_one_distillation_step_is_soft_cross_entropy_towards_the_global_labels():
    sgd = LocalTraining(optimizer=lambda params: torch.optim.SGD(params, lr=1.0), local_steps=1)
    strategy = DSFL(open_size=3, distill_steps=1, distill_batch_size=3)
    server = _env(strategy, training=sgd)
    client = server.clients[0]
    state = {
        "weights": server.initial_weights("m", client.id),
        "open_positions": torch.tensor([0, 4, 7], dtype=torch.int32),
    }
    targets = torch.full((3, 10), 0.1)
    task = ClientTask(
        client, 1, {"global_soft_labels": TensorPayload("global_soft_labels", {"probs": targets})}, "distill"
    )
    client_update(strategy, server, task, state)
    # the constant model's logits are its bias b = (0, ..., 9) on every example: the gradient of the
    # batch-mean soft cross-entropy with respect to b is softmax(b) - 0.1, and SGD at lr 1 subtracts it
    bias = torch.arange(10.0)
    expected = bias - (torch.softmax(bias, 0) - 0.1)
    assert torch.allclose(state["weights"]["head.bias"], expected, atol=1e-6)


def test_bad_settings_are_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="DS-FL needs unlabeled server data; set data.init_args.server_fraction"):
        method_env(DSFL(), CONSTANT, [Tier("all", ["m"])])
    with pytest.raises(ConfigError, match="open_size 100000 must be between 1 and the open set's"):
        _env(DSFL(open_size=100_000))
    with pytest.raises(ConfigError, match="sa averages probabilities; with upload: logits use aggregation: era"):
        DSFL(aggregation="sa", upload="logits")


def test_early_aijack_uploads_logits_and_takes_the_softmax_of_their_mean():
    strategy = DSFL(open_size=2, upload="logits", era_temperature=1.0)
    server = _env(strategy, training=LocalTraining(local_steps=1))
    task = phase_tasks(strategy, 1, [server.clients[0]], "train")[0]
    sent = client_update(strategy, server, task).uplink["open_outputs"].tensors["outputs"]
    # the constant model: the logits are its bias (0, ..., 9), SGD on a CE step changes only the bias,
    # so they are the same for both examples; what is sent is the logits, not their softmax
    assert sent.shape == (2, 10) and torch.equal(sent[0], sent[1]) and not torch.allclose(sent.sum(1), torch.ones(2))
    c = server.clients
    logits = [torch.zeros(2, 10), torch.zeros(2, 10)]
    logits[0][:, 0], logits[1][:, 0] = 3.0, 1.0  # mean (2, 0, ..., 0): softmax e^2 / (e^2 + 9)
    uploads = [
        ClientUpdate(c[i], 1, {"open_outputs": TensorPayload("open_outputs", {"outputs": z})})
        for i, z in enumerate(logits)
    ]
    aggregate_phase(strategy, 1, uploads, "train")
    first = math.exp(2) / (math.exp(2) + 9)
    assert torch.allclose(strategy.global_probs[:, 0], torch.full((2,), first), atol=1e-6)


def test_dsfl_without_distillation_is_exactly_standalone(tmp_path):
    """distill_steps = 0 leaves private training alone: every personal model must match Standalone's."""
    recipe = ["--config", str(ROOT / "recipes" / "digits_dsfl.yaml"), "--rounds", "3", "--eval_every", "3"]
    recipe += ["--runtime.progress", "false"]
    assert run_cli("fit", *recipe, "--strategy.init_args.distill_steps", "0", "--output_dir", str(tmp_path / "ds")) == 0
    standalone = ["--strategy", "fl_lightning.strategies.Standalone", "--output_dir", str(tmp_path / "sa")]
    assert run_cli("fit", *recipe, *standalone) == 0
    dsfl, alone = read_summary(tmp_path / "ds"), read_summary(tmp_path / "sa")
    assert dsfl["per_client_acc"] == alone["per_client_acc"] and dsfl["final"] == alone["final"]
    assert alone["comm"]["uplink_bytes"] == 0  # the second run really is Standalone
    # 3 rounds x 10 clients x the open set's 287 examples x C float32, up and down
    assert dsfl["comm"]["uplink_bytes"] == dsfl["comm"]["downlink_bytes"] == 3 * 10 * 287 * 10 * 4
