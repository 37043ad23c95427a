"""fl_lightning.fit from Python: the same run, checks and errors as flrun fit, the summary returned, progress
that works where the output is not a terminal (a notebook), and the how-to page's example as written."""

import json
import re
import subprocess
import sys

import numpy as np
import pytest
import yaml
from conftest import ROOT, read_summary, run_cli, write_recipe

import fl_lightning
from fl_lightning.federation.errors import ConfigError
from fl_lightning.run.api import python_words
from fl_lightning.tracking import RunLogger

HOWTO = ROOT / "docs" / "howto" / "python_api.md"


def python_blocks(page):
    return re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.DOTALL)


class Rounds(RunLogger):
    def __init__(self):
        self.seen = []

    def log_metrics(self, metrics, step):
        self.seen.append((step, dict(metrics)))


def test_fit_returns_the_summary_it_wrote_and_applies_nested_options(tmp_path):
    recipe = write_recipe(tmp_path / "tiny.yaml", rounds=3)
    watch = Rounds()
    summary = fl_lightning.fit(
        config=str(recipe),
        rounds=np.int64(2),  # e.g. from a loop over np.arange in a notebook
        eval_every=1,
        output_dir=str(tmp_path / "run"),
        training={"batch_size": 8},  # merged: the recipe's optimizer and local_steps stay
        logger=["csv", watch],
        **{"training.optimizer.init_args.lr": 0.05},
    )
    assert summary == read_summary(tmp_path / "run")
    assert summary["rounds"] == 2 and summary["output_dir"] == str(tmp_path / "run")
    config = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert config["training"]["batch_size"] == 8 and config["training"]["local_steps"] == 5
    assert config["training"]["optimizer"]["init_args"]["lr"] == 0.05
    assert config["training"]["optimizer"]["init_args"]["momentum"] == 0.9  # the recipe's, kept
    assert [step for step, _ in watch.seen] == [1, 2]
    assert watch.seen[-1][1]["global/test_acc"] == summary["final"]["global/test_acc"]


def test_the_same_run_from_python_and_from_the_command_line_gives_the_same_numbers(tmp_path):
    recipe = write_recipe(tmp_path / "tiny.yaml", rounds=2)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "cli"), "--seed", "3") == 0
    summary = fl_lightning.fit(config=recipe, output_dir=tmp_path / "py", seed=3)
    assert summary["final"] == read_summary(tmp_path / "cli")["final"]
    assert summary["name"] == "tiny"  # the recipe's file name, as on the command line


@pytest.mark.parametrize(
    "options, argv",
    [
        ({"round": 5}, ["--round", "5"]),
        ({"rounds": 0}, ["--rounds", "0"]),
        ({"training.batch_sise": 8}, ["--training.batch_sise", "8"]),
        ({"training": {"batch_size": "many"}}, ["--training", '{"batch_size": "many"}']),
        (
            {"strategy": {"class_path": "fl_lightning.strategies.FedAvgg"}},
            ["--strategy", '{"class_path": "fl_lightning.strategies.FedAvgg"}'],
        ),
    ],
)
def test_a_mistake_raises_the_command_lines_sentence_and_writes_nothing(tmp_path, capsys, options, argv):
    recipe = write_recipe(tmp_path / "tiny.yaml")
    out = tmp_path / "run"
    with pytest.raises(ConfigError) as raised:
        fl_lightning.fit(config=str(recipe), output_dir=str(out), **options)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(out), *argv) == 2
    printed = capsys.readouterr().err.strip()
    assert printed.startswith("flrun fit: error: ")
    assert str(raised.value) == python_words(printed[len("flrun fit: error: ") :])
    assert "\n" not in str(raised.value) and not out.exists()
    assert "--" not in str(raised.value).replace("`flrun fit --help`", "")  # Python's words, not the options'


@pytest.mark.parametrize(
    "options, said",
    [
        ({"rounds": 0}, "rounds must be at least 1, got 0; e.g. rounds=1."),
        ({"round": 5}, "unknown option round (did you mean rounds?); see `flrun fit --help` for the options."),
        (
            {"training.batch_sise": 8},
            "unknown option 'training.batch_sise' (did you mean 'training.batch_size'?); see `flrun fit --help` for "
            "the options.",
        ),
    ],
)
def test_a_mistake_from_python_names_the_keyword_arguments(tmp_path, options, said):
    with pytest.raises(ConfigError) as raised:
        fl_lightning.fit(config=str(write_recipe(tmp_path / "tiny.yaml")), output_dir=str(tmp_path / "run"), **options)
    assert str(raised.value) == said


def test_python_words_translates_options_with_and_without_values():
    assert python_words("pass --resume auto to continue it or choose another --output_dir.") == (
        'pass resume="auto" to continue it or choose another output_dir.'
    )
    assert python_words("continue with --resume auto and --monitor set to one of them") == (
        'continue with resume="auto" and monitor set to one of them'
    )
    assert python_words("with --resume RUN/checkpoints/previous.ckpt.") == (
        'with resume="RUN/checkpoints/previous.ckpt".'
    )
    assert python_words("lower --training.optimizer.init_args.lr 0.01, or set --runtime.progress false") == (
        'lower **{"training.optimizer.init_args.lr": 0.01}, or set **{"runtime.progress": False}'
    )
    shell = "e.g. `for seed in 0 1; do flrun fit --config r.yaml --seed $seed; done`"
    assert python_words(f"--seed takes one seed, {shell}") == f"seed takes one seed, {shell}"  # a command stays


