"""Each method's math against numbers computed by hand."""

import math

import pytest
import torch
from torch import nn

from fl_lightning.knowledge.banks import ClassBank
from fl_lightning.knowledge.class_stats import class_sums
from fl_lightning.knowledge.codistill import codistillation_targets
from fl_lightning.knowledge.cvae import FeatureCVAE, cvae_loss
from fl_lightning.knowledge.distillation import kd_kl_loss, ramp_up
from fl_lightning.knowledge.header import header_step, train_header
from fl_lightning.knowledge.server_optim import ServerAdam, merge_gradients


def test_class_sums_per_class_and_their_counts():
    values = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    sums, counts = class_sums(values, torch.tensor([0, 1, 0]), num_classes=3)
    assert torch.equal(sums, torch.tensor([[6.0, 8.0], [3.0, 4.0], [0.0, 0.0]]))
    assert counts.tolist() == [2, 1, 0]  # FedHe's division by the counts plus one: test_fedhe.py


def test_class_bank_averages_every_stored_upload():
    bank = ClassBank(num_classes=2, dim=2)
    bank.add(torch.tensor([[1.0, 1.0], [9.0, 9.0]]), torch.tensor([True, False]))  # class 1 absent
    bank.add(torch.tensor([[3.0, 5.0], [7.0, 7.0]]), torch.tensor([True, True]))
    assert torch.allclose(bank.mean(), torch.tensor([[2.0, 3.0], [7.0, 7.0]]))  # eq. 10
    assert bank.counts.tolist() == [2.0, 1.0]
    bank.collapse()
    assert bank.counts.tolist() == [1.0, 1.0] and torch.allclose(bank.mean(), torch.tensor([[2.0, 3.0], [7.0, 7.0]]))
    empty = ClassBank(3, 2)
    assert not empty.available.any() and torch.equal(empty.mean(), torch.zeros(3, 2))


def test_kd_loss_at_temperature_by_hand():
    student = torch.tensor([[0.0, 0.0]])
    teacher = torch.tensor([[math.log(3.0), 0.0]])
    t = 2.0
    p = [math.sqrt(3) / (math.sqrt(3) + 1), 1 / (math.sqrt(3) + 1)]  # softmax(teacher / 2)
    expected = t**2 * sum(pi * math.log(pi / 0.5) for pi in p)
    assert kd_kl_loss(student, teacher, t).item() == pytest.approx(expected, rel=1e-5)  # float32
    assert kd_kl_loss(teacher, teacher, 3.0).item() == pytest.approx(0.0, abs=1e-5)


def test_ramp_up_schedule_of_paper_001_code():
    assert ramp_up(0, 0.5, 300) == pytest.approx(0.5 * math.exp(-5))
    assert ramp_up(150, 0.5, 300) == pytest.approx(0.5 * math.exp(-1.25))
    assert ramp_up(300, 0.5, 300) == 0.5 and ramp_up(7, 1.0, 0) == 1.0


def test_merged_gradient_rescaling_and_alpha_one():
    g, delta = {"w": torch.tensor([3.0, 4.0])}, {"w": torch.tensor([0.0, 2.0])}  # norms 5 and 2
    merged = merge_gradients(g, delta, alpha=0.5)
    # 0.5 * [3, 4] + 0.5 * [0, 2] * 5 / 2 = [1.5, 4.5]
    assert torch.allclose(merged["w"], torch.tensor([1.5, 4.5]))
    assert merge_gradients(g, delta, alpha=1.0) is g
    assert torch.allclose(merge_gradients(g, {"w": torch.zeros(2)}, 0.3)["w"], 0.3 * g["w"])


def test_server_adam_step_by_hand():
    opt = ServerAdam(beta1=0.9, beta2=0.999, eps=0.0)
    out = opt.step({"w": torch.tensor([1.0])}, {"w": torch.tensor([0.5])}, lr=0.1)
    m, v = 0.1 * 0.5, 0.001 * 0.25
    assert out["w"].item() == pytest.approx(1.0 - 0.1 * m / math.sqrt(v), rel=1e-6)
    opt.reset()
    assert opt.m == {} and opt.v == {}


def test_codistillation_targets_interpolate_with_student_reg():
    teacher, student = torch.tensor([[math.log(3.0), 0.0]]), torch.tensor([[0.0, 0.0]])
    targets = codistillation_targets(teacher, student, temperature=1.0, student_reg=0.2)
    assert torch.allclose(targets, torch.tensor([[0.8 * 0.75 + 0.2 * 0.5, 0.8 * 0.25 + 0.2 * 0.5]]))


