"""flrun sweep: a study keeps one meaning (its definition is recorded and re-runs that change it are refused),
a wrong metric stops the sweep at the first trial, and what is reported as the best is a trial of the sweep."""

import csv
import json

import pytest
import yaml
from conftest import read_summary, run_cli, write_recipe
from test_sweep import LR, sweep_command, trials, write_sweep

# two evaluations per trial: short runs
QUICK = {"overrides": {"rounds": 2, "eval_every": 1}, "parameters": LR, "n_trials": 1}


def load(tmp_path, name="s"):
    import optuna

    return optuna.load_study(study_name=name, storage=f"sqlite:///{tmp_path / 'sweep' / 'study.db'}")


def rerun(sweep, **changes):
    """The sweep file rewritten with ``changes`` (its base recipe kept), then run again."""
    spec = yaml.safe_load(sweep.read_text())
    spec.update(changes)
    sweep.write_text(yaml.safe_dump(spec))
    return run_cli("sweep", "--config", str(sweep))


REFUSED_CHANGES = [
    # the reviewer's cases: another objective, fewer rounds, another range
    ({"metric": "global/test_loss"}, 'metric "global/test_acc" -> "global/test_loss"'),
    ({"use": "best"}, 'use "final" -> "best"'),
    ({"overrides": {"rounds": 1, "eval_every": 1}}, "recipe key rounds 2 -> 1"),
    (
        {"parameters": {"training.optimizer.init_args.lr": {"type": "float", "low": 0.001, "high": 0.002}}},
        (
            'parameter training.optimizer.init_args.lr {"high": 0.3, "log": true, "low": 0.01, "type": "float"} '
            '-> {"high": 0.002, "low": 0.001, "type": "float"}'
        ),
    ),
    (
        {"parameters": {**LR, "training.local_epochs": {"type": "int", "low": 1, "high": 2}}},
        'parameter training.local_epochs (absent) -> {"high": 2, "low": 1, "type": "int"}',
    ),
    ({"direction": "minimize"}, "was made to maximize and the sweep file says direction minimize"),
]


def test_a_rerun_that_changes_what_a_trial_means_is_refused(tmp_path, capsys):
    """Each change in turn, against one study of one trial: a refused rerun runs nothing, so the next change
    meets the same study."""
    sweep = write_sweep(tmp_path / "s.yaml", use="final", **QUICK)
    original = sweep.read_text()
    assert run_cli("sweep", "--config", str(sweep)) == 0
    capsys.readouterr()
    for change, message in REFUSED_CHANGES:
        sweep.write_text(original)
        assert rerun(sweep, n_trials=2, **change) == 2, change
        err = capsys.readouterr().err.strip()
        assert message in err and len(err.splitlines()) == 1, (change, err)
        assert "give the changed sweep a new study_name (and output_dir) or storage, or revert" in err
        assert len(load(tmp_path).trials) == 1, change  # nothing ran


def test_a_changed_base_recipe_is_refused_but_a_searched_key_of_it_may_change(tmp_path, capsys):
    sweep = write_sweep(tmp_path / "s.yaml", **QUICK)
    assert run_cli("sweep", "--config", str(sweep)) == 0
    base = tmp_path / "base.yaml"
    recipe = yaml.safe_load(base.read_text())
    recipe["training"]["batch_size"] = 8
    base.write_text(yaml.safe_dump(recipe))
    capsys.readouterr()
    assert rerun(sweep, n_trials=2) == 2
    assert "recipe key training.batch_size 16 -> 8" in capsys.readouterr().err
    recipe["training"]["batch_size"] = 16  # back, and the searched lr's base value changed: trials are the same
    recipe["training"]["optimizer"]["init_args"]["lr"] = 0.123
    base.write_text(yaml.safe_dump(recipe))
    # what may change: the total, the sampler, the pruner, the logger and the heartbeat settings
    changes = {"n_trials": 2, "sampler": {"name": "tpe", "seed": 5}, "pruner": {"name": "median"}, "grace_period": 9}
    assert rerun(sweep, **changes) == 0
    assert [t.state.name for t in load(tmp_path).trials] == ["COMPLETE", "COMPLETE"]


