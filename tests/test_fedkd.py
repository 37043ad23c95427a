"""FedKD: the adaptive mutual losses by hand, the SVD energy threshold, what the clients and the server
exchange and that a client rebuilds exactly the server's mentee from the compressed update."""

import functools
import math

import pytest
import torch
from conftest import client_update, method_env
from torch import nn

from fl_lightning.client import LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate
from fl_lightning.knowledge.compression import LowRankUpdate, compress, energy_rank, energy_threshold
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedKD
from fl_lightning.strategies.fedkd import adaptive_mutual_losses

MODELS = {"t": ModelSpec("digits_mlp", {"hidden": 8}), "mentee": ModelSpec("digits_mlp", {"hidden": 4})}
PAIR = [Tier("all", ["t", "mentee"])]
MENTEE_NUMBERS = (64 * 4 + 4) + (4 * 10 + 10)  # Linear(64, 4) and the head Linear(4, 10)
TRAINING = LocalTraining(local_steps=3, batch_size=16)

# one example, two classes: mentor logits [0, 0] (p = [1/2, 1/2]), mentee [ln 3, 0] (p = [3/4, 1/4]), label 0
CE_T, CE_S = math.log(2.0), -math.log(0.75)
KL_S_T = 0.75 * math.log(0.75 / 0.5) + 0.25 * math.log(0.25 / 0.5)  # KL(p_mentee || p_mentor): the mentor's term
KL_T_S = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(0.5 / 0.25)  # KL(p_mentor || p_mentee): the mentee's term
MSE = ((1.0 - 1.0) ** 2 + (2.0 - 1.0) ** 2) / 2  # H_t = [1, 2], W_h H_s = [1, 1]


def _batch(requires_grad=False):
    z_t = torch.zeros(1, 2, requires_grad=requires_grad)
    z_s = torch.tensor([[math.log(3.0), 0.0]], requires_grad=requires_grad)
    h_t, h_s = torch.tensor([[1.0, 2.0]]), torch.tensor([[1.0]])
    mapping = nn.Linear(1, 2, bias=False)
    nn.init.ones_(mapping.weight)
    return (h_t, z_t), (h_s, z_s), torch.tensor([0]), mapping


def test_adaptive_losses_divide_the_distillation_by_both_cross_entropies():
    mentor, mentee, y, mapping = _batch()
    l_t, l_s = adaptive_mutual_losses(mentor, mentee, y, mapping, adaptive=True)
    assert l_t.item() == pytest.approx(CE_T + (KL_S_T + MSE) / (CE_T + CE_S))
    assert l_s.item() == pytest.approx(CE_S + (KL_T_S + MSE) / (CE_T + CE_S))
    l_t, l_s = adaptive_mutual_losses(mentor, mentee, y, mapping, adaptive=False)
    assert l_t.item() == pytest.approx(CE_T + KL_S_T + MSE) and l_s.item() == pytest.approx(CE_S + KL_T_S + MSE)
    l_t, _ = adaptive_mutual_losses(mentor, mentee, y, mapping, adaptive=False, reduction="mean")
    assert l_t.item() == pytest.approx(CE_T + KL_S_T / 2 + MSE)  # the KL divided by B x C = 2


@pytest.mark.parametrize("detach", [True, False])
def test_detached_partner_gets_no_gradient_from_the_mentors_loss(detach):
    mentor, mentee, y, mapping = _batch(requires_grad=True)
    l_t, _ = adaptive_mutual_losses(mentor, mentee, y, mapping, detach=detach)
    l_t.backward()
    grad = mentee[1].grad
    assert (grad is None or not grad.any()) == detach  # detached: no path from the mentor's loss at all


