"""flrun sweep: real Optuna studies over a tiny digits recipe, in-process and with worker processes, on
SQLite and on a throw-away PostgreSQL server; workers and the sweep itself killed mid-trial."""

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, read_summary, run_cli, write_recipe

LR = {"training.optimizer.init_args.lr": {"type": "float", "low": 0.01, "high": 0.3, "log": True}}
PARAMETERS = {
    **LR,
    # batch size 0 is invalid: trials that draw it fail, and the study must go on
    "training.batch_size": {"type": "categorical", "choices": [16, 0]},
}


def write_sweep(path, **changes):
    """A sweep over a tiny digits recipe (8 clients, an MLP); the base says 6 rounds, the sweep runs 4."""
    base = write_recipe(path.parent / "base.yaml", rounds=6, runtime={"num_threads": 1})
    sweep = {
        "base": str(base),
        "metric": "global/test_acc",
        "n_trials": 4,
        "overrides": {"rounds": 4, "eval_every": 2},
        "sampler": {"name": "random", "seed": 1},
        "pruner": {"name": "none"},
        "parameters": PARAMETERS,
        "output_dir": str(path.parent / "sweep"),
        "heartbeat_interval": 1,
        "grace_period": 3,
    }
    sweep.update(changes)
    path.write_text(yaml.safe_dump(sweep))
    return path


def trials(root):
    return list(csv.DictReader((root / "trials.csv").open()))


def test_sweep_shows_progress_survives_failures_and_resumes_to_exactly_n_trials(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    sweep = write_sweep(tmp_path / "s.yaml", logger="wandb")
    assert run_cli("sweep", "--config", str(sweep)) == 0
    out = capsys.readouterr().out
    root = tmp_path / "sweep"
    rows = trials(root)
    assert len(rows) == 4 and (root / "study.db").is_file()
    failed = [r for r in rows if r["state"] == "FAIL"]
    done = [r for r in rows if r["state"] == "COMPLETE"]
    assert failed and done, rows  # seed 1 draws both batch sizes
    assert all(r["error"].startswith("training.batch_size must be at least 1") for r in failed)
    assert all(r["param/training.batch_size"] == "16" for r in done)
    for row in done:  # each trial is a normal run directory, logged to W&B offline
        assert read_summary(tmp_path / row["output_dir"])["rounds"] == 4
        assert list((tmp_path / row["output_dir"] / "wandb").glob("offline-run-*"))
    # progress: a line per trial start and end with k of n, the best so far and the counts, then a table
    assert "sweep s: 0 of 4 trials done, in this process" in out
    for k, row in enumerate(rows, start=1):
        assert f"trial {row['trial']} started: " in out and f"[{k}/4] trial {row['trial']} {row['state']}" in out
    best = max(done, key=lambda r: float(r["value"]))
    assert f"| best {float(best['value']):.4f} (trial {best['trial']}) | 0 pruned, {len(failed)} failed" in out
    table = out[out.index("trial  state") :].splitlines()
    assert table[0].split() == ["trial", "state", "global/test_acc", "batch_size", "lr", "seconds"]
    assert [line.split()[:2] for line in table[1:5]] == [[r["trial"], r["state"]] for r in rows]
    # n_trials is the study's total: re-running a full study, or with fewer, adds nothing
    for more in ([], ["--n_trials", "2"]):
        assert run_cli("sweep", "--config", str(sweep), *more) == 0
        assert "the study already holds 4 trials" in capsys.readouterr().out
        assert len(trials(root)) == 4
    # a larger n_trials resumes the same study up to exactly that total
    assert run_cli("sweep", "--config", str(sweep), "--n_trials", "6") == 0
    assert len(trials(root)) == 6 and [r["trial"] for r in trials(root)][:4] == [r["trial"] for r in rows]


def test_best_recipe_is_the_base_recipe_with_the_best_parameters(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=3)
    assert run_cli("sweep", "--config", str(sweep)) == 0
    root = tmp_path / "sweep"
    result = json.loads((root / "sweep.json").read_text())
    best = max((r for r in trials(root) if r["state"] == "COMPLETE"), key=lambda r: float(r["value"]))
    assert result["best_trial"] == int(best["trial"]) and result["best_value"] == pytest.approx(float(best["value"]))
    # the base recipe, its 6 rounds and no progress setting; the two parameters; a name of its own
    expected = yaml.safe_load((tmp_path / "base.yaml").read_text())
    expected["training"]["optimizer"]["init_args"]["lr"] = float(best["param/training.optimizer.init_args.lr"])
    expected["training"]["batch_size"] = 16
    expected["name"] = "s_best"
    text = (root / "best_recipe.yaml").read_text()
    assert yaml.safe_load(text) == expected
    assert (
        f"flrun fit --config {root / 'best_recipe.yaml'} --monitor global/test_acc --eval_every 2 --rounds 4\n" in text
    )
    # run as its header says, it reproduces the best trial exactly
    assert run_cli("fit", "--config", str(root / "best_recipe.yaml"), "--rounds", "4", "--eval_every", "2") == 0
    assert read_summary(tmp_path / "runs/s_best/seed0")["best"]["global/test_acc"] == result["best_value"]


@pytest.mark.parametrize(
    "change, message",
    [
        (
            {"parameters": {"training.learning_rate": {"type": "float", "low": 0.1, "high": 0.2}}},
            "is not an option of the base recipe",
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
        ({"n_trials": 0}, "n_trials must be a positive whole number, got 0."),
        ({"heartbeat_interval": 5, "grace_period": 5}, "grace_period (5 s) must exceed heartbeat_interval (5 s)"),
        ({"parameters": {"training.batch_size": [8, 16]}}, "parameter 'training.batch_size': give a mapping"),
        (
            {"overrides": {"rounds": 4, "runtime": {"devices": 2}}},
            "a trial runs in one process; set `runtime.devices: 1`",
        ),
        ({"parameters": {"runtime.devices": {"type": "categorical", "choices": [1, 2]}}}, "runtime.devices 2, but"),
        ({"parameters": {"runtime.devices": {"type": "int", "low": 1, "high": 3}}}, "runtime.devices 3, but"),
        ({"parameters": {"runtime.devices": {"type": "categorical", "choices": [2, "x"]}}}, "runtime.devices 2, but"),
    ],
)
def test_malformed_sweeps_fail_before_any_trial(tmp_path, capsys, change, message):
    sweep = write_sweep(tmp_path / "s.yaml", **change)
    assert run_cli("sweep", "--config", str(sweep)) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "sweep" / "study.db").exists()


def test_a_sweep_file_with_a_yaml_error_names_the_file_and_line(tmp_path, capsys):
    sweep = tmp_path / "s.yaml"
    sweep.write_text("base: recipes/quickstart.yaml\nparameters: {lr: [1, 2\n")
    assert run_cli("sweep", "--config", str(sweep)) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"flrun sweep: error: sweep file {sweep} is not valid YAML: ") and "line 3" in err
    assert len(err.splitlines()) == 1


