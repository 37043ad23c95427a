"""flrun sweep: a real Optuna study over the digits quickstart, in-process and with worker processes."""

import csv
import json
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT, read_summary, run_cli

PARAMETERS = {
    "training.optimizer.init_args.lr": {"type": "float", "low": 0.01, "high": 0.3, "log": True},
    # batch size 0 is invalid: trials that draw it fail, and the study must go on
    "training.batch_size": {"type": "categorical", "choices": [16, 0]},
}


def write_sweep(path, **changes):
    sweep = {
        "base": str(ROOT / "recipes/quickstart.yaml"),
        "metric": "global/test_acc",
        "n_trials": 4,
        "overrides": {"rounds": 4, "eval_every": 2},
        "sampler": {"name": "random", "seed": 1},
        "pruner": {"name": "none"},
        "parameters": PARAMETERS,
        "output_dir": str(path.parent / "sweep"),
    }
    sweep.update(changes)
    path.write_text(yaml.safe_dump(sweep))
    return path


def trials(root):
    return list(csv.DictReader((root / "trials.csv").open()))


def test_sweep_runs_survives_failures_resumes_and_writes_the_best_recipe(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    sweep = write_sweep(tmp_path / "s.yaml", logger="wandb")
    assert run_cli("sweep", "--config", str(sweep)) == 0
    root = tmp_path / "sweep"
    rows = trials(root)
    assert len(rows) == 4 and (root / "study.db").is_file()
    failed = [r for r in rows if r["state"] == "FAIL"]
    done = [r for r in rows if r["state"] == "COMPLETE"]
    assert failed and done, rows  # seed 1 draws both batch sizes
    assert all("batch_size must be at least 1" in r["error"] for r in failed)
    assert all(r["param/training.batch_size"] == "16" for r in done)
    for row in done:  # each trial is a normal run directory, logged to W&B offline
        assert read_summary(tmp_path / row["output_dir"])["rounds"] == 4
        assert list((tmp_path / row["output_dir"] / "wandb").glob("offline-run-*"))
    # re-running with a larger budget resumes the same study
    assert run_cli("sweep", "--config", str(sweep), "--n_trials", "6") == 0
    assert len(trials(root)) == 6 and [r["trial"] for r in trials(root)][:4] == [r["trial"] for r in rows]
    result = json.loads((root / "sweep.json").read_text())
    best = max(float(r["value"]) for r in trials(root) if r["state"] == "COMPLETE")
    assert result["best_value"] == pytest.approx(best)
    recipe = yaml.safe_load((root / "best_recipe.yaml").read_text())
    assert recipe["training"]["optimizer"]["init_args"]["lr"] == pytest.approx(
        result["best_params"]["training.optimizer.init_args.lr"]
    )
    assert run_cli("fit", "--config", str(root / "best_recipe.yaml"), "--output_dir", str(tmp_path / "best")) == 0
    assert read_summary(tmp_path / "best")["best"]["global/test_acc"] == pytest.approx(result["best_value"])


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"parameters": {"training.learning_rate": {"type": "float", "low": 0.1, "high": 0.2}}},
            "does not fit the base recipe",
        ),
        ({"parameters": {"training.batch_size": {"type": "int", "low": 32, "high": 32}}}, "give low < high"),
        (
            {"parameters": {"training.batch_size": {"type": "normal", "low": 1, "high": 2}}},
            "type must be float, int or categorical",
        ),
        (
            {"parameters": {"training.optimizer.init_args.lr": {"type": "float", "low": 0, "high": 1, "log": True}}},
            "log scale",
        ),
        ({"metrics": "acc"}, "unknown key(s) ['metrics']"),
    ],
)
def test_malformed_sweeps_fail_before_any_trial(tmp_path, capsys, change, message):
    sweep = write_sweep(tmp_path / "s.yaml", **change)
    assert run_cli("sweep", "--config", str(sweep)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "sweep" / "study.db").exists()


def test_two_worker_processes_share_one_study_without_losing_trials(tmp_path):
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=6, parameters={k: v for k, v in PARAMETERS.items() if "lr" in k})
    result = subprocess.run(
        [sys.executable, "-m", "fl_lightning", "sweep", "--config", str(sweep), "--n_jobs", "2"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    rows = trials(tmp_path / "sweep")
    assert len(rows) == 6 and sorted(int(r["trial"]) for r in rows) == list(range(6))
    assert all(r["state"] == "COMPLETE" for r in rows)
    assert len({r["output_dir"] for r in rows}) == 6


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def postgres_url():
    """A throw-away PostgreSQL server on loopback (Debian's postgresql, which .ci/run installs)."""
    import os
    import shutil
    import tempfile

    initdb = shutil.which("initdb") or next(
        iter(sorted(__import__("glob").glob("/usr/lib/postgresql/*/bin/initdb"))), None
    )
    if initdb is None or os.geteuid() != 0:
        pytest.skip("needs Debian's postgresql and root to start it as the postgres user (.ci/run provides both)")
    bindir = os.path.dirname(os.path.realpath(initdb))
    root = tempfile.mkdtemp(prefix="flpg-", dir="/tmp")
    shutil.chown(root, "postgres")
    port = _free_port()
    as_postgres = ["runuser", "-u", "postgres", "--"]
    subprocess.run(
        [*as_postgres, f"{bindir}/initdb", "-D", f"{root}/data", "-A", "trust", "-U", "postgres"],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        [
            *as_postgres,
            f"{bindir}/pg_ctl",
            "-D",
            f"{root}/data",
            "-l",
            f"{root}/log",
            "-w",
            "-o",
            f"-p {port} -h 127.0.0.1 -k {root}",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    try:
        subprocess.run(
            [*as_postgres, f"{bindir}/createdb", "-h", "127.0.0.1", "-p", str(port), "optuna"],
            check=True,
            capture_output=True,
        )
        yield f"postgresql+psycopg2://postgres@127.0.0.1:{port}/optuna"
    finally:
        subprocess.run(
            [*as_postgres, f"{bindir}/pg_ctl", "-D", f"{root}/data", "-m", "immediate", "stop"], capture_output=True
        )
        shutil.rmtree(root, ignore_errors=True)


def test_two_workers_on_a_postgresql_study_record_every_trial_once(tmp_path, postgres_url):
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=6, parameters={k: v for k, v in PARAMETERS.items() if "lr" in k})
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fl_lightning",
            "sweep",
            "--config",
            str(sweep),
            "--n_jobs",
            "2",
            "--storage",
            postgres_url,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    import optuna

    study = optuna.load_study(study_name="s", storage=postgres_url)
    assert sorted(t.number for t in study.trials) == list(range(6))
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    assert len({t.user_attrs["output_dir"] for t in study.trials}) == 6
    assert not (tmp_path / "sweep" / "study.db").exists()  # nothing went to the SQLite default


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_sweep_file_validates_against_its_base_recipe(path, monkeypatch):
    from fl_lightning.sweep import load_sweep

    monkeypatch.chdir(ROOT)  # sweep files name their base recipe relative to the project root
    spec = load_sweep(path)
    assert spec.parameters and spec.metric