def test_fedgh_header_step_by_hand():
    header = nn.Linear(2, 2)
    nn.init.zeros_(header.weight)
    nn.init.zeros_(header.bias)
    loss = header_step(header, torch.tensor([[1.0, 0.0]]), torch.tensor([0]), lr=0.1)
    # softmax = [0.5, 0.5]; dL/dz = [-0.5, 0.5]; dW = dz x^T; one SGD step with lr 0.1
    assert loss == pytest.approx(math.log(2))
    assert torch.allclose(header.weight, torch.tensor([[0.05, 0.0], [-0.05, 0.0]]))
    assert torch.allclose(header.bias, torch.tensor([0.05, -0.05]))


def test_fedgh_header_steps_per_lar_and_per_client_by_hand():
    reps, labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    header = nn.Linear(2, 2)
    nn.init.zeros_(header.weight)
    nn.init.zeros_(header.bias)
    losses = train_header(header, reps, labels, lr=0.1, per_lar=True)
    # LAR 1 ([1, 0], class 0) as above: W = [[0.05, 0], [-0.05, 0]], b = [0.05, -0.05].
    # LAR 2 ([0, 1], class 1): logits = b = [0.05, -0.05], p = [p0, 1 - p0] with p0 = 1 / (1 + e^-0.1);
    # dL/dz = p - onehot(1) = [p0, -p0]; column 1 of W and b move by -0.1 [p0, -p0]
    p0 = 1 / (1 + math.exp(-0.1))  # 0.52498
    assert losses == pytest.approx([math.log(2), math.log(1 + math.exp(0.1))], rel=1e-6)
    assert torch.allclose(header.weight, torch.tensor([[0.05, -0.1 * p0], [-0.05, 0.1 * p0]]))
    assert torch.allclose(header.bias, torch.tensor([0.05 - 0.1 * p0, -0.05 + 0.1 * p0]))
    nn.init.zeros_(header.weight)
    nn.init.zeros_(header.bias)
    # one step on the mean loss: each LAR's gradient halved, biases cancel
    assert train_header(header, reps, labels, lr=0.1, per_lar=False) == pytest.approx([math.log(2)])
    assert torch.allclose(header.weight, torch.tensor([[0.025, -0.025], [-0.025, 0.025]]))
    assert torch.allclose(header.bias, torch.zeros(2))


def test_cvae_loss_by_hand_and_generation_shape():
    target = torch.zeros(1, 2)
    assert cvae_loss(target, target, torch.zeros(1, 3), torch.zeros(1, 3)).item() == 0.0
    # MSE([1, 1], [0, 0]) = 1; KL of N([1, 0], I) from N(0, I) = 0.5
    loss = cvae_loss(torch.ones(1, 2), target, torch.tensor([[1.0, 0.0]]), torch.zeros(1, 2), kl_weight=1.0)
    assert loss.item() == pytest.approx(1.5)
    cvae = FeatureCVAE(feature_dim=6, num_classes=4, hidden=8, latent=3)
    assert cvae.generate(torch.arange(4)).shape == (4, 6)
    recon, mu, log_var = cvae(torch.randn(5, 6), torch.tensor([0, 1, 2, 3, 0]))
    assert recon.shape == (5, 6) and mu.shape == log_var.shape == (5, 3)


def test_restored_server_state_returns_to_the_devices_setup_put_it_on():
    """Checkpoints load on the CPU; a run resumed on a GPU must get its global weights back on the GPU (the
    'meta' device stands in for it here) and keep on the CPU what setup keeps there."""
    from fl_lightning.strategies.base import _restore

    built = {
        "global": {"w": torch.zeros(2, device="meta"), "b": torch.zeros(1)},
        "order": [torch.zeros(1, device="meta")],
    }
    saved = {"global": {"w": torch.ones(2), "b": torch.ones(1), "new": torch.ones(3)}, "order": [torch.ones(1)]}
    restored = _restore(built, saved)
    assert restored["global"]["w"].device.type == "meta" and restored["global"]["b"].device.type == "cpu"
    assert restored["global"]["new"].device.type == "cpu"  # nothing built there: as saved
    assert restored["order"][0].device.type == "meta"
    assert _restore(None, saved) is saved  # no state built (a plain value): as saved


def test_server_adam_moments_follow_the_gradients_device_after_a_restore():
    from fl_lightning.knowledge.server_optim import ServerAdam

    adam = ServerAdam()
    adam.load_state_dict({"m": {"w": torch.zeros(2)}, "v": {"w": torch.zeros(2)}})  # as a checkpoint loads
    out = adam.step({"w": torch.zeros(2, device="meta")}, {"w": torch.ones(2, device="meta")}, lr=0.1)
    assert adam.m["w"].device.type == "meta" and adam.v["w"].device.type == "meta"
    assert out["w"].device.type == "meta"
