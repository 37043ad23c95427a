"""flrun table: the runs of a paper table from its recipes, on tiny digits recipes of a made-up table."""

import itertools
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import read_summary, run_cli, write_recipe

from fl_lightning.sweep.table import plan


def reference(column, metric="global/test_acc", value=0.9):
    return {
        "paper": "paper-9 (a test)",
        "table": "Table 1",
        "row": "digits",
        "column": column,
        "metrics": {metric: value},
    }


@pytest.fixture
def recipes(tmp_path):
    """Two methods of paper-9's Table 1, and a third cell that is the first method's experiment again."""
    folder = tmp_path / "recipes"
    folder.mkdir()
    write_recipe(folder / "mlp_a.yaml", rounds=2, eval_every=2, reference=reference("A"))
    changes = {"rounds": 2, "eval_every": 2, "reference": reference("B")}
    changes["training"] = {**yaml.safe_load((folder / "mlp_a.yaml").read_text())["training"], "local_steps": 3}
    write_recipe(folder / "mlp_b.yaml", **changes)
    (folder / "mlp_a_again.yaml").write_text(yaml.safe_dump({"base": "mlp_a.yaml", "reference": reference("A2")}))
    write_recipe(folder / "other_table.yaml", rounds=2, reference={**reference("X"), "table": "Table 2"})
    return folder


def table_command(recipes, runs, *args, env=None):
    command = [sys.executable, "-m", "fl_lightning", "table", "paper-9/table-1", "--recipes", str(recipes)]
    command += ["--runs", str(runs), *args]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600, check=False)


def test_the_plan_runs_each_experiment_once_at_every_seed(recipes, tmp_path):
    runs = plan("paper-9/table-1", [0, 3], tmp_path / "runs", recipes)
    # mlp_a_again is mlp_a's experiment (base + reference only): its cell is filled by mlp_a's runs
    assert [(r.recipe.name, r.seed) for r in runs] == [
        ("mlp_a.yaml", 0),
        ("mlp_a.yaml", 3),
        ("mlp_b.yaml", 0),
        ("mlp_b.yaml", 3),
    ]
    assert runs[1].output_dir == tmp_path / "runs" / "paper-9" / "mlp_a" / "seed3"
    assert runs[1].log == tmp_path / "runs" / "paper-9" / "mlp_a" / "seed3.log"
    assert {r.state([]) for r in runs} == {"new"}
    # a table whose cell is a base-only recipe of another table's: the recipe of its own runs, in the same place
    (recipes / "again_t2.yaml").write_text(
        yaml.safe_dump({"base": "mlp_b.yaml", "reference": {**reference("B"), "table": "Table 2"}})
    )
    other = plan("paper-9/table-2", [0], tmp_path / "runs", recipes)
    assert [(r.recipe.name, r.output_dir.parent.name) for r in other] == [
        ("mlp_b.yaml", "mlp_b"),
        ("other_table.yaml", "other_table"),
    ]


@pytest.mark.parametrize(
    ("table", "seeds", "message"),
    [
        ("paper-9/table-7", [0], "no recipe in"),
        ("paper-9/table-1", [1, 1], "--seeds must list distinct seeds"),
        ("paper-9/table-1", [-1], "--seeds must list distinct seeds of 0 or more"),
    ],
)
def test_an_unknown_table_or_repeated_seeds_are_refused(recipes, tmp_path, capsys, table, seeds, message):
    argv = ["table", table, "--recipes", str(recipes), "--runs", str(tmp_path), "--seeds", *map(str, seeds)]
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    if table == "paper-9/table-7":
        assert "known tables: paper-9/table-1, paper-9/table-2." in err


