"""FedGEMS: selective knowledge fusion by hand, the server's selective loss and pool, the clients' distillation loss
by hand (the paper's form and AIJack's), the sizes sent, errors."""

import math

import pytest
import torch
from conftest import ROOT, aggregate_phase, client_update, method_env, phase_tasks, read_summary, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.data import DigitsData
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedGEMS
from fl_lightning.strategies.fedgems import client_distillation_loss, selective_fusion

MODELS = {"m": ModelSpec("digits_mlp", {"hidden": 8}), "server": ModelSpec("digits_mlp", {"hidden": 16})}
CONSTANT = {"m": ModelSpec("conftest.constant_logits_model"), "server": ModelSpec("digits_mlp", {"hidden": 16})}


def _env(strategy, data=None, tiers=None):
    training = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=2, batch_size=8)
    data = data or DigitsData(server_fraction=0.2)
    return method_env(strategy, MODELS, tiers or [Tier("all", ["m"])], training=training, data=data)


def test_selective_fusion_weighs_the_right_clients_by_inverse_entropy():
    # 3 clients x 2 examples, labels (0, 1). Example 0: clients 0 and 1 right, client 2 wrong (masked);
    # example 1: clients 1 and 2 right, client 0 wrong.
    z = torch.tensor([[[2.0, 0.0], [1.0, 0.0]], [[1.0, 0.0], [0.0, 3.0]], [[0.0, 1.0], [0.0, 1.0]]])
    fused, any_right = selective_fusion(z, torch.tensor([0, 1]))
    # entropies by hand: H(softmax(2, 0)) = 0.365333, H(softmax(1, 0)) = 0.582203, H(softmax(0, 3)) = 0.190865
    # example 0: softmax(1/0.365333, 1/0.582203) = (0.734901, 0.265099) -> 0.734901 * 2 + 0.265099 * 1
    # example 1: softmax(1/0.190865, 1/0.582203) = (0.971302, 0.028698) -> 0.971302 * 3 + 0.028698 * 1
    assert torch.allclose(fused, torch.tensor([[1.734901, 0.0], [0.0, 2.942604]]), atol=1e-5)
    assert any_right.tolist() == [True, True]
    # with labels (1, 0) only one client is right on each example: its logits, whole
    fused, _ = selective_fusion(z, torch.tensor([1, 0]))
    assert torch.equal(fused, torch.tensor([[0.0, 1.0], [1.0, 0.0]]))
    # nobody right: no knowledge
    fused, any_right = selective_fusion(z[:1, :1], torch.tensor([1]))
    assert any_right.tolist() == [False] and torch.equal(fused, torch.zeros(1, 2))


def test_server_loss_mixes_ce_and_kl_where_the_server_is_wrong_and_keeps_its_right_logits():
    strategy = FedGEMS(epsilon=0.75)
    _env(strategy)
    s = torch.tensor([[0.0, 1.0], [0.0, 1.0]])  # wrong on example 0 (label 0), right on example 1 (label 1)
    y, rows = torch.tensor([0, 1]), torch.tensor([5, 7])
    strategy.state.pool_logits, strategy.state.pool_known = torch.zeros(10, 2), torch.zeros(10, dtype=torch.bool)
    fused = torch.tensor([[1.734901, 0.0], [0.0, 0.0]])
    loss = strategy.server_loss(s, y, rows, fused, torch.tensor([True, False]))
    # example 0: CE = log(1 + e) = 1.313262; teacher softmax(1.734901, 0) = (0.850030, 0.149970),
    # KL = 0.850030 (ln 0.850030 + 1.313262) + 0.149970 (ln 0.149970 + 0.313262) = 0.740635,
    # 0.75 * 1.313262 + 0.25 * 0.740635 = 1.170105; example 1: CE = log(1 + e^-1) = 0.313262
    assert loss.item() == pytest.approx((1.170105 + 0.313262) / 2, abs=1e-5)
    assert strategy.state.pool_known.nonzero().flatten().tolist() == [7]  # the example it got right
    assert torch.equal(strategy.state.pool_logits[7], torch.tensor([0.0, 1.0]))
    # next time the pool's own logits are example 7's teacher, not the clients' fusion
    s2 = torch.tensor([[0.0, 0.0]])
    loss = strategy.server_loss(
        s2, torch.tensor([0]), torch.tensor([7]), torch.tensor([[9.0, 0.0]]), torch.tensor([True])
    )
    # argmax of (0, 0) is 0: right, so plain CE = log 2
    assert loss.item() == pytest.approx(0.693147, abs=1e-5)
    loss = strategy.server_loss(
        torch.tensor([[0.0, 1.0]]),
        torch.tensor([0]),
        torch.tensor([7]),
        torch.tensor([[9.0, 0.0]]),
        torch.tensor([True]),
    )
    # wrong: teacher is the pool's (0, 0) from the step above
    # -> KL(uniform || softmax(0, 1)) = 0.5 (1.313262 + 0.313262) - ln 2
    kl = 0.5 * (1.313262 + 0.313262) - 0.693147
    assert loss.item() == pytest.approx(0.75 * 1.313262 + 0.25 * kl, abs=1e-5)


