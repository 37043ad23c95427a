"""Processes and resources: a run at a time per process, ranks the machine can hold, child processes that end with
the command that started them, and one definition per sweep study.

Tests that start real processes poll for what they wait on with generous deadlines (the machine may be busy), and
each kills only the processes it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import yaml
from conftest import ROOT, read_summary, run_cli, write_recipe

import fl_lightning
from fl_lightning.federation.errors import ConfigError
from fl_lightning.tracking import RunLogger


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------------------------------------- one run per process
class _HeldAtFirstRound(RunLogger):
    """Holds its run at the end of round 1 until ``release`` is set (so a second run starts meanwhile)."""

    def __init__(self):
        self.reached, self.release = threading.Event(), threading.Event()

    def log_metrics(self, metrics, step):
        self.reached.set()
        assert self.release.wait(timeout=600)


def test_a_second_fit_while_one_runs_in_another_thread_is_refused_and_the_first_keeps_its_numbers(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=3, eval_every=1)
    fl_lightning.fit(config=str(recipe), output_dir=str(tmp_path / "alone"))
    held, outcome = _HeldAtFirstRound(), {}

    def first():
        outcome["summary"] = fl_lightning.fit(config=str(recipe), output_dir=str(tmp_path / "first"), logger=[held])

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert held.reached.wait(timeout=600), "the first run never finished a round"
        with pytest.raises(ConfigError, match="another fit is running in this process") as refused:
            fl_lightning.fit(config=str(recipe), seed=1, output_dir=str(tmp_path / "second"))
    finally:
        held.release.set()
        thread.join(timeout=600)
    assert "one after another, or in separate processes" in str(refused.value)
    assert not (tmp_path / "second").exists()  # refused before anything was written
    assert outcome["summary"]["final"] == read_summary(tmp_path / "alone")["final"]
    fl_lightning.fit(config=str(recipe), seed=1, output_dir=str(tmp_path / "second"))  # the lock went with the run


# ---------------------------------------------------------------------------------------------- one study, one meaning
def _two_sweeps(tmp_path):
    """Two sweep files over one base recipe with different search spaces, and the command line that runs each under
    one study name on one storage (each its own output folder)."""
    base = write_recipe(tmp_path / "base.yaml", rounds=2, eval_every=1)
    spaces = {
        "lr": {"training.optimizer.init_args.lr": {"type": "float", "low": 0.01, "high": 0.1}},
        "batch": {"training.batch_size": {"type": "categorical", "choices": [8, 16]}},
    }
    storage = f"sqlite:///{tmp_path / 'studies.db'}"
    argv = {}
    for name, parameters in spaces.items():
        sweep = tmp_path / f"{name}.yaml"
        sweep.write_text(
            yaml.safe_dump({"base": str(base), "metric": "global/test_acc", "n_trials": 2, "parameters": parameters})
        )
        argv[name] = ["sweep", "--config", str(sweep), "--study_name", "shared", "--storage", storage]
        argv[name] += ["--output_dir", str(tmp_path / name)]
    return argv, storage


def _running_as(monkeypatch, who: str) -> None:
    """This process takes the identity ``host:pid`` that another flrun sweep command would have."""
    from fl_lightning.sweep import study

    monkeypatch.setattr(study, "this_command", lambda: who)


def test_a_second_sweep_with_another_search_space_is_refused_while_the_first_runs_the_study(
    tmp_path, capsys, monkeypatch
):
    """The first sweep has opened the study and recorded its definition but started no trial yet (its workers are
    still starting): a second sweep under the same name must not take the study over."""
    from fl_lightning.sweep.spec import read_sweep
    from fl_lightning.sweep.storage import open_or_create_study
    from fl_lightning.sweep.study import check_definition, definition, running

    argv, storage = _two_sweeps(tmp_path)
    first = read_sweep(argv["lr"][2], [], storage=storage, study_name="shared", output_dir=str(tmp_path / "lr"))
    study, created = open_or_create_study(first)
    assert created
    with running(study):  # the first command, in this process
        check_definition(study, first, definition(first), print, created)
        _running_as(monkeypatch, f"{socket.gethostname()}:{os.getpid() + 1}")  # the second command
        capsys.readouterr()
        assert run_cli(*argv["batch"]) == 2
    message = _one_line(capsys.readouterr().err)
    assert f"is being run by another flrun sweep ({socket.gethostname()}:{os.getpid()})" in message
    assert "parameter training.batch_size (absent) -> " in message and "its own study_name" in message
    assert study.get_trials() == [] and not (tmp_path / "batch" / "trials.csv").exists()


def test_a_study_whose_sweep_was_killed_before_its_first_trial_takes_the_changed_sweep(tmp_path, capsys, monkeypatch):
    from fl_lightning.sweep.spec import read_sweep
    from fl_lightning.sweep.storage import open_or_create_study
    from fl_lightning.sweep.study import RUNNING_KEY, check_definition, definition

    argv, storage = _two_sweeps(tmp_path)
    first = read_sweep(argv["lr"][2], [], storage=storage, study_name="shared", output_dir=str(tmp_path / "lr"))
    study, created = open_or_create_study(first)
    check_definition(study, first, definition(first), print, created)
    ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead = f"{socket.gethostname()}:{int(ended.stdout)}"
    study.set_user_attr(RUNNING_KEY + dead, True)  # what a SIGKILLed command leaves
    capsys.readouterr()
    assert run_cli(*argv["batch"]) == 0
    assert "study 'shared' has no trials yet, so it takes the changed sweep file" in capsys.readouterr().err
    assert study.user_attrs[RUNNING_KEY + dead] is False  # cleared
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "COMPLETE"]
    assert {name for t in study.get_trials() for name in t.params} == {"training.batch_size"}


def test_two_sweeps_that_create_one_study_at_once_do_not_both_define_it(tmp_path, monkeypatch):
    """The second command finds the study made an instant ago, before its maker recorded the definition: it waits
    for the record and compares, instead of recording its own."""
    import optuna

    from fl_lightning.sweep import study as study_module
    from fl_lightning.sweep.spec import read_sweep
    from fl_lightning.sweep.storage import open_or_create_study
    from fl_lightning.sweep.study import STUDY_KEY, check_definition, definition, running

    argv, storage = _two_sweeps(tmp_path)
    spec = {
        n: read_sweep(argv[n][2], [], storage=storage, study_name="shared", output_dir=str(tmp_path / n)) for n in argv
    }
    made, created = open_or_create_study(spec["lr"])  # the maker, not yet recorded
    second, second_created = open_or_create_study(spec["batch"])
    assert created and not second_created
    waiting, real_sleep = threading.Event(), time.sleep

    def sleep(seconds):  # the second command found no definition and waits for one
        waiting.set()
        real_sleep(seconds)

    monkeypatch.setattr(study_module, "time", SimpleNamespace(monotonic=time.monotonic, sleep=sleep))

    def record_once_the_second_waits():
        assert waiting.wait(timeout=600)
        check_definition(made, spec["lr"], definition(spec["lr"]), print, created)

    with running(made):
        maker = threading.Thread(target=record_once_the_second_waits)
        maker.start()
        _running_as(monkeypatch, f"{socket.gethostname()}:{os.getpid() + 1}")
        try:
            with pytest.raises(ConfigError, match="is being run by another flrun sweep"):
                check_definition(second, spec["batch"], definition(spec["batch"]), print, second_created)
        finally:
            waiting.set()
            maker.join(timeout=600)
            monkeypatch.undo()
    recorded = optuna.load_study(study_name="shared", storage=storage).user_attrs[STUDY_KEY]
    assert set(recorded["parameters"]) == {"training.optimizer.init_args.lr"}


# One process opening a new SQLite study database, started with others at once. Optuna checks every table, then makes
# the missing ones: the first check sleeps a second, so that every process finds the tables missing (as two sweeps
# started together may); then all but one would fail on "table ... already exists" unless they take turns. `plain`
# opens the database as optuna-dashboard does, without the sweep's lock.
_OPEN_AT_ONCE = """
import sys, time
from pathlib import Path