@pytest.mark.slow  # flrun fit processes, each importing the stack
def test_runs_spread_over_the_gpus_finish_the_table_and_a_second_call_runs_nothing(recipes, tmp_path):
    runs = tmp_path / "runs"
    # two "GPUs" by UUID, which CUDA finds nowhere (the recipes train on the CPU): the two runs at a time must be
    # given one each (indices would be cut to the GPUs a GPU machine has)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="GPU-fake0,GPU-fake1")
    done = table_command(recipes, runs, "--seeds", "0", "1", "--n_jobs", "2", env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 of 4 runs done; 4 to run" in done.stdout and "[4/4]" in done.stdout
    folder = runs / "paper-9"
    summaries = {(r, s): read_summary(folder / r / f"seed{s}") for r in ("mlp_a", "mlp_b") for s in (0, 1)}
    assert all(summary["complete"] and summary["rounds"] == 2 for summary in summaries.values())
    assert summaries["mlp_a", 0]["final"] != summaries["mlp_a", 1]["final"]  # seeds differ
    first_two = [summaries["mlp_a", 0], summaries["mlp_a", 1]]  # started together
    assert sorted(s["hardware"]["cuda_visible_devices"] for s in first_two) == ["GPU-fake0", "GPU-fake1"]
    # cells A and A2 (one experiment) each count mlp_a's two runs
    assert (folder / "table-1.html").is_file() and "3 cells, 6 runs" in done.stdout
    again = table_command(recipes, runs, "--seeds", "0", "1", env=env)
    assert again.returncode == 0 and "4 of 4 runs done; 0 to run" in again.stdout and "started" not in again.stdout
    # the same runs as one at a time in this process would give
    assert (
        run_cli("fit", "--config", str(recipes / "mlp_b.yaml"), "--seed", "1", "--output_dir", str(tmp_path / "one"))
        == 0
    )
    assert read_summary(tmp_path / "one")["final"] == summaries["mlp_b", 1]["final"]


@pytest.mark.slow  # flrun fit processes
def test_an_interrupted_run_resumes_and_a_failing_one_is_reported(recipes, tmp_path):
    runs = tmp_path / "runs"
    seed0 = runs / "paper-9" / "mlp_a" / "seed0"
    argv = ["fit", "--config", str(recipes / "mlp_a.yaml"), "--output_dir", str(seed0), "--stop_after", "1"]
    assert run_cli(*argv) == 0 and not read_summary(seed0)["complete"]
    assert [r.state([]) for r in plan("paper-9/table-1", [0], runs, recipes)] == ["resume", "new"]
    done = table_command(recipes, runs, "--seeds", "0")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "mlp_a seed 0: started (resume)" in done.stdout
    whole = ["fit", "--config", str(recipes / "mlp_a.yaml"), "--output_dir", str(tmp_path / "whole")]
    assert run_cli(*whole) == 0  # the resumed run ends where an uninterrupted one does
    assert read_summary(seed0)["complete"] and read_summary(seed0)["final"] == read_summary(tmp_path / "whole")["final"]
    # a value every run refuses: each fails with flrun fit's sentence, the table is still written, exit 1
    failed = table_command(recipes, tmp_path / "bad", "--seeds", "0", "--", "--training.batch_size", "0")
    assert failed.returncode == 1
    assert failed.stderr.count("failed: flrun fit: error: training.batch_size must be at least 1") == 2
    assert (tmp_path / "bad" / "paper-9" / "table-1.html").is_file()
    assert [r.state([]) for r in plan("paper-9/table-1", [0], tmp_path / "bad", recipes)] == ["new", "new"]


def fit_processes(run_dir: str) -> list[int]:
    """Live processes whose command line holds ``--output_dir run_dir`` (read from /proc: no pgrep needed)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, ValueError, IndexError):
            continue
        if state != "Z" and any(a == b"--output_dir" and b == run_dir.encode() for a, b in itertools.pairwise(argv)):
            found.append(int(entry.name))
    return found


@pytest.mark.slow  # flrun fit processes
@pytest.mark.parametrize("stop", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_stopped_table_ends_its_runs_and_they_resume_next_time(tmp_path, stop):
    folder = tmp_path / "recipes"
    folder.mkdir()
    # long enough to be stopped in the middle; a checkpoint every 20 rounds
    write_recipe(folder / "long.yaml", rounds=5000, eval_every=5000, checkpoint_every=20, reference=reference("A"))
    runs = tmp_path / "runs"
    command = [sys.executable, "-m", "fl_lightning", "table", "paper-9/table-1", "--recipes", str(folder)]
    process = subprocess.Popen(
        [*command, "--runs", str(runs), "--seeds", "0"],
        stdout=subprocess.PIPE,
        text=True,
        # as from a terminal: a suite started in the background (`cmd &` in a script) ignores SIGINT, which its
        # children would inherit, and Python keeps an ignored SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509 - no threads here
    )
    checkpoint = runs / "paper-9" / "long" / "seed0" / "checkpoints" / "last.ckpt"
    end = time.monotonic() + 120
    while not checkpoint.is_file() and time.monotonic() < end:
        time.sleep(0.2)
    assert checkpoint.is_file()
    run_dir = str(checkpoint.parents[1])
    assert fit_processes(run_dir)  # the run's flrun fit, found
    process.send_signal(stop)
    # SIGKILL leaves no clean-up to the command: the kernel ends its runs (PR_SET_PDEATHSIG)
    assert process.wait(timeout=60) == (-9 if stop == signal.SIGKILL else 130)
    end = time.monotonic() + 30
    while fit_processes(run_dir) and time.monotonic() < end:
        time.sleep(0.2)
    assert not fit_processes(run_dir)  # it ended with the command
    assert [r.state([]) for r in plan("paper-9/table-1", [0], runs, folder)] == ["resume"]


def test_a_complete_run_whose_extension_was_killed_is_resumed_not_counted(recipes, tmp_path, monkeypatch):
    from fl_lightning.run.orchestrator import FederationOrchestrator

    run = plan("paper-9/table-1", [0], tmp_path / "runs", recipes)[0]
    assert run_cli("fit", *run.fit_argv([])) == 0
    assert run.state([]) == "done" and run.state(["--rounds", "6"]) == "changed"

    def killed(self, checkpoint=None):  # as if killed once the extension started: config.yaml says 6 rounds
        raise KeyboardInterrupt

    monkeypatch.setattr(FederationOrchestrator, "run_rounds", killed)
    assert run_cli("fit", *run.fit_argv(["--rounds", "6"])) != 0
    assert "rounds: 6" in (run.output_dir / "config.yaml").read_text() and read_summary(run.output_dir)["complete"]
    # summary.json is the 2-round invocation's: not this recipe's result
    assert run.state(["--rounds", "6"]) == "resume"


@pytest.mark.parametrize("argument", ["--seed", "--output_dir=x", "--resume", "--config"])
def test_fit_arguments_that_would_merge_the_runs_are_refused(recipes, tmp_path, capsys, argument):
    argv = ["table", "paper-9/table-1", "--recipes", str(recipes), "--runs", str(tmp_path), "--", argument, "5"]
    assert run_cli(*argv) == 2
    err = capsys.readouterr().err
    assert f"may not set {argument.split('=')[0]}" in err and len(err.strip().splitlines()) == 1


def test_runs_of_several_ranks_are_refused_when_each_run_gets_one_gpu(recipes, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-fake0,GPU-fake1")
    argv = ["table", "paper-9/table-1", "--recipes", str(recipes), "--runs", str(tmp_path / "runs"), "--n_jobs", "2"]
    assert run_cli(*argv, "--", "--runtime.devices", "2") == 2
    err = capsys.readouterr().err
    assert "mlp_a.yaml runs with runtime.devices 2, but with --n_jobs 2 each run is given one GPU" in err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "runs").exists()  # nothing was started


@pytest.mark.slow  # flrun fit processes
def test_a_complete_run_is_done_only_for_the_same_arguments_and_a_locked_one_is_left_alone(recipes, tmp_path):
    runs = tmp_path / "runs"
    short = table_command(recipes, runs, "--seeds", "0", "--", "--rounds", "1", "--eval_every", "1")
    assert short.returncode == 0, short.stdout + short.stderr
    assert [r.state(["--rounds", "1", "--eval_every", "1"]) for r in plan("paper-9/table-1", [0], runs, recipes)] == [
        "done",
        "done",
    ]
    # without the arguments the 1-round runs are not what the table asks for: not counted as done
    assert [r.state([]) for r in plan("paper-9/table-1", [0], runs, recipes)] == ["changed", "changed"]
    seed0 = plan("paper-9/table-1", [0], runs, recipes)[0]
    with seed0.log.open("a") as held:  # as a run of another flrun table still going
        import fcntl

        fcntl.flock(held, fcntl.LOCK_EX)
        full = table_command(recipes, runs, "--seeds", "0")
    assert full.returncode == 1 and "mlp_a seed 0: in use by another process; not started" in full.stdout
    # the other is started and flrun fit refuses to continue it with another eval_every: reported, not counted
    assert "mlp_b seed 0: failed" in full.stdout and "the recipe changed eval_every (1 -> 2)" in full.stdout
    assert read_summary(runs / "paper-9" / "mlp_b" / "seed0")["rounds"] == 1
    assert full.stdout.splitlines()[-1].startswith("paper-9/table-1: 3 cells, 0 runs")


def test_a_dry_run_counts_the_runs_estimates_their_time_and_names_missing_data(recipes, tmp_path, capsys):
    from fl_lightning.tracking.progress import duration

    nodata = tmp_path / "nodata"
    cifar = {"class_path": "fl_lightning.data.Cifar10Data", "init_args": {"data_dir": str(nodata)}}
    write_recipe(recipes / "cifar.yaml", rounds=2, data=cifar, reference=reference("C"))
    runs = tmp_path / "runs"
    argv = ["table", "paper-9/table-1", "--recipes", str(recipes), "--runs", str(runs), "--dry_run"]
    assert run_cli(*argv, "--seeds", "0", "1") == 0
    out = capsys.readouterr().out.splitlines()
    assert len([line for line in out if "seed" in line.split("  ")[-1] or "(data missing)" in line]) == 6
    assert [line for line in out if "(data missing)" in line] == [
        f"    new  cifar seed {s}  {runs / 'paper-9' / 'cifar' / f'seed{s}'}  (data missing)" for s in (0, 1)
    ]
    assert "6 runs: 0 done, 6 to run (6 new)" in out
    assert "time: no estimate, since none of their recipes has a finished run here yet" in out[-2]
    assert out[-1] == (
        f"data missing for 2 of the runs to do (cifar): CIFAR-10, not found in {nodata}; fetch it with "
        f"`flrun data fetch cifar10 --data_dir {nodata}`."
    )
    assert not runs.exists()  # a dry run starts nothing
    # one run of mlp_a finished: its time estimates mlp_a's other seed, and nothing else's
    seed0 = plan("paper-9/table-1", [0], runs, recipes)
    mlp_a = next(run for run in seed0 if run.recipe.stem == "mlp_a")
    assert run_cli("fit", *mlp_a.fit_argv([])) == 0
    capsys.readouterr()
    assert run_cli(*argv, "--seeds", "0", "1", "--n_jobs", "2") == 0
    out = capsys.readouterr().out.splitlines()
    wall = read_summary(mlp_a.output_dir)["wall_time_s"]
    assert "6 runs: 1 done, 5 to run (5 new)" in out
    assert out[-2] == (
        f"time: about {duration(wall)} for the 1 run whose recipe has a finished run here, about "
        f"{duration(wall / 2)} with --n_jobs 2; no estimate for the other 4 (none of their recipe has finished yet)."
    )


@pytest.fixture
def no_data(recipes, tmp_path, monkeypatch):
    """A third experiment of the table reading CIFAR-10 from an empty folder; starting a run process fails the
    test."""
    nodata = tmp_path / "nodata"
    cifar = {"class_path": "fl_lightning.data.Cifar10Data", "init_args": {"data_dir": str(nodata)}}
    write_recipe(recipes / "cifar.yaml", rounds=2, data=cifar, reference=reference("C"))

    def no_process(*args, **kwargs):
        raise AssertionError("a run was started")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    return nodata


def test_a_table_whose_data_are_missing_is_refused_before_any_run_starts(recipes, tmp_path, capsys, no_data):
    runs = tmp_path / "runs"
    argv = ["table", "paper-9/table-1", "--recipes", str(recipes), "--runs", str(runs), "--seeds", "0", "1"]
    assert run_cli(*argv, "--n_jobs", "2") == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        "flrun table: error: no run was started: 2 of the 6 runs to do lack their data: CIFAR-10 (2 runs) is not in "
        f"{no_data}; get it with `flrun data fetch cifar10 --data_dir {no_data}` on a machine with internet, then "
        "copy the data folder here, or run the other 4 with --skip_missing; --dry_run lists the runs."
    )
    assert not runs.exists()


def test_skip_missing_runs_only_the_runs_whose_data_are_there(recipes, tmp_path, capsys, no_data, monkeypatch):
    from fl_lightning.sweep import table

    started = []
    monkeypatch.setattr(table, "run_all", lambda runs, *args, **kwargs: (started.extend(runs), ([], []))[1])
    argv = ["table", "paper-9/table-1", "--recipes", str(recipes), "--runs", str(tmp_path / "runs"), "--seeds", "0"]
    assert run_cli(*argv, "--skip_missing") == 0
    assert [run.name for run in started] == ["mlp_a seed 0", "mlp_b seed 0"]
    out = capsys.readouterr().out
    assert out.startswith(
        f"skipping 1 of the 3 runs to do, whose data are missing: CIFAR-10 (1 run) is not in {no_data};"
    )
    assert out.splitlines()[-1] == "1 runs skipped: their data are missing (--dry_run lists them)"


def test_data_the_recipes_download_are_fetched_once_before_the_runs(recipes, tmp_path, capsys, no_data, monkeypatch):
    from fl_lightning.data import catalog, sources
    from fl_lightning.data.download import NetworkError
    from fl_lightning.sweep import table

    recipe = yaml.safe_load((recipes / "cifar.yaml").read_text())
    recipe["data"]["init_args"]["download"] = True
    (recipes / "cifar.yaml").write_text(yaml.safe_dump(recipe))
    fetched = []

    def offline(name, data_dir, *args, **kwargs):
        fetched.append(name)
        raise NetworkError("https://example.invalid/cifar", OSError("Name or service not known"))

    monkeypatch.setattr(sources, "fetch", offline)
    argv = ["table", "paper-9/table-1", "--recipes", str(recipes), "--runs", str(tmp_path / "runs")]
    assert run_cli(*argv, "--seeds", "0", "1") == 2
    err = capsys.readouterr().err
    assert fetched == ["cifar10"]  # once for both seeds
    assert f"CIFAR-10 (2 runs) is not in {no_data} and could not be downloaded (OSError: " in err
    assert "Name or service not known" in err

    def online(name, data_dir, *args, **kwargs):  # the files where the loader looks for them
        for pattern in catalog.source(name).expected:
            (Path(data_dir) / pattern).parent.mkdir(parents=True, exist_ok=True)
            (Path(data_dir) / pattern).touch()

    monkeypatch.setattr(sources, "fetch", online)
    started = []
    monkeypatch.setattr(table, "run_all", lambda runs, *args, **kwargs: (started.extend(runs), ([], []))[1])
    assert run_cli(*argv, "--seeds", "0") == 0
    assert [run.name for run in started] == ["cifar seed 0", "mlp_a seed 0", "mlp_b seed 0"]
    assert "CIFAR-10: not in " in capsys.readouterr().out