def test_energy_rank_keeps_the_fewest_singular_values_above_the_threshold():
    s = torch.tensor([3.0, 2.0, 1.0])  # energies 9, 4, 1 of 14
    assert energy_rank(s, 0.6) == 1  # 9 > 8.4
    assert energy_rank(s, 0.9) == 2  # 9 < 12.6 < 13
    assert energy_rank(s, 0.95) == 3  # 13 < 13.3 < 14
    assert energy_rank(s, 1.0) == 3  # never exceeded: all kept (the official code would drop the matrix)
    assert energy_threshold(1, 10, 0.95, 0.98) == pytest.approx(0.953)
    assert energy_threshold(10, 10, 0.95, 0.98) == pytest.approx(0.98)


def test_compression_sends_factors_of_matrices_and_vectors_as_they_are():
    update = {"w": torch.diag(torch.tensor([3.0, 2.0, 1.0])), "b": torch.ones(3), "zero": torch.zeros(2, 2)}
    sent = compress("u", update, 0.9)
    u, s, vh = sent.factors["w"]
    assert u.shape == (3, 2) and s.tolist() == [3.0, 2.0] and vh.shape == (2, 3)
    assert sorted(sent.dense) == ["b", "zero"]
    assert sent.nbytes == (3 * 2 + 2 + 2 * 3 + 3 + 4) * 4
    assert torch.allclose(sent.reconstruct()["w"], torch.diag(torch.tensor([3.0, 2.0, 0.0])), atol=1e-6)
    kernel = torch.arange(8.0).reshape(2, 1, 2, 2)  # a conv kernel is compressed as a 2 x 4 matrix
    whole = compress("u", {"k": kernel}, 1.0)
    assert whole.factors["k"][2].shape == (2, 4) and torch.allclose(whole.reconstruct()["k"], kernel, atol=1e-5)
    assert compress("u", update, None).nbytes == (9 + 3 + 4) * 4  # no compression: all dense


def _setup(**options):
    strategy = FedKD(**options)
    server = method_env(strategy, MODELS, PAIR, training=TRAINING)
    return strategy, server


def test_uncompressed_round_sends_the_mentee_down_and_its_update_up():
    strategy, server = _setup()
    task = strategy.configure_round(1, [server.clients[0]])[0]
    assert list(task.downlink) == ["mentee"] and task.downlink["mentee"].nbytes == MENTEE_NUMBERS * 4
    state = {}
    update = client_update(strategy, server, task, state)
    sent = update.uplink["mentee_update"]
    assert sent.nbytes == MENTEE_NUMBERS * 4 and not sent.factors
    assert state["hidden_map"]["weight"].shape == (8, 4)  # W_h maps the mentee's 4 to the mentor's 8
    assert set(update.metrics) == {"t/loss", "mentee/loss"}


def test_server_applies_the_mean_update():
    for weighted, expected in ((False, 2.0), (True, 2.5)):
        strategy, server = _setup(weighted=weighted)
        before = {k: v.clone() for k, v in strategy.state.mentee_weights.items()}
        c = server.clients
        ups = [
            ClientUpdate(c[0], 1, {"mentee_update": compress("mentee_update", _full(before, 1.0), None)}),
            ClientUpdate(c[1], 3, {"mentee_update": compress("mentee_update", _full(before, 3.0), None)}),
        ]
        strategy.aggregate(1, iter(ups))
        # uniform: (1 + 3) / 2; by examples: (1 x 1 + 3 x 3) / 4
        assert torch.allclose(strategy.state.mentee_weights["head.bias"], before["head.bias"] + expected)


def _full(like, value):
    return {k: torch.full_like(v, value) for k, v in like.items()}