# 2 public examples x 3 classes at T = 2: client logits z, server logits s, labels y
Z = torch.tensor([[3.0, 0.0, 0.0], [0.0, 0.0, 4.0]])
S = torch.tensor([[0.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
Y = torch.tensor([0, 2])
# CE: log(e^3 + 2) - 3 = 0.094923 and log(2 + e^4) - 4 = 0.035976
CE = (math.log(math.exp(3) + 2) - 3 + math.log(2 + math.exp(4)) - 4) / 2
# example 0, teacher uniform, student softmax(1.5, 0, 0): KL(teacher || student) = log(e^1.5 + 2) - log 3 - 0.5
# = 0.270369; KL(student || teacher) = log 3 - H(student) = 0.266789
# example 1, teacher p = (1, e, 1) / (e + 2), student q = (1, 1, e^2) / (e^2 + 2):
# KL(p || q) = log(e^2 + 2) - log(e + 2) + (e - 2) / (e + 2) = 0.840334; KL(q || p) = 0.779365
KL_PAPER = [
    math.log(math.exp(1.5) + 2) - math.log(3) - 0.5,
    math.log(math.exp(2) + 2) - math.log(math.e + 2) + (math.e - 2) / (math.e + 2),
]


def _entropy(logits):
    e = [math.exp(v) for v in logits]
    return -sum(x / sum(e) * math.log(x / sum(e)) for x in e)


# KL(q || p) = sum q log q - sum q log p: with q = softmax(a), p = softmax(b), sum q log p = sum q b - log sum e^b
def _kl(a, b):
    q = [math.exp(v) / sum(math.exp(w) for w in a) for v in a]
    return -_entropy(a) - sum(qi * bi for qi, bi in zip(q, b)) + math.log(sum(math.exp(w) for w in b))


KL_AIJACK = [_kl([1.5, 0, 0], [0, 0, 0]), _kl([0, 0, 2], [0, 1, 0])]


def test_client_distillation_loss_by_hand_paper_and_aijack_forms():
    assert KL_PAPER == pytest.approx([0.270369, 0.840334], abs=1e-6)
    assert KL_AIJACK == pytest.approx([0.266789, 0.779365], abs=1e-6)
    # the paper (eq. 6): 0.75 CE + 0.25 T^2 KL(server || client), the KL per example: 0.604439
    paper = client_distillation_loss(Z, Y, S, epsilon=0.75, temperature=2.0).item()
    assert paper == pytest.approx(0.75 * CE + 0.25 * 4 * sum(KL_PAPER) / 2, abs=1e-5)
    # AIJack: nn.KLDivLoss()(log softmax(server), softmax(client)), KL(client || server) / (B x C): 0.223446
    aijack = client_distillation_loss(Z, Y, S, epsilon=0.75, temperature=2.0, form="aijack").item()
    assert aijack == pytest.approx(0.75 * CE + 0.25 * 4 * sum(KL_AIJACK) / (2 * 3), abs=1e-5)
    # epsilon weighs the cross-entropy: at 1 the KL is gone, at 0 the CE
    assert client_distillation_loss(Z, Y, S, epsilon=1.0).item() == pytest.approx(CE, abs=1e-6)
    only_kl = client_distillation_loss(Z, Y, S, epsilon=0.0, temperature=2.0).item()
    assert only_kl == pytest.approx(4 * sum(KL_PAPER) / 2, abs=1e-5)


@pytest.mark.parametrize("form", ["paper", "aijack"])
def test_a_clients_distillation_step_trains_on_that_loss(form):
    """The client's distill phase on a model whose logits are (0, 1, ..., 9) for every input, one frozen step over
    the whole public set: the loss it reports is the loss above with the server's logits it received."""
    frozen = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), local_steps=1, batch_size=10_000)
    strategy = FedGEMS(epsilon=0.75, temperature=2.0, distill_steps=1, batch_size=10_000, kl_form=form)
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], training=frozen, data=DigitsData(server_fraction=0.2))
    client, state = server.clients[0], {}
    client_update(strategy, server, phase_tasks(strategy, 1, [client], "train")[0], state)
    n = len(strategy.public_y)
    strategy.uploaders, strategy.server_logits = [client], torch.linspace(-1, 1, n * 10).reshape(n, 10)
    update = client_update(strategy, server, phase_tasks(strategy, 1, [client], "distill")[0], state)
    z = torch.arange(10.0).expand(n, 10)
    expected = client_distillation_loss(z, strategy.public_y, strategy.server_logits, 0.75, 2.0, form).item()
    assert update.metrics["m/distill_loss"] == pytest.approx(expected, rel=1e-5)
    other = client_distillation_loss(
        z, strategy.public_y, strategy.server_logits, 0.75, 2.0, {"paper": "aijack", "aijack": "paper"}[form]
    )
    assert abs(other.item() - expected) > 1e-3  # the two forms differ here: the step ran the one asked for