from sqlalchemy.dialects.sqlite.base import SQLiteDialect

database, ready, count, kind = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
has_table, slept = SQLiteDialect.has_table, []

def checked_slowly(self, *args, **kwargs):
    found = has_table(self, *args, **kwargs)
    if not found and not slept:
        slept.append(True)
        time.sleep(1)
    return found

SQLiteDialect.has_table = checked_slowly
import optuna
from fl_lightning.sweep.spec import SweepSpec
from fl_lightning.sweep.storage import open_or_create_study

(ready / sys.argv[5]).touch()
end = time.monotonic() + 600
while len(list(ready.iterdir())) < count and time.monotonic() < end:
    time.sleep(0.01)
url = f"sqlite:///{database}"
if kind == "plain":
    optuna.storages.RDBStorage(url)
else:
    spec = SweepSpec(base="b.yaml", parameters={}, metric="global/test_acc", storage=url, study_name="s")
    print("made" if open_or_create_study(spec)[1] else "opened")
"""


def test_processes_that_open_a_new_sqlite_study_database_at_once_all_open_it(tmp_path):
    ready = tmp_path / "ready"
    ready.mkdir()
    database = tmp_path / "sweep" / "study.db"
    kinds = ["sweep", "sweep", "sweep", "plain"]
    processes = [
        subprocess.Popen(
            [sys.executable, "-c", _OPEN_AT_ONCE, str(database), str(ready), str(len(kinds)), kind, str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
        )
        for i, kind in enumerate(kinds)
    ]
    results = [(p.communicate(timeout=600), p.returncode) for p in processes]
    sweeps = [(out.strip(), err) for ((out, err), code), kind in zip(results, kinds) if kind == "sweep"]
    assert all(out in ("made", "opened") for out, _ in sweeps), [err for _, err in sweeps]
    assert sorted(out for out, _ in sweeps) == ["made", "opened", "opened"]  # one study, made once
    assert sorted(path.name for path in database.parent.iterdir()) == ["study.db"]  # the lock file removed


# ---------------------------------------------------------------------------------------------- ranks the machine holds
def test_more_cpu_ranks_than_cores_are_refused_before_any_starts(tmp_path, capsys):
    cores = len(os.sched_getaffinity(0))
    recipe = write_recipe(tmp_path / "r.yaml", runtime={"progress": False, "accelerator": "cpu"})
    capsys.readouterr()
    code = run_cli(
        "fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run"), "--runtime.devices", str(cores + 1)
    )
    assert code == 2
    message = _one_line(capsys.readouterr().err)
    assert f"runtime.devices {cores + 1} would start {cores + 1} CPU ranks" in message
    assert f"may use {cores} core" in message and f"set runtime.devices at most {cores}" in message
    assert not (tmp_path / "run").exists()


def test_ranks_the_free_memory_cannot_hold_are_refused_before_any_starts(tmp_path, capsys, monkeypatch):
    from fl_lightning.distributed import capacity

    assert capacity.process_memory() > 100 * capacity.MB  # this process has imported torch: a rank holds as much
    monkeypatch.setattr(capacity, "usable_cores", lambda: 64)
    # room for three and a half ranks of what this process holds when the launcher asks
    monkeypatch.setattr(capacity, "available_memory", lambda: int(3.5 * capacity.process_memory()))
    recipe = write_recipe(tmp_path / "r.yaml", runtime={"progress": False, "accelerator": "cpu"})
    capsys.readouterr()
    code = run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run"), "--runtime.devices", "4")
    assert code == 2
    message = _one_line(capsys.readouterr().err)
    assert "runtime.devices 4 would start 4 ranks of at least" in message and "set runtime.devices at most 3" in message
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------------------ children end with parents
_PARENT = """
import os, subprocess, sys, time
from fl_lightning.distributed.gpu_share import as_child
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=as_child(dict(os.environ)))
print(child.pid, flush=True)
time.sleep(600)
"""
_CHILD = """
import sys, time
from fl_lightning.distributed import gpu_share
if {fallback}:
    gpu_share.end_with_parent = lambda: None  # a system without a parent-death signal: the watcher alone
