"""Personalized evaluation that scales: skipping clients that never trained, a seeded sample per round."""

from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, fit_recipe, metrics_rows, read_summary, run_cli

FEDHE = ["--config", str(ROOT / "recipes" / "digits_fedhe.yaml"), "--runtime.progress", "false", "--seed", "0"]


def _fit(run: Path, *argv: str) -> dict:
    """digits_fedhe at seed 0 with ``argv``: its summary."""
    return read_summary(fit_recipe(run, "digits_fedhe", "--seed", "0", *argv))


def test_skipping_untrained_clients_evaluates_the_trained_ones_and_says_how_many(tmp_path):
    argv = ["--rounds", "2", "--eval_every", "1", "--population.num_clients", "30"]
    argv += ["--sampler.init_args.num_per_round", "3", "--evaluation.untrained", "skip"]
    summary = _fit(tmp_path / "run", *argv)
    rows = metrics_rows(tmp_path / "run")
    assert float(rows[0]["personal/clients_evaluated"]) == 3.0  # round 1: the 3 clients that trained
    trained = {int(k) for k in summary["per_client_acc"]}
    assert 3 < len(trained) <= 6 and float(rows[1]["personal/clients_evaluated"]) == len(trained)
    accs = list(summary["per_client_acc"].values())
    assert summary["final"]["personal/test_acc"] == pytest.approx(float(np.mean(accs)), abs=1e-12)
    assert summary["final"]["personal/test_acc_min"] == min(accs)


def test_a_seeded_sample_per_round_and_every_client_after_the_last(tmp_path):
    argv = ["--rounds", "3", "--eval_every", "1"]
    every = _fit(tmp_path / "every", *argv)
    sampled = _fit(tmp_path / "sampled", *argv, "--evaluation.sample", "4")
    again = _fit(tmp_path / "again", *argv, "--evaluation.sample", "4")
    rows = metrics_rows(tmp_path / "sampled")
    assert [r["personal/clients_evaluated"] for r in rows] == ["4.0", "4.0", ""]  # the last row covers all 12
    assert sampled["final"] == every["final"] and len(sampled["per_client_acc"]) == 12
    assert rows == metrics_rows(tmp_path / "again")  # the same seed draws the same samples
    full_rows = metrics_rows(tmp_path / "every")
    assert rows[0]["personal/test_acc"] != full_rows[0]["personal/test_acc"]  # 4 clients, not 12
    assert again["final"] == every["final"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--evaluation.sample", "0"), "evaluation.sample must be at least 1 (or null: every client), got 0"),
        (("--evaluation.untrained", "ignore"), "bad value 'ignore' for evaluation.untrained: use one of evaluate"),
        (("--runtime.client_state_memory_mb", "-1"), "runtime.client_state_memory_mb must be 0 or more"),
    ],
)
def test_bad_evaluation_and_memory_settings_are_one_sentence(tmp_path, capsys, argv, message):
    assert run_cli("fit", *FEDHE, "--output_dir", str(tmp_path / "run"), *argv) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "run").exists()