def test_server_loss_with_aijacks_kl_form():
    strategy = FedGEMS(epsilon=0.75, kl_form="aijack")
    _env(strategy)
    strategy.state.pool_logits, strategy.state.pool_known = torch.zeros(10, 2), torch.zeros(10, dtype=torch.bool)
    s, fused = torch.tensor([[0.0, 1.0]]), torch.tensor([[1.734901, 0.0]])
    loss = strategy.server_loss(s, torch.tensor([0]), torch.tensor([5]), fused, torch.tensor([True]))
    # wrong example with the clients' fusion as teacher t = softmax(1.734901, 0) = (0.850030, 0.149970):
    # KL(softmax(s) || t) = 0.268941 (ln 0.268941 - ln 0.850030) + 0.731059 (ln 0.731059 - ln 0.149970)
    # = 0.848549, divided by C = 2; CE = log(1 + e) = 1.313262
    kl = 0.268941 * (math.log(0.268941) - math.log(0.850030)) + 0.731059 * (math.log(0.731059) - math.log(0.149970))
    assert loss.item() == pytest.approx(0.75 * 1.313262 + 0.25 * kl / 2, abs=1e-5)


def test_bytes_each_way_positions_logits_and_server_logits():
    strategy = FedGEMS(public_size=5, server_steps=1, distill_steps=1)
    server = _env(strategy)
    client = server.clients[1]
    task = phase_tasks(strategy, 3, [client], "train")[0]
    assert task.downlink["public_positions"].nbytes == 5 * 4  # n int32 positions
    state = {}
    update = client_update(strategy, server, task, state)
    assert update.uplink["public_logits"].nbytes == 5 * 10 * 4  # n x C float32 up
    before = {k: v.clone() for k, v in strategy.state.server_weights.items()}
    aggregate_phase(strategy, 3, [update], "train")
    assert any(not torch.equal(before[k], v) for k, v in strategy.state.server_weights.items())  # the server trained
    down = phase_tasks(strategy, 3, [client], "distill")[0]
    assert down.downlink["server_logits"].nbytes == 5 * 10 * 4  # n x C float32 down
    update = client_update(strategy, server, down, state)
    assert update.uplink == {} and "public_positions" not in state


def test_server_only_role_is_built_and_bad_settings_are_refused_in_one_sentence(tmp_path):
    strategy = FedGEMS()
    server = _env(strategy)
    assert "server" in server.roles and all(c.roles == ("m",) for c in server.clients)
    with pytest.raises(ConfigError, match="FedGEMS needs labeled public data on the server; set data.init_args"):
        _env(FedGEMS(), data=DigitsData())
    with pytest.raises(ConfigError, match="server_role 'server' is the server's own model, but tiers give it"):
        _env(FedGEMS(), tiers=[Tier("all", ["server"])])
    with pytest.raises(ConfigError, match=r"FedGEMS epsilon must be in \[0, 1\], got 1.5."):
        FedGEMS(epsilon=1.5)
    recipe = ["--config", str(ROOT / "recipes" / "digits_fedgems.yaml"), "--rounds", "1", "--runtime.progress", "false"]
    missing = ["--strategy.init_args.server_role", "huge", "--output_dir", str(tmp_path / "x")]
    assert run_cli("fit", *recipe, *missing) == 2
    assert not (tmp_path / "x").exists()


def test_a_short_run_trains_the_server_model(tmp_path):
    recipe = ["--config", str(ROOT / "recipes" / "digits_fedgems.yaml"), "--rounds", "2", "--eval_every", "2"]
    assert run_cli("fit", *recipe, "--runtime.progress", "false", "--output_dir", str(tmp_path / "g")) == 0
    summary = read_summary(tmp_path / "g")
    assert summary["monitor"] == "server/test_acc"
    assert summary["final"]["server/test_acc"] > 0.3  # 0.46 measured on 2 rounds; chance is 0.1
    # 2 rounds x 10 clients x 287 x 10 float32 each way (whole public set: no positions sent)
    assert summary["comm"]["uplink_bytes"] == summary["comm"]["downlink_bytes"] == 2 * 10 * 287 * 10 * 4
