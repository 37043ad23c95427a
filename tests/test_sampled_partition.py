"""Populations larger than the data: clients draw their examples with replacement."""

import numpy as np
import pytest
from conftest import ROOT, read_summary, run_cli

from fl_lightning.data import SampledPartitioner
from fl_lightning.federation.errors import ConfigError


def test_every_client_gets_exactly_its_size_even_when_clients_outnumber_examples():
    labels = np.array([0, 0, 1, 1, 2])
    parts = SampledPartitioner(examples_per_client=3)(labels, 40, np.random.default_rng(0))
    assert len(parts) == 40 and all(len(p) == 3 for p in parts)
    assert all(p.min() >= 0 and p.max() < 5 for p in parts)
    assert len({i for p in parts for i in p.tolist()}) == 5  # 120 draws of 5 examples: all are used


def test_dirichlet_proportions_skew_each_client_towards_few_classes():
    labels = np.repeat(np.arange(10), 100)
    rng = np.random.default_rng(0)
    skewed = SampledPartitioner(examples_per_client=50, alpha=0.05)(labels, 200, rng)
    flat = SampledPartitioner(examples_per_client=50, alpha=100.0)(labels, 200, rng)

    def classes(parts):
        return np.mean([len(np.unique(labels[p])) for p in parts])

    assert classes(skewed) < 3 < 9 < classes(flat)
    assert all(len(p) == 50 and np.all(np.diff(p) >= 0) for p in skewed)


def test_same_generator_seed_gives_the_same_partition():
    labels = np.repeat(np.arange(3), 4)
    one = SampledPartitioner(5, alpha=0.5)(labels, 7, np.random.default_rng(3))
    two = SampledPartitioner(5, alpha=0.5)(labels, 7, np.random.default_rng(3))
    assert all(np.array_equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("kwargs", [{"examples_per_client": 0}, {"alpha": 0.0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ConfigError):
        SampledPartitioner(**kwargs)


def test_five_thousand_clients_train_on_digits(tmp_path):
    """Learning measured against the same run with learning rate 0 (its untrained model scores 0.1365)."""
    partitioner = "{class_path: fl_lightning.data.SampledPartitioner, init_args: {examples_per_client: 20, alpha: 0.5}}"
    argv = ["--config", str(ROOT / "recipes" / "quickstart.yaml"), "--rounds", "10", "--eval_every", "10"]
    argv += ["--population.num_clients", "5000", "--data.init_args.partitioner", partitioner]
    argv += ["--sampler.init_args.fraction", "0.002", "--runtime.progress", "false"]
    assert run_cli("fit", *argv, "--output_dir", str(tmp_path / "run")) == 0
    assert run_cli("fit", *argv, "--output_dir", str(tmp_path / "lr0"), "--training.optimizer.init_args.lr", "0") == 0
    summary, untrained = read_summary(tmp_path / "run"), read_summary(tmp_path / "lr0")
    assert summary["complete"] and summary["ranks"][0]["trained_tasks"] == 10 * 10  # 10 of 5000 clients a round
    accuracy, baseline = summary["final"]["global/test_acc"], untrained["final"]["global/test_acc"]
    assert accuracy > baseline + 0.1, (accuracy, baseline)
