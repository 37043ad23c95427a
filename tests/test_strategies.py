"""The methods' hooks on hand-checkable inputs, their payload sizes and exact equivalences."""

import csv

import torch
from conftest import ROOT, method_env, read_summary, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.federation.population import Tier
from fl_lightning.models import ModelSpec

CONSTANT = {"m": ModelSpec("conftest.constant_logits_model")}
FROZEN = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), local_epochs=1, batch_size=16)


def _rows(out):
    return list(csv.DictReader((out / "metrics.csv").open()))


def _fit(tmp_path, recipe, name, *extra):
    out = tmp_path / name
    assert (
        run_cli(
            "fit",
            "--config",
            str(ROOT / "recipes" / recipe),
            "--output_dir",
            str(out),
            "--runtime.progress",
            "false",
            *extra,
        )
        == 0
    )
    return out


def test_merged_codist_with_alpha_one_is_exactly_fedadam(tmp_path):
    merged = _fit(
        tmp_path,
        "digits_merged_codist.yaml",
        "merged",
        "--rounds",
        "3",
        "--eval_every",
        "1",
        "--strategy.init_args.alpha",
        "1.0",
    )
    fedadam = _fit(tmp_path, "digits_fedadam.yaml", "fedadam", "--rounds", "3", "--eval_every", "1")
    assert read_summary(merged)["final"] == read_summary(fedadam)["final"]
    assert read_summary(merged)["best"] == read_summary(fedadam)["best"]


def test_fedavg_per_role_cohorts_are_drawn_from_each_pool():
    from fl_lightning.strategies import FedAvg

    models = {"small": ModelSpec("digits_mlp", {"hidden": 4}), "large": ModelSpec("digits_mlp", {"hidden": 8})}
    strategy = FedAvg(clients_per_round={"small": 3, "large": 2})
    method_env(strategy, models, [Tier("high", ["small", "large"], count=3), Tier("low", ["small"])], num_clients=8)
    tasks = strategy.configure_round(1, [])  # the sampler's clients are not used for roles with a cohort size
    small = [t.client.id for t in tasks if "small" in t.downlink]
    large = [t.client.id for t in tasks if "large" in t.downlink]
    assert len(small) == 3 and len(large) == 2 and set(large) <= {0, 1, 2}
    assert [t.client.id for t in strategy.configure_round(1, [])] == [t.client.id for t in tasks]  # seeded by round
