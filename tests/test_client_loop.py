"""The local training loop: batch streams that visit every example once per epoch, learning-rate schedules, the
loop equal to a hand-written SGD loop, and drop_last's full batches."""

import copy

import torch
import torch.nn.functional as F

from fl_lightning.client import LocalLoop, LocalTraining, batch_stream
from fl_lightning.distributed.fabric import fabric_class
from fl_lightning.federation.schedules import ConstantLR, CosineLR, LinearDecayLR, StepLR
from fl_lightning.models import ModelSpec


def test_batch_stream_epoch_visits_every_example_once():
    x = torch.arange(10).float().unsqueeze(1)
    y = torch.arange(10)
    idx = torch.tensor([1, 3, 4, 6, 8, 9, 0])
    batches = list(batch_stream(x, y, idx, 3, 3, torch.Generator().manual_seed(0)))
    assert [len(b[1]) for b in batches] == [3, 3, 1]
    assert sorted(torch.cat([b[1] for b in batches]).tolist()) == sorted(idx.tolist())
    steps = list(batch_stream(x, None, idx, 3, 5, torch.Generator().manual_seed(0)))
    assert len(steps) == 5 and all(len(b) == 1 for b in steps)  # unlabeled batches are (x,)


def test_schedules_by_hand():
    assert ConstantLR()(7, 10) == 1.0
    step = StepLR(milestones=[200, 300], gamma=0.1)  # paper 001: x0.1 after rounds 200 and 300
    assert [step(r, 400) for r in (200, 201, 300, 301)] == [1.0, 0.1, 0.1, pytest_approx(0.01)]
    assert StepLR(milestones=[0.5])(6, 10) == 0.1 and StepLR(milestones=[0.5])(5, 10) == 1.0
    assert LinearDecayLR(final=0.0)(1, 11) == 1.0 and abs(LinearDecayLR(final=0.0)(6, 11) - 0.5) < 1e-12
    assert CosineLR()(1, 5) == 1.0 and abs(CosineLR()(5, 5)) < 1e-12


def pytest_approx(v):
    import pytest

    return pytest.approx(v)


def test_local_loop_equals_a_hand_written_sgd_loop():
    torch.set_num_threads(1)
    x, y = torch.randn(40, 1, 8, 8), torch.randint(0, 10, (40,))
    idx = torch.arange(40)
    training = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), local_steps=6, batch_size=8)
    loop = LocalLoop(fabric_class()(accelerator="cpu", devices=1), training, rounds=1)
    loop.build_slots({"m": ModelSpec("digits_mlp", {"hidden": 16})}, ["m"], seed=0, num_classes=10)
    slot = loop.slots["m"]
    model = copy.deepcopy(slot.module.model)  # the same initial weights, trained by hand below

    stats = loop.fit(slot, batch_stream(x, y, idx, 8, 6, torch.Generator().manual_seed(5)), rnd=1)

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for xb, yb in batch_stream(x, y, idx, 8, 6, torch.Generator().manual_seed(5)):
        opt.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert stats["steps"] == 6
    assert abs(stats["loss"] - sum(losses) / 6) < 1e-6
    for (name, a), b in zip(slot.module.model.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_drop_last_ends_each_pass_at_its_last_full_batch():
    x, y = torch.arange(10).float().unsqueeze(1), torch.arange(10)
    idx = torch.tensor([1, 3, 4, 6, 8, 9, 0])
    batches = list(batch_stream(x, y, idx, 3, 4, torch.Generator().manual_seed(0), drop_last=True))
    assert [len(b[1]) for b in batches] == [3, 3, 3, 3]  # 7 examples: two full batches a pass, the 7th left out
    for one_pass in (batches[:2], batches[2:]):
        labels = torch.cat([b[1] for b in one_pass]).tolist()
        assert len(set(labels)) == 6 and set(labels) <= set(idx.tolist())
    # as many steps per epoch as full batches (DataLoader(drop_last=True)); a client smaller than a batch takes one
    loop = LocalLoop(
        fabric_class()(accelerator="cpu", devices=1),
        LocalTraining(batch_size=3, local_epochs=2, drop_last=True),
        rounds=1,
    )
    assert (loop.num_steps(7), loop.num_steps(2)) == (4, 2)
    assert (
        LocalLoop(fabric_class()(accelerator="cpu", devices=1), LocalTraining(batch_size=3), rounds=1).num_steps(7) == 3
    )
    small = list(batch_stream(x, y, idx[:2], 3, 2, torch.Generator().manual_seed(0), drop_last=True))
    assert [len(b[1]) for b in small] == [2, 2]
