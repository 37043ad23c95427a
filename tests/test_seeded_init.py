"""A client's seeded initial weights from one cached model per role equal a fresh build's, bit for bit."""

import pytest
import torch
from torch import nn

from fl_lightning.client.seeded_init import SeededInitializer
from fl_lightning.models import FeatureClassifier, ModelSpec

SEEDS = [0, 7, 123_456_789, 2**62 + 11]


def built(spec: ModelSpec, seed: int) -> tuple[dict, torch.Tensor]:
    """What the code before the cache did: seed, build, read the weights (and where the generator is)."""
    torch.manual_seed(seed)
    weights = spec.build(num_classes=10).state_dict()
    return weights, torch.get_rng_state()


def same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


@pytest.mark.parametrize(
    "spec",
    [
        ModelSpec("digits_mlp", {"hidden": 64}),
        ModelSpec("digits_cnn", {"width": 0.5}),
        ModelSpec("digits_cnn", {"batch_norm": True}),
        ModelSpec("fedhe_cnn3"),
        ModelSpec("imdb_bilstm"),
    ],
    ids=["mlp", "cnn", "cnn-batchnorm", "fedhe_cnn3", "bilstm"],
)
def test_reinitialised_in_place_equals_a_build(spec):
    init = SeededInitializer(lambda: spec.build(num_classes=10))
    for seed in SEEDS:
        got = init.weights(seed)
        after = torch.get_rng_state()
        expected, expected_after = built(spec, seed)
        assert same_bits(got, expected), seed
        assert torch.equal(after, expected_after), seed  # dropout draws after it continue the same stream
    assert init.template is not None  # the cached instance served every call after the first


def test_a_builder_that_reinitialises_after_construction_keeps_building():
    # resnet20 zeroes each block's last batch-norm weight after construction: a reset would give ones
    spec = ModelSpec("resnet20")
    init = SeededInitializer(lambda: spec.build(num_classes=10))
    for seed in SEEDS[:2]:
        got = init.weights(seed)
        after = torch.get_rng_state()
        expected, expected_after = built(spec, seed)
        assert same_bits(got, expected) and torch.equal(after, expected_after)
    assert init.template is None
    assert torch.equal(got["features.3.bn2.weight"], torch.zeros(16))  # the builder's zeros, not a reset's ones


def test_a_builder_drawing_its_own_tensors_keeps_building():
    class Prototype(FeatureClassifier):
        def __init__(self):
            super().__init__(nn.Flatten(), nn.Linear(64, 10), 64, 10)
            self.anchor = nn.Parameter(torch.randn(10, 64))  # drawn at construction, no reset_parameters

    def build():
        return Prototype()

    init = SeededInitializer(build)
    first, second = init.weights(3), init.weights(4)
    torch.manual_seed(4)
    assert init.template is None
    assert same_bits(second, build().state_dict())
    assert not torch.equal(first["anchor"], second["anchor"])


def test_each_call_returns_its_own_tensors():
    spec = ModelSpec("digits_mlp")
    init = SeededInitializer(lambda: spec.build(num_classes=10))
    a = init.weights(1)
    b = init.weights(2)
    a_again = init.weights(1)
    assert not torch.equal(a["head.weight"], b["head.weight"])
    assert same_bits(a, a_again)
    a["head.weight"].add_(1.0)  # a client training its weights in place leaves every other client's alone
    assert same_bits(init.weights(1), a_again) and not torch.equal(a["head.weight"], a_again["head.weight"])
    assert a["head.weight"].data_ptr() != a_again["head.weight"].data_ptr()