def sweep_command(sweep, *args, **popen):
    command = [sys.executable, "-m", "fl_lightning", "sweep", "--config", str(sweep), *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def finish(process, timeout=600):
    out, err = process.communicate(timeout=timeout)
    return process.returncode, out, err


@pytest.fixture(params=["sqlite", "postgresql"])
def storage(request, tmp_path):
    """The study's storage URL: the sweep directory's SQLite file, or a throw-away PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'sweep' / 'study.db'}"
    return request.getfixturevalue("postgres_url")


# worker processes, each importing the stack: SQLite in the slow suite; PostgreSQL in the full tier, and in the
# slow suite through the heartbeat test below
BOTH_STORAGES = [pytest.param("sqlite", marks=pytest.mark.slow), pytest.param("postgresql", marks=pytest.mark.full)]


def load(storage, name="s"):
    import optuna

    return optuna.load_study(study_name=name, storage=storage)


def retried_numbers(study):
    """Numbers of the failed trials whose parameters were queued again."""
    return {n for t in study.trials for n in t.system_attrs.get("retry_history", [])}


def by_state(study):
    from fl_lightning.sweep.storage import tally

    return tally(study.get_trials())


@pytest.mark.parametrize("storage", BOTH_STORAGES, indirect=True)
def test_two_workers_draw_different_parameters_and_record_every_trial_once(tmp_path, storage):
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=4, parameters=LR)
    # two "GPUs" by UUID, which CUDA finds nowhere (the CPU recipe uses none): each worker must be given its own
    # (indices would be cut to the GPUs a GPU machine has)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="GPU-fake0,GPU-fake1")
    code, out, err = finish(sweep_command(sweep, "--n_jobs", "2", "--storage", storage, env=env))
    assert code == 0, err
    assert "each on one GPU of CUDA_VISIBLE_DEVICES GPU-fake0,GPU-fake1" in out
    study = load(storage)
    gpu_of = {
        t.user_attrs["process"]: read_summary(Path(t.user_attrs["output_dir"]))["hardware"]["cuda_visible_devices"]
        for t in study.trials
    }
    assert sorted(gpu_of.values()) == ["GPU-fake0", "GPU-fake1"]  # one GPU per worker process, a different one each
    assert sorted(t.number for t in study.trials) == list(range(4))
    assert all(t.state.name == "COMPLETE" for t in study.trials)
    # each worker seeds its sampler differently (equal seeds drew trial 0 = trial 1)
    assert len({t.params["training.optimizer.init_args.lr"] for t in study.trials}) == 4
    assert len({t.user_attrs["process"] for t in study.trials}) == 2  # both workers ran trials
    assert len({t.user_attrs["output_dir"] for t in study.trials}) == 4
    assert "[4/4] trial" in out and len(trials(tmp_path / "sweep")) == 4
    if storage.startswith("postgresql"):
        assert not (tmp_path / "sweep" / "study.db").exists()  # nothing went to the SQLite default
    # the study is full: another run starts no worker and adds no trial
    code, out, err = finish(sweep_command(sweep, "--n_jobs", "2", "--storage", storage))
    assert code == 0 and "already holds 4 trials" in out and len(load(storage).trials) == 4


@pytest.mark.parametrize(
    ("setting", "gpus_seen", "expected"),
    [
        (None, 3, ["0", "1", "2"]),  # no setting: every GPU torch sees
        ("2, 5,GPU-8a1b", 0, ["2", "5"]),  # indices, to the first entry of another kind (as torch reads it)
        ("GPU-8a1b,3", 0, ["GPU-8a1b"]),
        ("1,-1,3", 0, ["1"]),  # CUDA stops at an invalid entry
        ("0,0,1", 0, []),  # a repeated device: CUDA shows none
        ("", 0, []),  # GPUs hidden: the workers' setting is left alone
        ("0,1,7", 2, ["0", "1"]),  # on two GPUs CUDA stops at 7: no worker may be given it
    ],
)
def test_visible_gpus_read_the_setting_as_cuda_does(monkeypatch, setting, gpus_seen, expected):
    import torch

    from fl_lightning.distributed.gpu_share import visible_gpus

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus_seen)
    environ = {} if setting is None else {"CUDA_VISIBLE_DEVICES": setting}
    assert visible_gpus(environ) == expected


def test_workers_are_spread_over_the_gpus_and_a_replacement_takes_the_dead_worker_s(monkeypatch, tmp_path):
    from types import SimpleNamespace

    from fl_lightning.sweep import workers as sweep_workers

    started, commands = [], []

    def popen(command, env, **kwargs):
        started.append(env.get("CUDA_VISIBLE_DEVICES"))
        commands.append(command)
        return SimpleNamespace(pid=10_000 + len(started), poll=lambda: None)

    monkeypatch.setattr(sweep_workers.subprocess, "Popen", popen)
    spec = SimpleNamespace(output_dir=str(tmp_path), study_name="s", storage=None, fit_args=["--rounds", "2"])
    coordinator = sweep_workers.Coordinator(spec, None, 5, "s.yaml", 0, None, None, gpus=["4", "7"])
    try:
        for _ in range(5):
            coordinator.spawn()
        assert started == ["4", "7", "4", "7", "4"]
        assert all(command[-3:] == ["--", "--rounds", "2"] for command in commands)  # the trials' fit arguments
        dead = next(w for w in coordinator.workers if w.gpu == "7")
        coordinator.workers.remove(dead)  # as reap() does when a worker dies
        coordinator.selector.unregister(dead.inbox)
        dead.close()
        coordinator.spawn()
        assert started[-1] == "7"
        without = sweep_workers.Coordinator(spec, None, 1, "s.yaml", 0, None, None)
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
        without.spawn()  # no GPUs to share out: the worker inherits this process's setting
        assert started[-1] == "3"
        without.workers[0].close()
    finally:
        for worker in coordinator.workers:
            worker.close()


def wait_for_running(storage, timeout=600, sweep=None):
    """Trials running in worker processes (their pid in the `process` attribute), once one runs. With the
    `sweep` process given, fails at once with its output if it ends first."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if sweep is not None and sweep.poll() is not None:
            code, out, err = finish(sweep)
            raise AssertionError(f"the sweep ended (exit {code}) before a trial was seen running:\n{out}\n{err}")
        try:
            running = [t for t in load(storage).trials if t.state.name == "RUNNING" and "process" in t.user_attrs]
        # the study (or its SQLite directory) does not exist yet, or the sweep is making its tables as we look
        except (KeyError, OperationalError, IntegrityError):
            running = []
        if running:
            return running
        time.sleep(0.2)
    raise AssertionError("no trial started")


def children(pid):
    """The pids of a process's children (Linux: the parent is the fourth field of /proc/PID/stat)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended while we looked
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"  # a zombie has ended


# trials of 160 rounds (some seconds each) last long enough to be killed in the middle
LONG = {"overrides": {"rounds": 160, "eval_every": 80}, "parameters": LR}


@pytest.mark.parametrize("storage", BOTH_STORAGES, indirect=True)
def test_a_killed_worker_s_trial_runs_again_and_the_study_ends_full(tmp_path, storage):
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=3, **LONG)
    process = sweep_command(sweep, "--n_jobs", "2", "--storage", storage)
    victim = wait_for_running(storage, sweep=process)[0]
    pid = int(victim.user_attrs["process"].rsplit(":", 1)[1])
    assert pid != process.pid
    os.kill(pid, signal.SIGKILL)
    code, _, err = finish(process)
    assert code == 0, err
    assert f"(pid {pid}) was killed by SIGKILL during trial {victim.number}, which is queued again." in err
    study = load(storage)
    counts = by_state(study)
    assert (counts["COMPLETE"], counts["retried"], counts["RUNNING"], counts["WAITING"]) == (3, 1, 0, 0)
    retry = next(t for t in study.trials if t.system_attrs.get("retry_history") == [victim.number])
    assert retry.state.name == "COMPLETE" and retry.params == victim.params
    assert study.trials[victim.number].user_attrs["error"] == "its worker process was killed by SIGKILL"


@pytest.mark.slow  # worker processes, each importing the stack
@pytest.mark.parametrize("storage", ["sqlite"], indirect=True)  # the worker-death test covers both storages
def test_a_killed_sweep_ends_its_workers_and_a_rerun_finishes_exactly_n_trials(tmp_path, storage):
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=3, **LONG)
    process = sweep_command(sweep, "--n_jobs", "2", "--storage", storage)
    # one trial running is enough: on a loaded machine one worker may finish trials before the other has
    # imported the stack, so two at once is not guaranteed; the workers are the sweep's child processes
    running = wait_for_running(storage, sweep=process)
    workers = children(process.pid)
    assert len(workers) == 2, workers
    process.kill()  # SIGKILL: no chance to clean up; the workers must notice on their own
    _, _, err = finish(process)  # the workers share its stderr: closed once they have ended
    assert "Traceback" not in err and "Exception ignored" not in err, err  # nothing on the user's terminal
    end = time.monotonic() + 60
    while any(map(alive, workers)) and time.monotonic() < end:
        time.sleep(0.2)
    assert not any(map(alive, workers)), "workers outlived the killed sweep"
    study = load(storage)
    counts = by_state(study)
    # each worker failed the trial it was running and queued it again: the one seen running, unless it
    # completed between the poll and the kill, and the other worker's, if it had one by then
    cut = retried_numbers(study)
    assert running[0].number in cut or study.trials[running[0].number].state.name == "COMPLETE"
    assert cut, "every trial completed before the kill: make LONG's trials longer"
    assert (counts["RUNNING"], counts["retried"], counts["WAITING"], counts["FAIL"]) == (0, len(cut), len(cut), 0)
    code, _, err = finish(sweep_command(sweep, "--storage", storage))
    assert code == 0, err
    counts = by_state(load(storage))
    assert (counts["COMPLETE"], counts["finished"], counts["retried"]) == (3, 3, len(cut))


@pytest.mark.slow  # worker processes, each importing the stack
@pytest.mark.parametrize("storage", ["postgresql"], indirect=True)
def test_trials_of_a_process_group_killed_at_once_are_run_again_after_their_heartbeat_stops(tmp_path, storage):
    sweep = write_sweep(tmp_path / "s.yaml", n_trials=2, **LONG)
    process = sweep_command(sweep, "--n_jobs", "2", "--storage", storage, start_new_session=True)
    wait_for_running(storage, sweep=process)  # one is enough; see the test above
    os.killpg(process.pid, signal.SIGKILL)  # nobody marks the trials failed: they stay RUNNING
    finish(process)
    study = load(storage)
    cut = [t.number for t in study.trials if t.state.name == "RUNNING"]
    assert cut, "every trial completed before the kill: make LONG's trials longer"
    code, _, err = finish(sweep_command(sweep, "--storage", storage))  # grace period 3 s
    assert code == 0, err
    study = load(storage)
    counts = by_state(study)
    assert (counts["COMPLETE"], counts["finished"], counts["retried"], counts["RUNNING"]) == (2, 2, len(cut), 0)
    assert all(number in retried_numbers(study) for number in cut)


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
            [*as_postgres, f"{bindir}/pg_ctl", "-D", f"{root}/data", "-m", "immediate", "stop"],
            capture_output=True,
            check=False,
        )
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_sweep_file_validates_against_its_base_recipe(path, monkeypatch):
    from fl_lightning.sweep.spec import load_sweep

    monkeypatch.chdir(ROOT)  # sweep files name their base recipe relative to the project root
    spec = load_sweep(path)
    assert spec.parameters and spec.metric