def test_bad_python_values_are_one_sentence(tmp_path):
    recipe = str(write_recipe(tmp_path / "tiny.yaml"))
    with pytest.raises(ConfigError, match=r"fit\(strategy=\.\.\.\) got a object; give the value a recipe would hold"):
        fl_lightning.fit(config=recipe, strategy=object())
    with pytest.raises(ConfigError, match=r"`base:` names files, so give the recipe file instead"):
        fl_lightning.fit(config={"base": "quickstart.yaml", "rounds": 2})
    with pytest.raises(ConfigError, match=r"takes a recipe file, a list of them or a mapping"):
        fl_lightning.fit(config=3)
    with pytest.raises(ConfigError, match=r"config file 'missing.yaml' does not exist"):
        fl_lightning.fit(config="missing.yaml")
    assert not (tmp_path / "runs").exists()


def test_a_recipe_as_a_mapping_runs_like_its_file(tmp_path):
    recipe = yaml.safe_load(write_recipe(tmp_path / "tiny.yaml", rounds=2).read_text())
    from_file = fl_lightning.fit(config=str(tmp_path / "tiny.yaml"), output_dir=str(tmp_path / "file"))
    from_mapping = fl_lightning.fit(config=recipe, output_dir=str(tmp_path / "mapping"))
    assert from_mapping["final"] == from_file["final"]


def test_a_run_already_in_the_directory_is_kept(tmp_path):
    recipe = str(write_recipe(tmp_path / "tiny.yaml", rounds=1))
    fl_lightning.fit(config=recipe, output_dir=str(tmp_path / "run"))
    before = (tmp_path / "run" / "summary.json").read_bytes()
    with pytest.raises(ConfigError, match='already holds a run; pass resume="auto" to continue it or choose another '
                       "output_dir"):  # fmt: skip
        fl_lightning.fit(config=recipe, output_dir=str(tmp_path / "run"), rounds=2)
    assert (tmp_path / "run" / "summary.json").read_bytes() == before
    assert fl_lightning.fit(config=recipe, output_dir=str(tmp_path / "run"), rounds=2, resume="auto")["rounds"] == 2


NOTEBOOK = """
import json, sys
import rich.console
rich.console._is_jupyter = lambda: True  # what rich sees in Jupyter and Colab
import fl_lightning
summary = fl_lightning.fit(config=sys.argv[1], output_dir=sys.argv[2], rounds=3, eval_every=1,
                           runtime={"progress": True})
print(json.dumps(summary["final"]))
"""


def test_progress_in_a_notebook_is_a_plain_line_per_round_not_a_live_bar(tmp_path):
    recipe = write_recipe(tmp_path / "tiny.yaml")
    result = subprocess.run(
        [sys.executable, "-c", NOTEBOOK, str(recipe), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
        check=False,
        env={**_environment(), "FORCE_COLOR": "1"},  # Jupyter sets it; a terminal check alone would draw a bar
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("round ")]
    assert [line.split()[1] for line in lines] == ["1/3", "2/3", "3/3"]
    assert "global/test_acc" in lines[-1] and "eta" in lines[-1]
    assert "\x1b[" not in result.stderr and "\r" not in result.stderr  # no cursor movement, no redrawn bar
    assert json.loads(result.stdout.strip().splitlines()[-1]) == read_summary(tmp_path / "run")["final"]


def test_importing_the_package_imports_no_torch():
    script = "import sys, fl_lightning; print(callable(fl_lightning.fit), 'torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.split() == ["True", "False"]


@pytest.mark.slow  # half a minute of runs; the docs pages test runs this page too, in the slow suite
def test_the_howto_example_runs_as_written(tmp_path):
    """The page's code, run as a notebook would run it, from a folder holding the recipes (its runs go there)."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    (code,) = python_blocks(HOWTO)
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600, check=False,
        env=_environment(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    first, sizes, error = result.stdout.strip().splitlines()[-3:]
    summary = read_summary(tmp_path / "runs/notebook/seed0")
    assert first == f"{summary['final']['global/test_acc']} runs/notebook/seed0"
    measured = {b: read_summary(tmp_path / f"runs/notebook/batch{b}")["final"]["global/test_acc"] for b in (16, 32)}
    assert sizes == str(measured)
    config = yaml.safe_load((tmp_path / "runs/notebook/batch32/config.yaml").read_text())
    assert (config["rounds"], config["training"]["batch_size"], config["runtime"]["num_threads"]) == (5, 32, 1)
    assert error.startswith("unknown option round (did you mean rounds?)")
    assert not (tmp_path / "runs/quickstart").exists()  # the mistake ran nothing


def _environment():
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
