"""Felo / Velo client loss (paper 003, eq. 1): the feature and logit terms are averaged over the whole batch.

``L_k = 1/|D~_k| sum_i (l_ce + alpha (l_mse + l_kl))``: a sample of a class the server has no vector for
adds nothing to a term but counts in the ``1/|D~_k|``. ``loss_average: available`` keeps the former
average over the covered samples only. Checked on the constant-logits model, whose features are 0 and
whose logits are ``[0, 1, ..., 9]`` for every input, so each term is known in closed form.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from conftest import client_update, method_env
from test_fidelity import CONSTANT, ONE_FROZEN_BATCH

from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.strategies import Felo, Velo

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


def test_velo_averages_its_logit_term_over_the_batch_before_features_exist():
    strategy = Velo(cvae_interval=2, cvae_epochs=1)  # no CVAE after round 1: logits only
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=ONE_FROZEN_BATCH)
    _server_knows_class_zero(strategy, server)
    client, y = _client_with_some_class_zero(server)
    share = (y == 0).float().mean().item()
    loss = client_update(strategy, server, strategy.configure_round(2, [client])[0]).metrics["m/loss"]
    assert loss == pytest.approx(cross_entropy_of(y) + 0.5 * share * KL_FROM_UNIFORM, rel=1e-5)