gpu_share.follow_parent()
print("following", flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_until_gone(pids, seconds: float = 120) -> list[int]:
    """Polls until every process of ``pids`` has ended; returns those still alive at the deadline."""
    end = time.monotonic() + seconds
    while any(map(_alive, pids)) and time.monotonic() < end:
        time.sleep(0.2)
    return [pid for pid in pids if _alive(pid)]


@pytest.mark.parametrize("fallback", [False, True], ids=["death signal", "watcher alone"])
def test_a_child_process_ends_when_its_parent_is_killed(tmp_path, fallback):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child_code = _CHILD.format(fallback=fallback)
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT, child_code], env=env, stdout=subprocess.PIPE, text=True, cwd=tmp_path
    )
    child = int(parent.stdout.readline())
    try:
        assert parent.stdout.readline().strip() == "following"  # the child's line, on the same pipe
        parent.kill()  # SIGKILL: the parent can do nothing for its child
        parent.wait(timeout=60)
        assert _wait_until_gone([child]) == [], "the child outlived its killed parent"
    finally:
        if _alive(child):
            os.kill(child, signal.SIGKILL)
        parent.stdout.close()


def test_a_child_whose_parent_died_before_it_could_follow_ends_at_once(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FLRUN_PARENT_PID": "1"}  # not its parent: as if it had died
    code = "from fl_lightning.distributed.gpu_share import follow_parent; follow_parent(); print('went on')"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGTERM and "went on" not in done.stdout


def _little_memory(monkeypatch, processes: float) -> None:
    """The machine has room for ``processes`` processes of what this one holds (whenever it is asked)."""
    from fl_lightning.distributed import capacity

    monkeypatch.setattr(capacity, "available_memory", lambda: int(processes * capacity.process_memory()))


def test_sweep_workers_the_free_memory_cannot_hold_are_refused_before_any_starts(tmp_path, capsys, monkeypatch):
    argv, _ = _two_sweeps(tmp_path)
    _little_memory(monkeypatch, 1.5)
    capsys.readouterr()
    assert run_cli(*argv["lr"], "--n_jobs", "4") == 2  # the study has two open trials: two workers would start
    message = _one_line(capsys.readouterr().err)
    assert "--n_jobs 2 would start 2 worker processes of at least" in message and "set --n_jobs at most 1" in message
    assert not list((tmp_path / "lr").glob("trial_*"))


def test_table_runs_the_free_memory_cannot_hold_are_refused_before_any_starts(tmp_path, capsys, monkeypatch):
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    reference = {"paper": "paper-9", "table": "Table 1", "row": "digits", "column": "A"}
    write_recipe(recipes / "mlp.yaml", rounds=2, reference={**reference, "metrics": {"global/test_acc": 0.9}})
    _little_memory(monkeypatch, 2.5)
    capsys.readouterr()
    argv = ["table", "paper-9/table-1", "--recipes", str(recipes), "--runs", str(tmp_path / "runs"), "--n_jobs", "4"]
    assert run_cli(*argv) == 2  # three seeds: three runs would start
    message = _one_line(capsys.readouterr().err)
    assert "--n_jobs 3 would start 3 run processes of at least" in message and "set --n_jobs at most 2" in message
    assert not (tmp_path / "runs").exists()
