"""Codistillation, the server-side distillation both codistillation methods share: mixup and random flips of
the distillation examples, when it augments, and the targets the teachers give each step."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from fl_lightning.data.transforms import random_flips
from fl_lightning.federation.errors import ConfigError
from fl_lightning.knowledge.codistill import mixup
from fl_lightning.strategies import Codistillation


def test_mixup_is_a_convex_combination_with_the_drawn_lambda():
    x = torch.randn(8, 1, 4, 4)
    mixed, lam, partner = mixup(x, torch.Generator().manual_seed(3), 2.0)
    assert 0.0 < lam < 1.0 and sorted(partner.tolist()) == list(range(8))
    assert torch.allclose(mixed, lam * x + (1 - lam) * x[partner])
    again, lam_again, _ = mixup(x, torch.Generator().manual_seed(3), 2.0)
    assert lam_again == lam and torch.equal(again, mixed)  # seeded by the generator passed in
    # "mixup with beta = 2": lam ~ Beta(2, 2), mean 1/2 and variance 2*2 / (4^2 * 5) = 0.05
    generator = torch.Generator().manual_seed(0)
    lams = torch.tensor([mixup(x, generator, 2.0)[1] for _ in range(4000)])
    assert lams.mean().item() == pytest.approx(0.5, abs=0.015)
    assert lams.var().item() == pytest.approx(0.05, abs=0.006)  # Beta(0.2, 0.2): 0.18; uniform: 0.083


def test_random_flips_flip_each_image_horizontally_and_vertically():
    x = torch.arange(64 * 9, dtype=torch.float32).reshape(64, 1, 3, 3)
    out = random_flips(x, torch.Generator().manual_seed(0))
    seen = set()
    for original, flipped in zip(x, out):
        cases = [original, original.flip(2), original.flip(1), original.flip(1).flip(2)]  # none, H, V, both
        matches = [i for i, case in enumerate(cases) if torch.equal(flipped, case)]
        assert len(matches) == 1
        seen.add(matches[0])
    assert seen == {0, 1, 2, 3}
    assert torch.equal(random_flips(x, torch.Generator().manual_seed(0)), out)
    assert torch.equal(random_flips(x, torch.Generator().manual_seed(0), horizontal=False, vertical=False), x)


def test_codistillation_augments_images_only_by_default():
    images, tokens = torch.zeros(4, 3, 8, 8), torch.zeros(4, 12, dtype=torch.long)
    assert Codistillation().augmentation(images, lambda b, g: b) is not None
    assert Codistillation().augmentation(tokens, lambda b, g: b) is None
    assert Codistillation(augment=False).augmentation(images, lambda b, g: b) is None
    with pytest.raises(ConfigError, match="image inputs"):
        Codistillation(augment=True).augmentation(tokens, lambda b, g: b)


def test_teachers_label_the_mixed_flipped_examples_of_each_step():
    """Targets are the teacher's predictions on each augmented batch (not mixed targets of raw examples)."""
    x = torch.randn(20, 1, 2, 2)
    torch.manual_seed(0)
    linear = {"small": {"w": torch.randn(4, 3)}, "large": {"w": torch.randn(4, 3)}}
    seen = {}

    def predict(role, weights, inputs):
        return inputs.flatten(1) @ weights["w"]

    def train(role, weights, batches, step_fn, optimizer):
        seen[role] = list(batches)
        return weights

    server = SimpleNamespace(predict=predict, train=train, data=SimpleNamespace(augment=lambda b, g: b))
    distillation = Codistillation(steps=3, batch_size=5, temperature=2.0, student_reg=0.0)
    distillation.run(server, linear, ("small", "large"), x, 0.0, torch.Generator().manual_seed(1))
    for student, teacher in (("small", "large"), ("large", "small")):
        assert len(seen[student]) == 3
        for inputs, targets in seen[student]:
            assert inputs.shape == (5, 1, 2, 2)
            raw = [any(torch.allclose(row, example) for example in x) for row in inputs]
            assert not all(raw)  # mixed (a row mixed with itself, or its duplicate, stays raw)
            assert torch.allclose(targets, F.softmax(predict(teacher, linear[teacher], inputs) / 2.0, 1))

    plain = Codistillation(steps=3, batch_size=5, augment=False)
    plain.run(server, linear, ("small", "large"), x, 0.0, torch.Generator().manual_seed(1))
    assert all(any(torch.equal(row, example) for example in x) for row in seen["small"][0][0])  # raw examples
