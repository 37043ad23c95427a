"""FedHe: the class-logit sums a client uploads, the server's per-class average and its reset period, the
client's logit loss, the bytes sent each way, and an asynchronous run that resumes exactly."""

import copy

import pytest
import torch
from conftest import check_resume, client_update, fit_recipe, method_env, metrics_rows, read_summary

from fl_lightning.client import LocalTraining
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedHe

CONSTANT = {"m": ModelSpec("conftest.constant_logits_model")}  # logits = head bias = (0, 1, ..., 9)
FROZEN = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), local_epochs=1, batch_size=16)
# one step on all of a client's data, weights unchanged: the reported loss is the loss of that batch
ONE_FROZEN_BATCH = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), local_steps=1, batch_size=10_000)


def _logit_update(client, value):
    """An upload with a logit vector for class 0 only, every entry ``value``."""
    logits = torch.zeros(10, 10)
    logits[0] = value
    labels = torch.tensor([0] + [-1] * 9, dtype=torch.int32)
    return ClientUpdate(client, 1, {"class_logits": ClassStatistics("class_logits", {"logits": logits}, labels)})


def test_fedhe_client_uploads_class_logit_sums_over_count_plus_one():
    strategy = FedHe(plus_one=True)
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=FROZEN)
    task = strategy.configure_round(1, [server.clients[0]])[0]
    update = client_update(strategy, server, task)
    sent = update.uplink["class_logits"]
    counts = torch.bincount(server.data.y[server.data.clients[0].train], minlength=10).float()
    bias = torch.arange(10.0)  # every example's logits are the head bias (lr 0 keeps it)
    expected = counts[:, None] * bias[None, :] / (counts + 1)[:, None]  # eq. 7-8
    assert torch.allclose(sent.vectors["logits"], expected)
    assert sent.labels.tolist() == [c if n > 0 else -1 for c, n in enumerate(counts.tolist())]
    assert update.uplink["class_logits"].nbytes == 10 * 11 * 4  # C x (C + 1) numbers
    assert task.downlink["class_logits"].nbytes == 10 * 11 * 4  # the server's bank, padded to C rows


def test_fedhe_server_averages_per_class_over_uploads():
    strategy = FedHe()
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])])
    first = torch.zeros(10, 10)
    first[0] = 1.0
    second = torch.zeros(10, 10)
    second[0], second[1] = 3.0, 5.0
    labels_a = torch.tensor([0] + [-1] * 9, dtype=torch.int32)
    labels_b = torch.tensor([0, 1] + [-1] * 8, dtype=torch.int32)
    updates = [
        ClientUpdate(
            server.clients[i], 1, {"class_logits": ClassStatistics("class_logits", {"logits": z}, client_labels)}
        )
        for i, (z, client_labels) in enumerate([(first, labels_a), (second, labels_b)])
    ]
    strategy.aggregate(1, iter(updates))
    task = strategy.configure_round(2, [server.clients[2]])[0]
    received = task.downlink["class_logits"]
    assert torch.allclose(received.vectors["logits"][0], torch.full((10,), 2.0))  # (1 + 3) / 2
    assert torch.allclose(received.vectors["logits"][1], torch.full((10,), 5.0))
    assert received.labels[:3].tolist() == [0, 1, -1]


def test_fedhe_asynchronous_reset_collapses_once_per_period_and_resumes():
    strategy = FedHe(reset_every=2)
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])])
    c = server.clients
    strategy.aggregate(1, iter([_logit_update(c[0], 1.0)]))
    for client, value in ((c[1], 3.0), (c[2], 5.0)):  # two arrivals of the reset round, one at a time
        strategy.aggregate(2, iter([_logit_update(client, value)]))
    assert strategy.state.bank.counts[0].item() == 3.0  # not collapsed after each arrival
    assert strategy.state.bank.mean()[0, 0].item() == pytest.approx(3.0)  # (1 + 3 + 5) / 3
    strategy.aggregate(3, iter([_logit_update(c[3], 9.0)]))  # round 2's end: collapse to 3 weighted once
    resumed = FedHe(reset_every=2)
    method_env(resumed, CONSTANT, [Tier("all", ["m"])])
    resumed.load_state_dict(copy.deepcopy(strategy.state_dict()))  # as a checkpoint would
    for s in (strategy, resumed):
        s.aggregate(3, iter([_logit_update(c[0], 11.0)]))  # same period: no second collapse
        assert s.state.bank.counts[0].item() == 3.0
        assert s.state.bank.mean()[0, 0].item() == pytest.approx((3.0 + 9.0 + 11.0) / 3)

    synchronous = FedHe(reset_every=2)  # one aggregation per round: the reset as before
    method_env(synchronous, CONSTANT, [Tier("all", ["m"])])
    synchronous.aggregate(1, iter([_logit_update(c[0], 1.0)]))
    synchronous.aggregate(2, iter([_logit_update(c[1], 3.0), _logit_update(c[2], 5.0)]))
    synchronous.aggregate(3, iter([_logit_update(c[3], 9.0), _logit_update(c[0], 11.0)]))
    assert torch.equal(synchronous.state.bank.sums, strategy.state.bank.sums)