def test_compressed_update_keeps_the_energy_rank_and_the_client_rebuilds_the_servers_mentee():
    plain, plain_server = _setup()  # same seeds: its dense upload is the exact update
    plain_task = plain.configure_round(1, [plain_server.clients[0]])[0]
    delta = client_update(plain, plain_server, plain_task).uplink["mentee_update"].reconstruct()

    strategy, server = _setup(compression="svd")
    c0, c1 = server.clients[0], server.clients[1]
    state = {}
    sent = client_update(strategy, server, strategy.configure_round(1, [c0])[0], state).uplink["mentee_update"]
    energy = energy_threshold(1, server.rounds, 0.95, 0.98)
    expected = 0
    for name, tensor in delta.items():
        if tensor.dim() == 2:
            k = energy_rank(torch.linalg.svdvals(tensor), energy)
            assert sent.factors[name][1].shape == (k,)
            expected += k * (tensor.shape[0] + tensor.shape[1] + 1)
        else:
            expected += tensor.numel()
    assert sent.nbytes == expected * 4

    strategy.aggregate(1, iter([ClientUpdate(c0, 1, {"mentee_update": sent})]))
    tasks = strategy.configure_round(2, [c0, c1])
    assert list(tasks[0].downlink) == ["mentee_update"]  # c0 trained last round: the update only
    assert isinstance(tasks[0].downlink["mentee_update"], LowRankUpdate)
    assert list(tasks[1].downlink) == ["mentee"]  # c1 missed it: the full mentee
    server_mentee = {k: v.clone() for k, v in strategy.state.mentee_weights.items()}
    client_update(strategy, server, tasks[0], state)
    assert all(torch.equal(state["mentee_base"][k], v) for k, v in server_mentee.items())


def test_every_client_needs_a_mentor_and_the_mentee():
    with pytest.raises(ConfigError, match="no tier lists the mentee role 'mentee'"):
        method_env(FedKD(), MODELS, [Tier("all", ["t"])])
    with pytest.raises(ConfigError, match="energy_start"):
        FedKD(energy_start=0.99, energy_end=0.95)


def test_every_client_s_hidden_map_trains_in_one_instance_from_a_fresh_optimizer_state():
    """``W_h`` lives in one module per shape (``ctx.helper``: fixed addresses, so graphs can be shared), holds
    each client's own weights while that client trains, and starts each fit from a fresh optimizer state."""
    sgd = functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9)
    training = LocalTraining(local_steps=3, batch_size=16, optimizer=sgd)
    strategy = FedKD()
    server = method_env(strategy, MODELS, PAIR, training=training)
    loop = server._loop
    first, second = strategy.configure_round(1, server.clients[:2])
    state_1, state_2 = {}, {}
    client_update(strategy, server, first, state_1)
    (slot,) = loop.helpers.values()
    assert torch.equal(slot.module.weight, state_1["hidden_map"]["weight"])
    assert slot.optimizer.state  # momenta of the first client's fit
    client_update(strategy, server, second, state_2)
    assert len(loop.helpers) == 1 and next(iter(loop.helpers.values())) is slot
    assert not torch.equal(state_1["hidden_map"]["weight"], state_2["hidden_map"]["weight"])
    # the first client's next round starts from its own W_h (not the second's) and a fresh momentum
    again, before = strategy.configure_round(2, server.clients[:1])[0], state_1["hidden_map"]["weight"].clone()
    received = {}
    real = loop.helper_optimizer

    def noted(module):
        optimizer, base_lrs = real(module)
        received["weight"], received["state"] = module.weight.detach().clone(), dict(optimizer.state)
        return optimizer, base_lrs

    loop.helper_optimizer = noted
    client_update(strategy, server, again, state_1)
    assert torch.equal(received["weight"], before)
    assert not received["state"]
    assert not torch.equal(state_1["hidden_map"]["weight"], before)  # and trained it


def test_a_helper_is_one_instance_per_name_class_and_shapes():
    class Doubled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    server = method_env(FedKD(), MODELS, PAIR, training=TRAINING)
    loop = server._loop
    first = loop.helper("map", nn.Linear(4, 2, bias=False))
    assert loop.helper("map", nn.Linear(4, 2, bias=False)) is first  # the same kind: the one instance
    assert loop.helper("map", nn.Linear(4, 3, bias=False)) is not first  # other shapes
    doubled = loop.helper("map", Doubled(4, 2, bias=False))
    assert type(doubled) is Doubled and doubled is not first  # another class: its own forward, not the first's
    assert loop.helper("other", nn.Linear(4, 2, bias=False)) is not first
    assert len(loop.helpers) == 4
