"""Models and populations: ResNet-20's parameter counts, ModelSpec by name, tier assignments (contiguous,
interleaved, cyclic) and their sizes, and the sampler's fraction, tiers and seed."""

import numpy as np
import pytest

from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Population, Tier
from fl_lightning.federation.sampling import UniformSampler
from fl_lightning.models import ModelSpec, resnet20


def _params(model):
    return sum(p.numel() for p in model.parameters())


def test_resnet20_matches_paper_001_code_counts():
    # FIDELITY: HeteroKDFL's trainable counts are 272,762 at width 1 and 18,386 at width 0.25.
    assert _params(resnet20(width=1.0)) == 272_762
    assert _params(resnet20(width=0.25)) == 18_386


def test_model_spec_builds_by_name_and_rejects_bad_input():
    model = ModelSpec("digits_cnn", {"width": 0.5}).build(num_classes=10)
    assert model.feature_dim == 32 and model.num_classes == 10
    with pytest.raises(ConfigError, match="Did you mean digits_cnn"):
        ModelSpec("digits_cnnn").build()
    with pytest.raises(ConfigError, match="has no argument"):
        ModelSpec("digits_cnn", {"depth": 3}).build()


def test_tiers_contiguous_and_interleaved():
    pop = Population(num_clients=5, tiers=[Tier("strong", ["aux", "target"], fraction=0.4), Tier("weak", ["aux"])])
    clients = pop.build(seed=0)
    assert [c.tier for c in clients] == ["strong", "strong", "weak", "weak", "weak"]
    assert clients[0].roles == ("aux", "target") and pop.roles() == ["aux", "target"]
    pop.assignment = "interleaved"
    assert [c.tier for c in pop.build(0)] == ["strong", "weak", "strong", "weak", "weak"]


def test_tier_sizes_must_add_up():
    with pytest.raises(ConfigError, match="do not add up"):
        Population(num_clients=4, tiers=[Tier("a", ["m"], count=3), Tier("b", ["m"], count=3)]).build(0)


def test_sampler_respects_fraction_tiers_and_seed():
    clients = Population(10, [Tier("s", ["m"], count=3), Tier("w", ["m"])]).build(0)
    sampler = UniformSampler(fraction=0.5)
    a = sampler.sample(1, clients, np.random.default_rng(1))
    assert len(a) == 5 and a == sampler.sample(1, clients, np.random.default_rng(1))
    strong = UniformSampler(num_per_round=3, tiers=["s"]).sample(1, clients, np.random.default_rng(0))
    assert [c.tier for c in strong] == ["s", "s", "s"]
    with pytest.raises(ConfigError, match="cannot sample 4"):
        UniformSampler(num_per_round=4, tiers=["s"]).sample(1, clients, np.random.default_rng(0))


def test_cyclic_assignment_gives_client_k_tier_k_mod_t_for_any_population():
    tiers = [Tier(name, [name]) for name in ("cnn", "googlenet", "resnet18")]
    clients = Population(num_clients=8, tiers=tiers, assignment="cyclic").build(0)
    assert [c.tier for c in clients] == ["cnn", "googlenet", "resnet18"] * 2 + ["cnn", "googlenet"]
    assert Population(num_clients=8, tiers=tiers, assignment="cyclic").tier_counts() == [3, 3, 2]
    with pytest.raises(ConfigError, match="remove count and fraction from tier\\(s\\) cnn"):
        Population(2, [Tier("cnn", ["cnn"], count=1), Tier("b", ["b"])], assignment="cyclic").build(0)