def test_a_study_made_before_definitions_were_recorded_is_taken_with_a_note_and_its_foreign_trials_not_as_best(
    tmp_path, capsys
):
    import optuna
    from optuna.distributions import FloatDistribution

    (tmp_path / "sweep").mkdir()
    study = optuna.create_study(
        study_name="s", storage=f"sqlite:///{tmp_path / 'sweep' / 'study.db'}", direction="maximize"
    )
    # an old trial from another range, with a value no real trial reaches
    old = FloatDistribution(0.5, 0.9, log=True)
    study.add_trial(
        optuna.trial.create_trial(
            params={"training.optimizer.init_args.lr": 0.7},
            distributions={"training.optimizer.init_args.lr": old},
            value=2.0,
        )
    )
    sweep = write_sweep(tmp_path / "s.yaml", **{**QUICK, "n_trials": 2})
    assert run_cli("sweep", "--config", str(sweep)) == 0
    captured = capsys.readouterr()
    assert "study 's' was made before sweeps recorded what defines them: its 1 trials are taken" in captured.err
    assert "trials [0] were drawn from another search space" in captured.err
    result = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert result["outside_space"] == [0] and result["best_trial"] == 1
    assert result["best_value"] == load(tmp_path).trials[1].value < 2.0
    assert "with the parameters of trial 1:" in (tmp_path / "sweep" / "best_recipe.yaml").read_text()
    # recorded now: a change is refused from here on
    assert rerun(sweep, n_trials=3, overrides={"rounds": 1, "eval_every": 1}) == 2
    assert "recipe key rounds 2 -> 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, message",
    [
        ({"metric": "global/test_ac"}, "metric 'global/test_ac' is not one the runs of"),
        ({"metric": "global/test_ac"}, "(did you mean 'global/test_acc'?)"),
        ({"metric": "glob/test_acc"}, "(did you mean 'global/test_acc'?)"),
        ({"metric": "test_acc"}, "global/test_acc, global/test_loss, global/test_top_class_share, personal/test_acc"),
        ({"metric": "personal/all/test_acc"}, "is not one the runs of"),  # one tier: no per-tier metrics
        (
            {"overrides": {"rounds": 2, "training": {"optimizer": {"init_args": {"lr": 0.1}}}}},
            "both fixes and searches",
        ),
        ({"overrides": [2]}, "overrides must be a mapping"),
    ],
)
def test_a_wrong_metric_name_or_an_override_of_a_searched_key_fails_before_any_trial(tmp_path, capsys, change, message):
    sweep = write_sweep(tmp_path / "s.yaml", **{**QUICK, **change})
    assert run_cli("sweep", "--config", str(sweep)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "sweep" / "study.db").exists()


def test_a_run_without_the_metric_stops_the_sweep_at_its_first_evaluation_and_the_fixed_file_may_rerun(
    tmp_path, capsys
):
    # FedAvg reports no personal/ metrics: a name of the right form that these runs do not report
    sweep = write_sweep(tmp_path / "s.yaml", metric="personal/test_acc", n_trials=3, parameters=LR)
    assert run_cli("sweep", "--config", str(sweep)) == 2
    captured = capsys.readouterr()
    rows = trials(tmp_path / "sweep")
    assert [(r["trial"], r["state"]) for r in rows] == [("0", "FAIL")]  # one trial, not three
    assert rows[0]["error"].startswith(
        "the run has no metric 'personal/test_acc'; its evaluation at round 2 reports ['global/test_acc', "
    )
    assert not (tmp_path / rows[0]["output_dir"] / "summary.json").exists()  # stopped at round 2 of 4
    assert "flrun sweep: stopped after trial 0: the run has no metric 'personal/test_acc'" in captured.err
    assert "0 of 3 trials: 0 complete, 0 pruned, 0 failed, 1 without the metric (not counted)" in captured.out
    # fixed: the study had no value under the wrong metric, so it takes the new one, and runs its 3 trials
    assert rerun(sweep, metric="global/test_acc") == 0
    assert (
        "the 1 trial(s) of study 's' all failed, so it takes the changed sweep file (metric" in capsys.readouterr().err
    )
    assert [r["state"] for r in trials(tmp_path / "sweep")] == ["FAIL", "COMPLETE", "COMPLETE", "COMPLETE"]


