"""FML and the joint training of two roles of one client (knowledge/mutual.py): losses by hand, what a
detached partner means, sizes sent."""

import math

import pytest
import torch
from conftest import client_update, method_env

from fl_lightning.client import ClientContext, LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.knowledge.mutual import mutual_kl
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FML

MODELS = {"p": ModelSpec("digits_mlp", {"hidden": 8}), "meme": ModelSpec("digits_mlp", {"hidden": 4})}
PAIR = [Tier("all", ["p", "meme"])]
MEME_NUMBERS = (64 * 4 + 4) + (4 * 10 + 10)  # digits_mlp(hidden=4): Linear(64, 4) and the head Linear(4, 10)
TRAINING = LocalTraining(local_steps=3, batch_size=16)


def test_kl_per_example_or_divided_by_batch_times_classes():
    student = torch.zeros(2, 2)  # softmax [1/2, 1/2]
    teacher = torch.tensor([[math.log(3.0), 0.0]] * 2)  # softmax [3/4, 1/4]
    kl = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # 0.1308 per example
    assert mutual_kl(student, teacher, "batchmean").item() == pytest.approx(kl)
    assert mutual_kl(student, teacher, "mean").item() == pytest.approx(kl * 2 / 4)  # summed KL / (B x C)


def _trained_alone(server, task, role, weights):
    """The role trained by plain cross-entropy on the same batches (same client, round and seed)."""
    ctx = ClientContext(task.client, task.round, server._loop, server.data, {}, 0)
    ctx.load(role, weights)
    ctx.fit(role)
    return ctx.weights(role)


def test_without_distillation_the_two_models_train_as_if_alone():
    strategy = FML(alpha=1.0, beta=1.0)
    server = method_env(strategy, MODELS, PAIR, training=TRAINING)
    client = server.clients[0]
    task = strategy.configure_round(1, [client])[0]
    state = {}
    update = client_update(strategy, server, task, state)
    alone_meme = _trained_alone(server, task, "meme", strategy.state.meme_weights)
    alone_private = _trained_alone(server, task, "p", server.initial_weights("p", client.id))
    assert all(torch.allclose(update.uplink["meme"].state[k], v) for k, v in alone_meme.items())
    assert all(torch.allclose(state["weights"][k], v) for k, v in alone_private.items())


@pytest.mark.parametrize("detach", [True, False])
def test_a_detached_partner_gets_no_gradient_from_the_other_loss(detach):
    # alpha = 0: the private model learns only KL(p_meme || p_private); beta = 1: the meme only CE
    strategy = FML(alpha=0.0, beta=1.0, detach_partner=detach)
    server = method_env(strategy, MODELS, PAIR, training=TRAINING)
    task = strategy.configure_round(1, [server.clients[0]])[0]
    meme = client_update(strategy, server, task).uplink["meme"].state
    alone = _trained_alone(server, task, "meme", strategy.state.meme_weights)
    same = all(torch.allclose(meme[k], v) for k, v in alone.items())
    assert same == detach  # backpropagating the private loss through the meme (HtFLlib) changes it


def test_meme_is_averaged_and_is_all_that_is_sent():
    strategy = FML()
    server = method_env(strategy, MODELS, PAIR, training=TRAINING)
    c = server.clients
    task = strategy.configure_round(1, [c[0]])[0]
    assert task.downlink["meme"].nbytes == MEME_NUMBERS * 4
    update = client_update(strategy, server, task)
    assert list(update.uplink) == ["meme"] and update.uplink["meme"].nbytes == MEME_NUMBERS * 4
    ones = {k: torch.full_like(v, 1.0) for k, v in strategy.state.meme_weights.items()}
    fives = {k: torch.full_like(v, 5.0) for k, v in strategy.state.meme_weights.items()}
    strategy.aggregate(
        1,
        iter(
            [
                ClientUpdate(c[0], 1, {"meme": ModelWeights("meme", ones)}),
                ClientUpdate(c[1], 3, {"meme": ModelWeights("meme", fives)}),
            ]
        ),
    )
    assert torch.equal(strategy.state.meme_weights["head.bias"], torch.full((10,), 4.0))  # (1 + 5 x 3) / 4


def test_private_model_stays_on_the_client_and_is_what_gets_evaluated():
    strategy = FML()
    server = method_env(strategy, MODELS, PAIR, training=TRAINING)
    client = server.clients[0]
    role, before = strategy.personal_weights(client, {})
    assert role == "p" and torch.equal(before["head.weight"], server.initial_weights("p", client.id)["head.weight"])
    state = {}
    client_update(strategy, server, strategy.configure_round(1, [client])[0], state)
    assert not torch.equal(state["weights"]["head.weight"], before["head.weight"])
    assert strategy.personal_weights(client, state)[1] is state["weights"]


def test_every_client_needs_a_private_and_the_meme_role():
    with pytest.raises(ConfigError, match="no tier lists the meme role 'meme'"):
        method_env(FML(), MODELS, [Tier("all", ["p"])])
    with pytest.raises(ConfigError, match=r"clients \[0, 1\] do not"):
        method_env(FML(), MODELS, [Tier("alone", ["p"], count=2), Tier("pair", ["p", "meme"])])
    with pytest.raises(ConfigError, match=r"FML alpha must be in \[0, 1\], got 1.5."):
        FML(alpha=1.5)
