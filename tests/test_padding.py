"""Padded batches (the batched executor in lockstep, ``runtime.lockstep``): the reductions that leave padded rows
out, with numbers computed by hand, and batch norm over the real rows under vmap against torch's batch norm on
each client's real rows alone."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from fl_lightning.client.batched.masked_norm import masked_batch_norms, unmaskable_norm
from fl_lightning.federation.padding import PAD, class_index, padded_loss, padded_rows, real_labels, real_rows
from fl_lightning.knowledge.distillation import kl_to_targets, masked_row_mean
from fl_lightning.strategies.fedproto import prototype_loss

REAL_TWO_OF_THREE = torch.tensor([True, True, False])


def test_outside_a_padded_step_nothing_is_masked_and_every_reduction_is_the_plain_one():
    x, t = torch.randn(3, 2), torch.randn(3, 2)
    y = torch.tensor([1, 0, 2])
    assert real_rows() is None
    assert torch.equal(padded_loss(F.mse_loss, x, t), F.mse_loss(x, t))
    assert class_index(y) is y and real_labels(y) is y
    with padded_rows(REAL_TWO_OF_THREE):
        assert real_rows() is REAL_TWO_OF_THREE
        with padded_rows(None):  # a step with nothing padded inside a padded one
            assert real_rows() is None
    assert real_rows() is None


def test_padded_loss_averages_the_real_rows_alone():
    x = torch.tensor([[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]])  # the third row is padding
    zeros = torch.zeros(3, 2)
    with padded_rows(REAL_TWO_OF_THREE):
        assert padded_loss(F.l1_loss, x, zeros, reduction="sum") == 10.0  # 1 + 2 + 3 + 4
        assert padded_loss(F.l1_loss, x, zeros, reduction="batchmean") == 5.0  # 10 / 2 real rows
        assert padded_loss(F.l1_loss, x, zeros) == 2.5  # 10 / 4 real elements
        assert padded_loss(F.mse_loss, x, zeros) == 7.5  # (1 + 4 + 9 + 16) / 4
        with pytest.raises(ValueError, match="reduction must be mean, batchmean or sum"):
            padded_loss(F.l1_loss, x, zeros, reduction="max")


def test_padded_labels_are_ignored_by_the_cross_entropy_and_safe_to_index_with():
    y = torch.tensor([2, 1, PAD])
    with padded_rows(REAL_TWO_OF_THREE):
        assert class_index(y).tolist() == [2, 1, 0]
        assert real_labels(torch.tensor([4, 5, 6])).tolist() == [4, 5, PAD]
    logits = torch.tensor([[0.0, 0.0, 2.0], [1.0, 3.0, 0.0], [9.0, -9.0, 0.0]])
    # PAD is the cross-entropy's default ignore_index: the mean over the first two rows alone
    assert F.cross_entropy(logits, y) == pytest.approx(F.cross_entropy(logits[:2], y[:2]).item(), abs=0)


def test_masked_row_mean_counts_neither_padded_rows_nor_them_in_the_batch_size():
    per_row = torch.tensor([1.0, 2.0, 3.0, 4.0])
    covered = torch.tensor([True, False, True, True])
    with padded_rows(torch.tensor([True, True, True, False])):  # the fourth row is padding
        assert masked_row_mean(per_row, covered, "batch") == pytest.approx(4 / 3)  # (1 + 3) / 3 real rows
        assert masked_row_mean(per_row, covered, "available") == 2.0  # (1 + 3) / 2 covered real rows
    assert masked_row_mean(per_row, covered, "batch") == 2.0  # (1 + 3 + 4) / 4, unpadded


def test_the_distillation_loss_is_the_mean_over_the_real_rows():
    student = torch.zeros(3, 2)  # uniform predictions: KL(one-hot || uniform) = log 2 per row
    targets = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.5, 0.5]])  # the third row (KL 0) is padding
    with padded_rows(REAL_TWO_OF_THREE):
        assert kl_to_targets(student, targets) == pytest.approx(math.log(2))
    assert kl_to_targets(student, targets) == pytest.approx(2 * math.log(2) / 3)  # unpadded: over three rows


def test_the_prototype_loss_leaves_padded_rows_out():
    features = torch.tensor([[1.0, 0.0], [0.0, 1.0], [5.0, 5.0]])
    labels = torch.tensor([0, 1, PAD])
    prototypes, available = torch.zeros(2, 2), torch.tensor([True, False])
    with padded_rows(REAL_TWO_OF_THREE):
        # row 0 alone is covered: squared distance 1, over 2 real rows x 2 dimensions
        assert prototype_loss(features, labels, prototypes, available) == 0.25


def _norm_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(2, 3, 3), torch.nn.BatchNorm2d(3), torch.nn.ReLU(), torch.nn.Flatten())


@pytest.mark.parametrize("momentum", [0.1, None])  # None: torch's cumulative average, 1 / batches seen
def test_batch_norm_under_vmap_uses_each_clients_real_rows_alone(momentum):
    """Three clients with 5, 2 and 1 real images padded to 5: outputs, gradients and running statistics equal
    torch's batch norm on each client's real images alone."""
    net = _norm_net()
    net[1].momentum = momentum
    net[1].num_batches_tracked.fill_(3)
    real = [5, 2, 1]
    images = [torch.randn(n, 2, 5, 5) * (k + 1) + k for k, n in enumerate(real)]
    expected = []
    for x in images:
        alone = copy.deepcopy(net)
        out = alone(x)
        grads = torch.autograd.grad((out * torch.arange(out.shape[1])).sum(), list(alone.parameters()))
        expected.append((out.detach(), grads, alone[1].running_mean, alone[1].running_var))
    padded = torch.stack([torch.cat([x, x[:1].expand(5 - len(x), -1, -1, -1)]) for x in images])
    mask = torch.stack([torch.arange(5) < n for n in real])
    params = {k: torch.stack([v] * 3) for k, v in net.named_parameters()}
    buffers = {k: torch.stack([v] * 3).clone() for k, v in net.named_buffers()}

    def client(p, b, x, rows):
        with padded_rows(rows):
            out = torch.func.functional_call(net, (p, b), (x,))
        return (out * torch.arange(out.shape[1]) * rows[:, None]).sum(), out

    with masked_batch_norms(net):
        grads, (_, outs) = torch.func.vmap(torch.func.grad_and_value(client, has_aux=True))(
            params, buffers, padded, mask
        )
    for k, (out, grad, mean, var) in enumerate(expected):
        torch.testing.assert_close(outs[k, : real[k]], out)
        for name, g in zip(params, grad):
            # atol: the conv bias before batch norm has a zero gradient up to float noise; the others are ~10
            torch.testing.assert_close(grads[name][k], g, rtol=1e-5, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(buffers["1.running_mean"][k], mean)
        torch.testing.assert_close(buffers["1.running_var"][k], var)  # unbiased, over images x positions
        assert buffers["1.num_batches_tracked"][k] == 4
    assert "forward" not in net[1].__dict__  # torch's own forward again after the block


def test_batch_norm_in_evaluation_mode_or_without_a_mask_is_torchs_own():
    net = _norm_net()
    plain = copy.deepcopy(net)
    x = torch.randn(4, 2, 5, 5)
    with masked_batch_norms(net):
        assert torch.equal(net(x), plain(x))  # no padded step runs: torch's forward
        net.eval()
        with padded_rows(torch.tensor([True, False, False, False])):
            assert torch.equal(net(x), plain.eval()(x))  # running statistics: row by row
    assert torch.equal(net[1].running_mean, plain[1].running_mean)


def test_a_batch_norm_with_its_own_forward_cannot_be_masked():
    class Adapting(torch.nn.BatchNorm1d):
        def forward(self, x):
            return F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, True, 0.1, self.eps)

    assert unmaskable_norm({"a": _norm_net()}) is None
    why = unmaskable_norm({"a": _norm_net(), "b": torch.nn.Sequential(torch.nn.Linear(2, 2), Adapting(2))})
    assert why == "b's 1 is a Adapting with its own forward, whose statistics would count padded rows"