def test_trial_value_says_why_a_run_has_none():
    from types import SimpleNamespace

    from fl_lightning.sweep.metric import MissingMetric
    from fl_lightning.sweep.trial import trial_value

    spec = SimpleNamespace(metric="personal/clients_evaluated", use="final")
    assert trial_value({"final": {"personal/clients_evaluated": 3.0}}, spec) == 3.0
    with pytest.raises(MissingMetric, match=r"no metric 'personal/clients_evaluated'; it reports \['a/test_acc'\]"):
        trial_value({"final": {"a/test_acc": 0.5}}, spec)
    spec.use = "best"  # no round's monitor was a number: this run has no value, the metric may be right
    with pytest.raises(ValueError, match="no `best` evaluation") as err:
        trial_value({"best": {}, "monitor": "personal/test_acc"}, spec)
    assert not isinstance(err.value, MissingMetric)
    with pytest.raises(ValueError, match="is NaN"):
        trial_value({"best": {"personal/clients_evaluated": float("nan")}}, spec)


def test_every_trial_failing_exits_1_with_a_line_saying_so(tmp_path, capsys):
    bad = {"seed": {"type": "int", "low": -3, "high": -1}}  # parses; every run refuses it
    sweep = write_sweep(tmp_path / "s.yaml", **{**QUICK, "parameters": bad, "n_trials": 2})
    assert run_cli("sweep", "--config", str(sweep)) == 1
    captured = capsys.readouterr()
    assert "flrun sweep: every trial this command ran failed (2); their errors are above and in" in captured.err
    assert [r["state"] for r in trials(tmp_path / "sweep")] == ["FAIL", "FAIL"]


def test_a_sweep_directory_of_another_study_is_refused(tmp_path, capsys):
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep" / "sweep.json").write_text(json.dumps({"study": "other"}))
    sweep = write_sweep(tmp_path / "s.yaml", **QUICK)
    assert run_cli("sweep", "--config", str(sweep)) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'sweep'} holds the trials of sweep study 'other'; give study 's' an output_dir" in err
    assert not (tmp_path / "sweep" / "study.db").exists()


def test_best_recipe_of_a_base_recipe_with_bases_runs_from_the_sweep_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    family = tmp_path / "recipes"
    family.mkdir()
    write_recipe(family / "parent.yaml", rounds=6, runtime={"num_threads": 1})
    (family / "child.yaml").write_text("base: parent.yaml\nseed: 3\n")  # relative to child.yaml
    sweep = write_sweep(tmp_path / "s.yaml", **QUICK)
    spec = yaml.safe_load(sweep.read_text())
    spec["base"] = str(family / "child.yaml")
    sweep.write_text(yaml.safe_dump(spec))
    assert run_cli("sweep", "--config", str(sweep)) == 0
    best = tmp_path / "sweep" / "best_recipe.yaml"
    recipe = yaml.safe_load(best.read_text())
    assert "base" not in recipe and recipe["seed"] == 3 and recipe["rounds"] == 6  # merged, nothing to resolve
    assert run_cli("fit", "--config", str(best), "--rounds", "2", "--eval_every", "1") == 0
    result = json.loads((tmp_path / "sweep" / "sweep.json").read_text())
    assert read_summary(tmp_path / "runs/s_best/seed3")["best"]["global/test_acc"] == result["best_value"]


@pytest.mark.slow  # worker processes, each importing the stack
def test_workers_stop_when_a_run_lacks_the_metric(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", metric="personal/test_acc", n_trials=6, parameters=LR)
    process = sweep_command(sweep, "--n_jobs", "2")
    _, err = process.communicate(timeout=600)
    assert process.returncode == 2, err
    rows = list(csv.DictReader((tmp_path / "sweep" / "trials.csv").open()))
    assert 1 <= len(rows) <= 2 and all(r["state"] == "FAIL" for r in rows)  # at most the two started at once
    assert "stopped after trial" in err


def test_an_optimizer_class_named_in_short_in_overrides_may_have_its_options_searched(tmp_path):
    from fl_lightning.sweep.spec import load_sweep

    overrides = {"rounds": 2, "eval_every": 1, "training": {"optimizer": "torch.optim.Adam"}}
    spec = load_sweep(write_sweep(tmp_path / "s.yaml", **{**QUICK, "overrides": overrides}))
    assert spec.overrides["training"]["optimizer"] == "torch.optim.Adam"  # accepted: only the lr is searched
