"""flrun sweep as a user drives it: fit arguments after --, the base recipe found from the sweep file, "did you
mean" for its keys and parameter paths, a swapped recipe / sweep file named as such, a first line before the
heavy imports, tuning on a validation split with the best trial's test score reported, and importances
flagged when too few trials are behind them."""

import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, metrics_rows, read_summary, run_cli, write_recipe
from test_sweep import LR, write_sweep

from fl_lightning.federation.errors import ConfigError
from fl_lightning.sweep.spec import closest_key, load_sweep

VAL_SPLIT = {"data.init_args.local_split": [0.8, 0.2, 0.0]}


def trials(root):
    return list(csv.DictReader((root / "trials.csv").open()))


def test_fit_arguments_after_a_double_dash_apply_to_every_trial(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=2, parameters=LR)  # the overrides say 4 rounds
    assert run_cli("sweep", "--config", str(sweep), "--", "--rounds", "2", "--eval_every", "1") == 0
    out = capsys.readouterr().out
    root = tmp_path / "sweep"
    for row in trials(root):
        summary = read_summary(tmp_path / row["output_dir"])
        assert summary["rounds"] == 2 and summary["best_round"] in (1, 2)
    result = json.loads((root / "sweep.json").read_text())
    assert result["fit_args"] == ["--rounds", "2", "--eval_every", "1"]
    assert "-- --rounds 2 --eval_every 1" in out.splitlines()[0]
    # the best recipe's command reproduces the trial: the overrides, then the arguments after --
    header = (root / "best_recipe.yaml").read_text()
    assert "--monitor global/test_acc --eval_every 2 --rounds 4 --rounds 2 --eval_every 1\n" in header
    # they are part of the study's definition: a re-run without them is another study
    assert run_cli("sweep", "--config", str(sweep)) == 2
    assert "recipe key eval_every 1 -> 2" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("fit_args", "message"),
    [
        (["--output_dir", "x"], "the arguments after -- may not set --output_dir: the sweep sets each trial's"),
        (["--training.optimizer.init_args.lr=0.1"], "set --training.optimizer.init_args.lr, which the sweep searches"),
        (["--roundz", "2"], "unknown option --roundz (did you mean --rounds?)"),
    ],
)
def test_fit_arguments_the_sweep_sets_or_searches_or_misspelled_are_refused(tmp_path, capsys, fit_args, message):
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=1, parameters=LR)
    assert run_cli("sweep", "--config", str(sweep), "--", *fit_args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "sweep").exists()


def test_the_base_recipe_is_found_from_the_sweep_file_not_the_working_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "project" / "sweeps").mkdir(parents=True)
    (tmp_path / "project" / "recipes").mkdir()
    base = write_recipe(tmp_path / "project" / "recipes" / "base.yaml", rounds=3)
    sweep = tmp_path / "project" / "sweeps" / "s.yaml"
    sweep.write_text(yaml.safe_dump({"base": "../recipes/base.yaml", "metric": "global/test_acc", "parameters": LR}))
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / ".." / "recipes").mkdir(parents=True, exist_ok=True)
    write_recipe(elsewhere / ".." / "recipes" / "base.yaml", rounds=99)  # the same path from the working directory
    monkeypatch.chdir(elsewhere)
    assert load_sweep(sweep).base == str(base)
    # a base written relative to the working directory (where sweep files used to point) says how to write it
    sweep.write_text(yaml.safe_dump({"base": "recipes/base.yaml", "metric": "global/test_acc", "parameters": LR}))
    monkeypatch.chdir(tmp_path / "project")
    assert run_cli("sweep", "--config", "sweeps/s.yaml") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "flrun sweep: error: the sweep's base recipe sweeps/recipes/base.yaml (base: recipes/base.yaml in "
        "sweeps/s.yaml) does not exist; `base:` is relative to the sweep file's folder, as a recipe's is: use "
        "base: ../recipes/base.yaml."
    )


