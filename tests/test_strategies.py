"""The methods' hooks on hand-checkable inputs, their payload sizes and exact equivalences."""

import csv

import torch
from conftest import ROOT, method_env, read_summary, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import Felo

CONSTANT = {"m": ModelSpec("conftest.constant_logits_model")}
FROZEN = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.0), local_epochs=1, batch_size=16)


def test_felo_averages_weights_only_within_an_architecture():
    models = {"a": ModelSpec("digits_mlp", {"hidden": 8}), "b": ModelSpec("digits_mlp", {"hidden": 8, "depth": 2})}
    strategy = Felo(average_weights=True)
    server = method_env(strategy, models, [Tier("ta", ["a"], count=2), Tier("tb", ["b"])])
    knowledge = ClassStatistics(
        "class_knowledge",
        {"features": torch.zeros(10, 8), "logits": torch.zeros(10, 10)},
        torch.full((10,), -1, dtype=torch.int32),
    )

    def update(client, role, value, n):
        state = {k: torch.full_like(v, value) for k, v in strategy.state.global_weights[role].items()}
        return ClientUpdate(client, n, {"class_knowledge": knowledge, "weights": ModelWeights(role, state)})

    c = server.clients
    strategy.aggregate(1, iter([update(c[0], "a", 1.0, 1), update(c[1], "a", 4.0, 3), update(c[2], "b", 10.0, 5)]))
    assert all(
        torch.allclose(v, torch.full_like(v, 3.25)) for v in strategy.state.global_weights["a"].values()
    )  # (1 + 12) / 4
    assert all(torch.allclose(v, torch.full_like(v, 10.0)) for v in strategy.state.global_weights["b"].values())


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


def test_ledger_uplink_per_round_matches_the_papers_sizes(tmp_path):
    felo_out = _fit(tmp_path, "digits_felo.yaml", "felo", "--rounds", "1")
    knowledge = 10 * (64 + 10 + 1) * 4  # class features, class logits and labels
    summary = read_summary(felo_out)
    assert summary["comm"]["by_payload"]["uplink"]["class_knowledge"] == 6 * knowledge


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
