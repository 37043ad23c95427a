"""The command line: errors are one readable line with exit status 2; overrides and recipes parse."""

import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, write_recipe

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def flrun(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fl_lightning", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_parses(recipe):
    from fl_lightning.cli import fit_parser

    parser = fit_parser()
    cfg = parser.parse_args(["--config", str(recipe)])
    init = parser.instantiate(cfg)
    assert init.strategy is not None and init.data is not None and init.models


def test_print_config_shows_overrides(tmp_path):
    result = flrun(
        "fit",
        "--config",
        str(ROOT / "recipes/quickstart.yaml"),
        "--seed",
        "7",
        "--rounds",
        "3",
        "--training.batch_size",
        "8",
        "--print_config",
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert config["seed"] == 7 and config["rounds"] == 3 and config["training"]["batch_size"] == 8
    assert config["strategy"]["class_path"] == "fl_lightning.strategies.FedAvg"


def test_help_documents_knobs():
    result = flrun("fit", "--help")
    assert result.returncode == 0
    for knob in (
        "--seed",
        "--rounds",
        "--output_dir",
        "--resume",
        "--training.local_steps",
        "--population.num_clients",
        "--logger",
        "--runtime.num_threads",
    ):
        assert knob in result.stdout, knob


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
        (["--bogus", "1"], "unknown option --bogus"),
        (
            ["--strategy", "fl_lightning.strategies.NoSuchStrategy"],
            "class_path 'fl_lightning.strategies.NoSuchStrategy'",
        ),
        (["--rounds", "many"], "bad value 'many' for rounds: expected int"),
        (["--data.init_args.partitioner.init_args.alpha", "0.0001"], "raise alpha"),
        (["--models", "{global: {builder: digits_cnnn}}"], "unknown model builder 'digits_cnnn'"),
        (["--sampler.init_args.fraction", "2"], "sampler fraction must be in (0, 1]"),
    ],
)
def test_errors_are_one_line_without_traceback(tmp_path, args, expected):
    base = [] if args[0] == "--config" else ["--config", str(write_recipe(tmp_path / "r.yaml"))]
    result = flrun("fit", *base, *args, "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and "Warning" not in line and not line.startswith(" ")
    ]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0] and "Traceback" not in result.stderr


def test_unknown_key_in_recipe(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", roundz=3)
    result = flrun("fit", "--config", str(recipe))
    assert result.returncode == 2 and "unknown key 'roundz'" in result.stderr


def test_models_lists_registered_builders():
    result = flrun("models", "--json")
    assert result.returncode == 0
    names = {row["name"]: row for row in yaml.safe_load(result.stdout)}
    assert names["resnet20"]["parameters"] == 272_762