def test_the_shipped_sweeps_load_from_any_directory_and_tune_on_a_validation_split(tmp_path, monkeypatch):
    from fl_lightning.sweep.spec import check_against_recipe

    monkeypatch.chdir(tmp_path)
    for path in sorted((ROOT / "sweeps").glob("*.yaml")):
        spec = load_sweep(path, check_recipe=False)
        assert spec.base == str(ROOT / "recipes" / Path(spec.base).name), path.name
        assert "/val_" in spec.metric and check_against_recipe(spec) == [], path.name  # no test-metric warning


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"n_trial": 3}, "unknown key(s) ['n_trial'] in {sweep} (did you mean 'n_trials'?)"),
        (
            {"parameters": {"training.learning_rate": {"type": "float", "low": 0.01, "high": 0.1}}},
            (
                "sweep parameter 'training.learning_rate' is not an option of the base recipe {base} (did you mean "
                "'training.optimizer.init_args.lr'?"
            ),
        ),
        (
            {"parameters": {"training.optimizer.init_args.lrr": {"type": "float", "low": 0.01, "high": 0.1}}},
            "(did you mean 'training.optimizer.init_args.lr'?",
        ),
        (
            {"parameters": {"training.optimizer.init_args.lr": {"type": "loguniform", "low": 0.01, "high": 0.1}}},
            "got 'loguniform'; write {type: float, low: ..., high: ..., log: true}.",
        ),
        (
            {"metric": "global/val_acc"},
            (
                "the sweep's metric 'global/val_acc' is measured on the clients' local val splits, which the runs of "
                "{base} do not have; give them a val share in the sweep's overrides, e.g. "
                "data.init_args.local_split: [0.8, 0.2, 0.0]."
            ),
        ),
    ],
)
def test_sweep_file_mistakes_name_what_was_meant(tmp_path, capsys, change, message):
    sweep = write_sweep(tmp_path / "s.yaml", **change)
    assert run_cli("sweep", "--config", str(sweep)) == 2
    err = capsys.readouterr().err
    message = message.replace("{sweep}", str(sweep)).replace("{base}", str(tmp_path / "base.yaml"))
    assert message in err and len(err.strip().splitlines()) == 1


def test_parameter_paths_are_matched_by_their_last_name_then_by_spelling():
    keys = ["training.optimizer.init_args.lr", "training.optimizer.init_args.momentum", "training.batch_size"]
    assert closest_key("lr", keys) == "training.optimizer.init_args.lr"
    assert closest_key("training.learning_rate", keys) == "training.optimizer.init_args.lr"
    assert closest_key("training.batchsize", keys) == "training.batch_size"
    assert closest_key("training.optimizer.init_args.momentun", keys) == "training.optimizer.init_args.momentum"
    assert closest_key("strategy.init_args.foo", keys) is None


def test_a_recipe_given_to_sweep_and_a_sweep_file_given_to_fit_are_named_as_such(capsys):
    assert run_cli("sweep", "--config", str(ROOT / "recipes/quickstart.yaml")) == 2
    err = capsys.readouterr().err
    assert "recipes/quickstart.yaml is a recipe, not a sweep file; run it with `flrun fit --config" in err
    assert run_cli("fit", "--config", str(ROOT / "sweeps/digits_quickstart.yaml")) == 2
    err = capsys.readouterr().err
    assert "sweeps/digits_quickstart.yaml is a sweep file, not a recipe; run it with `flrun sweep --config" in err


# prints whether torch and optuna were imported when the command first wrote to stdout
FIRST_LINE = """
import sys
from fl_lightning.cli.commands import main

class Watch:
    def __init__(self, out):
        self.out, self.first = out, None
    def write(self, text):
        if self.first is None and text.strip():
            self.first = (text, 'torch' in sys.modules, 'optuna' in sys.modules)
        return self.out.write(text)
    def flush(self):
        self.out.flush()

watch = Watch(sys.stdout)
sys.stdout = watch
status = main(sys.argv[1:])
sys.stdout = watch.out
print(repr((status, watch.first)))
"""


