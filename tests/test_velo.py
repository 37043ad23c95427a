"""Velo: the logit targets it sends before its CVAE is trained, the features it sends once it is, the client's
logit term averaged over the whole batch, the bytes sent each way, and a run that resumes exactly."""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import check_resume, client_update, method_env, metrics_rows, read_summary
from test_felo import KL_FROM_UNIFORM, _client_with_some_class_zero, _server_knows_class_zero, cross_entropy_of

from fl_lightning.client import LocalTraining
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import Velo
from fl_lightning.strategies.felo import received_targets

CONSTANT = {"m": ModelSpec("conftest.constant_logits_model")}  # logits = head bias = (0, 1, ..., 9)
# one step on all of a client's data, weights unchanged: the reported loss is the loss of that batch
ONE_FROZEN_BATCH = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), local_steps=1, batch_size=10_000)


def _knowledge_update(strategy, client, classes, logits, features):
    labels = torch.tensor([c if c in classes else -1 for c in range(10)], dtype=torch.int32)
    knowledge = ClassStatistics("class_knowledge", {"features": features, "logits": logits}, labels)
    weights = ModelWeights("m", strategy.state.global_weights["m"])
    return ClientUpdate(client, 10, {"class_knowledge": knowledge, "weights": weights})


def test_velo_sends_averaged_logits_before_its_cvae_is_trained():
    strategy = Velo(cvae_interval=2, cvae_epochs=1)
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=ONE_FROZEN_BATCH)
    update = _knowledge_update(strategy, server.clients[1], {0, 1}, torch.zeros(10, 10), torch.ones(10, 4))
    strategy.aggregate(1, iter([update]))  # round 1: no CVAE training (interval 2)
    task = strategy.configure_round(2, [server.clients[0]])[0]
    knowledge = task.downlink["class_knowledge"]
    assert knowledge.labels[:3].tolist() == [0, 1, -1] and "features" not in knowledge.vectors
    assert "class_features" not in task.downlink
    assert knowledge.nbytes == 10 * (10 + 1) * 4  # only the logits and labels are sent, and counted
    (_, have_f), (_, have_z) = received_targets(task.downlink)
    assert not have_f.any() and have_z.tolist() == [True, True] + [False] * 8

    # the client trains on them: constant logits z = [0..9], server logits 0 -> KL(uniform || softmax(z))
    y = server.data.y[server.data.clients[0].train]
    assert (y < 2).any()  # client 0 holds class 0 or 1
    z = torch.arange(10.0)
    ce = (torch.logsumexp(z, 0) - z[y]).mean().item()
    p = F.softmax(z, 0)
    kl = sum(0.1 * math.log(0.1 / p[j].item()) for j in range(10))  # the same for every covered sample
    covered = (y < 2).float().mean().item()  # eq. 1 averages the term over the whole batch
    loss = client_update(strategy, server, task).metrics["m/loss"]
    assert loss == pytest.approx(ce + 0.5 * covered * kl, rel=1e-5)  # alpha 0.5; no feature term without features


def test_velo_sends_features_with_their_own_classes_once_the_cvae_exists():
    strategy = Velo(cvae_interval=1, cvae_epochs=1, cvae_batch_size=2)
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])])
    update = _knowledge_update(strategy, server.clients[1], {0, 1}, torch.zeros(10, 10), torch.ones(10, 4))
    strategy.aggregate(1, iter([update]))
    knowledge = strategy.configure_round(2, [server.clients[0]])[0].downlink
    assert list(knowledge) == ["class_knowledge", "weights"]  # same classes: one payload, as Felo
    assert knowledge["class_knowledge"].nbytes == 10 * (4 + 10 + 1) * 4
    strategy.state.stored_labels = torch.tensor([0])  # class 1 has left the feature store, its logits remain
    downlink = strategy.configure_round(2, [server.clients[0]])[0].downlink
    assert downlink["class_knowledge"].labels[:3].tolist() == [0, 1, -1]
    assert downlink["class_features"].labels[:3].tolist() == [0, -1, -1]
    assert downlink["class_knowledge"].nbytes + downlink["class_features"].nbytes == 10 * (10 + 1 + 4 + 1) * 4


def test_velo_averages_its_logit_term_over_the_batch_before_features_exist():
    strategy = Velo(cvae_interval=2, cvae_epochs=1)  # no CVAE after round 1: logits only
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=ONE_FROZEN_BATCH)
    _server_knows_class_zero(strategy, server)
    client, y = _client_with_some_class_zero(server)
    share = (y == 0).float().mean().item()
    loss = client_update(strategy, server, strategy.configure_round(2, [client])[0]).metrics["m/loss"]
    assert loss == pytest.approx(cross_entropy_of(y) + 0.5 * share * KL_FROM_UNIFORM, rel=1e-5)


def test_velo_sends_logits_then_features_and_resumes_exactly(tmp_path):
    """A two-round run stopped after round 1 and resumed equals the uninterrupted one (the CVAE is server
    state). Round 1 sends the 6 clients only C logits and labels (no CVAE yet); round 2 the features too."""
    argv = ("--rounds", "2", "--eval_every", "1", "--training.local_steps", "2")
    full = check_resume(tmp_path, "digits_velo", *argv)
    comm = read_summary(full)["comm"]["by_payload"]
    assert comm["uplink"]["class_knowledge"] == 2 * 6 * 10 * (64 + 10 + 1) * 4
    assert comm["downlink"]["class_knowledge"] == 6 * 10 * (10 + 1) * 4 + 6 * 10 * (64 + 10 + 1) * 4
    rows = metrics_rows(full)
    round_one = int(rows[0]["comm/round_uplink_bytes"]) - int(rows[0]["comm/round_downlink_bytes"])
    assert round_one == 6 * 10 * 64 * 4  # the features not sent down before the CVAE exists
