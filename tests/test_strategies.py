"""The methods' hooks on hand-checkable inputs, their payload sizes and exact equivalences."""

import csv

import torch
from conftest import ROOT, read_summary, run_cli

from fl_lightning.client import LocalTraining
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