def test_the_first_line_comes_before_torch_and_optuna_are_imported(tmp_path):
    # a parameter the base recipe lacks: found by the recipe check after the first line, so no trial runs
    sweep = write_sweep(tmp_path / "s.yaml", parameters={"training.nope": {"type": "int", "low": 1, "high": 2}})
    result = subprocess.run(
        [sys.executable, "-c", FIRST_LINE, "sweep", "--config", str(sweep)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )  # fmt: skip
    status, (line, torch_imported, optuna_imported) = eval(result.stdout.strip().splitlines()[-1])
    assert status == 2 and "sweep parameter 'training.nope' is not an option" in result.stderr
    assert line.startswith(f"sweep s: 4 trials of {tmp_path / 'base.yaml'}, maximize global/test_acc (best)")
    assert (torch_imported, optuna_imported) == (False, False)


def test_a_sweep_tuned_on_a_validation_split_reports_the_best_trials_test_score(tmp_path, capsys):
    """The objective global/val_acc picks each trial's best round and the best trial; the test score of that
    trial at that round is reported beside it, and no warning is given (it is one for a test objective)."""
    overrides = {"rounds": 4, "eval_every": 1, **VAL_SPLIT}
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=3, parameters=LR, metric="global/val_acc", overrides=overrides)
    assert run_cli("sweep", "--config", str(sweep)) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err
    root = tmp_path / "sweep"
    result = json.loads((root / "sweep.json").read_text())
    best = next(r for r in trials(root) if int(r["trial"]) == result["best_trial"])
    summary = read_summary(tmp_path / best["output_dir"])
    assert summary["monitor"] == "global/val_acc"
    rows = metrics_rows(tmp_path / best["output_dir"])
    best_row = max(rows, key=lambda r: float(r["global/val_acc"]))  # the round with the best val score
    assert result["best_value"] == pytest.approx(float(best_row["global/val_acc"]))
    assert result["best_test"] == {
        "metric": "global/test_acc",
        "value": pytest.approx(float(best_row["global/test_acc"])),
    }
    assert f"(its global/test_acc {float(best_row['global/test_acc']):.4f})" in captured.out


def test_an_objective_measured_on_the_test_set_gets_a_warning_naming_the_validation_metric(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=1, parameters=LR, overrides={"rounds": 1})
    assert run_cli("sweep", "--config", str(sweep)) == 0
    err = capsys.readouterr().err
    assert "flrun sweep: warning: the objective global/test_acc is measured on the test set" in err
    assert "(global/val_acc with data.init_args.local_split: [0.8, 0.2, 0.0] in the overrides)" in err


def _study_with(values):
    import optuna
    from optuna.distributions import FloatDistribution

    study = optuna.create_study(direction="maximize")
    space = {"training.optimizer.init_args.lr": FloatDistribution(0.01, 0.3, log=True)}
    for i, value in enumerate(values):
        params = {"training.optimizer.init_args.lr": 0.01 + 0.02 * i}
        study.add_trial(optuna.trial.create_trial(params=params, distributions=space, value=value))
    return study


@pytest.mark.parametrize(("completed", "flagged"), [(3, True), (9, True), (10, False)])
def test_importances_from_fewer_than_ten_completed_trials_are_flagged(tmp_path, completed, flagged):
    from fl_lightning.sweep.results import write_results

    spec = load_sweep(write_sweep(tmp_path / "s.yaml", parameters=LR), check_recipe=False)
    (tmp_path / "out").mkdir()
    result = write_results(_study_with([0.5 + 0.01 * i for i in range(completed)]), spec, tmp_path / "out")
    assert result["importances"] == {"training.optimizer.init_args.lr": 1.0}
    note = json.loads((tmp_path / "out" / "sweep.json").read_text()).get("importances_note")
    if flagged:
        assert note == (
            f"from {completed} completed trials: unreliable below about 10; run more trials (--n_trials) before "
            "reading them."
        )
    else:
        assert note is None


