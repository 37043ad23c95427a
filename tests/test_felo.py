"""Felo: the client loss (paper 003, eq. 1), whose feature and logit terms are averaged over the whole batch; the
server's weight average within an architecture; the bytes sent each way; and a run that resumes exactly.

``L_k = 1/|D~_k| sum_i (l_ce + alpha (l_mse + l_kl))``: a sample of a class the server has no vector for
adds nothing to a term but counts in the ``1/|D~_k|``. ``loss_average: available`` keeps the former
average over the covered samples only. Checked on the constant-logits model, whose features are 0 and
whose logits are ``[0, 1, ..., 9]`` for every input, so each term is known in closed form.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import check_resume, client_update, method_env, read_summary

from fl_lightning.client import LocalTraining
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import Felo

CONSTANT = {"m": ModelSpec("conftest.constant_logits_model")}  # logits = head bias = (0, 1, ..., 9)
# one step on all of a client's data, weights unchanged: the reported loss is the loss of that batch
ONE_FROZEN_BATCH = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), local_steps=1, batch_size=10_000)

Z = torch.arange(10.0)  # the constant model's logits
P = F.softmax(Z, 0)
KL_FROM_UNIFORM = sum(0.1 * math.log(0.1 / P[j].item()) for j in range(10))  # KL(softmax(0) || softmax(z))


def cross_entropy_of(y):
    """Mean cross-entropy of the constant logits on labels ``y``."""
    return (torch.logsumexp(Z, 0) - Z[y]).mean().item()


def _server_knows_class_zero(strategy, server):
    """One upload of class 0 only: logits 0 (uniform softmax), features 1 (4-dimensional)."""
    labels = torch.tensor([0] + [-1] * 9, dtype=torch.int32)
    vectors = {"features": torch.ones(10, 4), "logits": torch.zeros(10, 10)}
    weights = ModelWeights("m", strategy.state.global_weights["m"])
    knowledge = ClassStatistics("class_knowledge", vectors, labels)
    update = ClientUpdate(server.clients[3], 10, {"class_knowledge": knowledge, "weights": weights})
    strategy.aggregate(1, iter([update]))


def _client_with_some_class_zero(server):
    labels = [server.data.y[server.data.clients[c.id].train] for c in server.clients]
    return next((c, y) for c, y in zip(server.clients, labels) if 0 < (y == 0).sum() < len(y))


@pytest.mark.parametrize("average", ["batch", "available"])
def test_felo_feature_and_logit_terms_are_averaged_over_the_batch(average):
    strategy = Felo(alpha=0.5, logit_loss="kl", loss_average=average)
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=ONE_FROZEN_BATCH)
    _server_knows_class_zero(strategy, server)
    client, y = _client_with_some_class_zero(server)
    # per covered sample: MSE(f = 0, 1) = 1 and KL(uniform || softmax(z)); the others add nothing
    share = (y == 0).float().mean().item() if average == "batch" else 1.0
    loss = client_update(strategy, server, strategy.configure_round(2, [client])[0]).metrics["m/loss"]
    assert loss == pytest.approx(cross_entropy_of(y) + 0.5 * share * (1.0 + KL_FROM_UNIFORM), rel=1e-5)
    assert 0.0 < (y == 0).float().mean().item() < 1.0  # the two averages differ on this client


def test_felo_mse_logit_loss_is_averaged_over_the_batch_too():
    strategy = Felo(alpha=2.0, logit_loss="mse")
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=ONE_FROZEN_BATCH)
    _server_knows_class_zero(strategy, server)
    client, y = _client_with_some_class_zero(server)
    mse = sum(j * j for j in range(10)) / 10  # MSE(z, 0) = 28.5 per covered sample
    share = (y == 0).float().mean().item()
    loss = client_update(strategy, server, strategy.configure_round(2, [client])[0]).metrics["m/loss"]
    assert loss == pytest.approx(cross_entropy_of(y) + 2.0 * share * (1.0 + mse), rel=1e-5)


def test_felo_averages_weights_only_within_an_architecture():
    models = {"a": ModelSpec("digits_mlp", {"hidden": 8}), "b": ModelSpec("digits_mlp", {"hidden": 8, "depth": 2})}
    strategy = Felo(average_weights=True)
    server = method_env(strategy, models, [Tier("ta", ["a"], count=2), Tier("tb", ["b"])])
    knowledge = ClassStatistics(
        "class_knowledge",
        {"features": torch.zeros(10, 8), "logits": torch.zeros(10, 10)},
        torch.full((10,), -1, dtype=torch.int32),
    )

    def update(client, role, value, n):
        state = {k: torch.full_like(v, value) for k, v in strategy.state.global_weights[role].items()}
        return ClientUpdate(client, n, {"class_knowledge": knowledge, "weights": ModelWeights(role, state)})

    c = server.clients
    strategy.aggregate(1, iter([update(c[0], "a", 1.0, 1), update(c[1], "a", 4.0, 3), update(c[2], "b", 10.0, 5)]))
    assert all(
        torch.allclose(v, torch.full_like(v, 3.25)) for v in strategy.state.global_weights["a"].values()
    )  # (1 + 12) / 4
    assert all(torch.allclose(v, torch.full_like(v, 10.0)) for v in strategy.state.global_weights["b"].values())


def test_felo_sends_class_knowledge_each_way_and_resumes_exactly(tmp_path):
    """A two-round run stopped after round 1 and resumed equals the uninterrupted one; each of the 6 clients a
    round sends and receives C rows of 64 features, C logits and a label (the server's bank padded to C rows),
    beside the model weights it gets and returns."""
    argv = ("--rounds", "2", "--eval_every", "1", "--training.local_steps", "2")
    comm = read_summary(check_resume(tmp_path, "digits_felo", *argv))["comm"]["by_payload"]
    knowledge = 10 * (64 + 10 + 1) * 4
    assert comm["uplink"]["class_knowledge"] == comm["downlink"]["class_knowledge"] == 2 * 6 * knowledge
    assert comm["uplink"]["weights"] == comm["downlink"]["weights"] > 0