@pytest.mark.parametrize("plus_one", [True, False])
def test_fedhe_uploads_class_logit_sums_over_counts_plus_one(plus_one):
    """Eq. 8: a client uploads p_y / (V_y + 1), the sum of class y's logits over their count plus one (the
    official code's V_y without ``plus_one``); the constant model's logits are 0..9 for every input."""
    strategy = FedHe(plus_one=plus_one)
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=ONE_FROZEN_BATCH)
    client = server.clients[0]
    y = server.data.y[server.data.clients[client.id].train]
    counts = torch.bincount(y, minlength=10).float()
    update = client_update(strategy, server, strategy.configure_round(1, [client])[0])
    upload = update.sent("class_logits", ClassStatistics)
    present = counts > 0
    assert int(present.sum()) >= 2 and int(counts.max()) >= 2  # several classes, and V_y + 1 differs from V_y
    assert upload.labels[present].tolist() == torch.arange(10)[present].tolist()
    expected = counts[present, None] * torch.arange(10.0) / (counts[present, None] + (1 if plus_one else 0))
    assert torch.allclose(upload.vectors["logits"][present], expected)


@pytest.mark.parametrize("average", ["batch", "available"])
def test_fedhe_logit_loss_is_averaged_over_the_whole_batch(average):
    strategy = FedHe(alpha=1.0, logit_average=average)
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=ONE_FROZEN_BATCH)
    strategy.aggregate(1, iter([_logit_update(server.clients[3], 0.0)]))  # a server logit for class 0 only
    labels = [server.data.y[server.data.clients[c.id].train] for c in server.clients]
    client, y = next((c, y) for c, y in zip(server.clients, labels) if 0 < (y == 0).sum() < len(y))
    z = torch.arange(10.0)  # the constant model's logits for every input
    ce = (torch.logsumexp(z, 0) - z[y]).mean().item()
    mse = sum(j * j for j in range(10)) / 10  # MSE(z, 0) of a class-0 sample: 28.5
    share = (y == 0).float().mean().item() if average == "batch" else 1.0  # eq. 13: 1/|D| over all samples
    loss = client_update(strategy, server, strategy.configure_round(2, [client])[0]).metrics["m/loss"]
    assert loss == pytest.approx(ce + mse * share, rel=1e-5)


def test_fedhe_ledger_counts_c_times_c_plus_one_numbers_each_way(tmp_path):
    rows = metrics_rows(fit_recipe(tmp_path / "fedhe", "digits_fedhe", "--rounds", "2", "--eval_every", "1"))
    assert int(rows[0]["comm/round_uplink_bytes"]) == 6 * 10 * 11 * 4  # 6 clients x C(C+1) float32 numbers
    assert int(rows[0]["comm/round_downlink_bytes"]) == 6 * 10 * 11 * 4  # the bank, padded to C rows
    assert int(rows[1]["comm/uplink_bytes"]) == 2 * 6 * 10 * 11 * 4


def test_async_fedhe_records_staleness_and_resumes_exactly(tmp_path):
    full = check_resume(tmp_path, "digits_fedhe_async", "--rounds", "4", "--eval_every", "2")
    rows = metrics_rows(full)
    assert float(rows[-1]["async/staleness_mean"]) > 0 and int(rows[-1]["clients"]) == 12
    assert read_summary(full)["rounds"] == 4