def test_a_metric_without_a_val_split_is_refused_before_any_trial():
    with pytest.raises(ConfigError, match="give them a val share"):
        load_sweep(ROOT / "sweeps" / "digits_quickstart.yaml", overrides={"rounds": 2})


def test_an_sqlite_storage_in_folders_that_do_not_exist_yet_is_made_like_an_output_folder(tmp_path, capsys):
    # the storage example every message gives, sqlite:///runs/sweeps/study.db, must work on a fresh clone
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=1, parameters=LR)
    database = tmp_path / "studies" / "cifar" / "study.db"
    assert run_cli("sweep", "--config", str(sweep), "--storage", f"sqlite:///{database}") == 0
    assert database.read_bytes().startswith(b"SQLite format 3\x00")
    assert len(trials(tmp_path / "sweep")) == 1


def _progress_of(study, n_trials, tmp_path, capsys):
    from types import SimpleNamespace

    from fl_lightning.sweep.results import Progress

    spec = SimpleNamespace(
        study_name="s", n_trials=n_trials, metric="m", use="best", direction="maximize", parameters={},
        storage=f"sqlite:///{tmp_path / 'study.db'}", output_dir=str(tmp_path),
    )  # fmt: skip
    capsys.readouterr()
    return Progress(spec, study)


def test_trials_that_end_before_their_lines_are_shown_each_get_their_own_place(tmp_path, capsys):
    import optuna

    study = optuna.create_study(direction="maximize")
    asked = [study.ask() for _ in range(3)]
    for trial, value in zip([asked[0], asked[2], asked[1]], [0.5, 0.7, 0.6]):  # ended in this order
        study.tell(trial, value)
    progress = _progress_of(study, 4, tmp_path, capsys)
    for number in (2, 0, 1):  # shown in another order, all after the three ended (two workers, a busy reader)
        progress("finished", number)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" in ")[0] for line in lines] == [
        "[2/4] trial 2 COMPLETE m (best) 0.7000",
        "[1/4] trial 0 COMPLETE m (best) 0.5000",
        "[3/4] trial 1 COMPLETE m (best) 0.6000",
    ]  # the count when shown would say [3/4] three times


def test_a_study_holding_more_trials_than_asked_says_so_instead_of_k_of_n(tmp_path, capsys):
    import optuna

    study = optuna.create_study(direction="maximize")
    for value in (0.1, 0.2, 0.3):
        study.tell(study.ask(), value)
    _progress_of(study, 2, tmp_path, capsys).header(2)
    out = capsys.readouterr().out
    assert out.startswith("sweep s: the study already holds 3 trials, n_trials is 2: nothing to run (a larger ")
    assert "3 of 2" not in out


def test_a_warning_during_a_trial_names_the_trial(tmp_path, capsys):
    import logging
    import warnings

    from fl_lightning.sweep.trial import messages_named

    package = logging.getLogger("fl_lightning")
    before = (list(package.handlers), package.propagate, warnings.showwarning)
    with messages_named(3):
        logging.getLogger("fl_lightning.client.evaluation").warning("global has collapsed")
        warnings.warn("an odd value", UserWarning, stacklevel=1)
    assert capsys.readouterr().err.splitlines() == [
        "flrun sweep: trial 3: warning: global has collapsed",
        "flrun sweep: trial 3: warning: UserWarning: an odd value",
    ]
    assert (list(package.handlers), package.propagate, warnings.showwarning) == before  # as it was after the trial
    # a run's own warning in a sweep: a model that gives every input one class (constant logits)
    constant = {"global": {"builder": "conftest.constant_logits_model"}}
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=1, parameters=LR)
    write_recipe(tmp_path / "base.yaml", rounds=6, runtime={"num_threads": 1}, models=constant)
    assert run_cli("sweep", "--config", str(sweep), "--", "--rounds", "2") == 0
    err = capsys.readouterr().err
    assert "flrun sweep: trial 0: warning: global gives one class to 100% of the" in err
