"""Edge cases at the borders of a run: nothing a user has is replaced, and each ends in one sentence naming its
cause (a folder's results without a checkpoint, another run's checkpoint, a tensor of another shape, a name that
would leave its folder, a file that is not a file, a misspelled choice, an output that cannot be written, a study
that cannot run, concurrent sweep workers)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import run_cli, write_recipe

FAST = {"rounds": 2, "eval_every": 1}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> dict[str, Path]:
    """Two finished runs of one recipe with another learning rate each, and their recipes."""
    root = tmp_path_factory.mktemp("two_runs")
    recipes = {}
    for key, lr in (("a", 0.1), ("b", 0.05)):
        training = {
            "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": lr, "momentum": 0.9}},
            "local_steps": 5,
            "batch_size": 16,
        }
        recipes[key] = write_recipe(root / f"{key}.yaml", training=training, **FAST)
        assert run_cli("fit", "--config", str(recipes[key]), "--output_dir", str(root / key.upper())) == 0
    return {"root": root, "A": root / "A", "B": root / "B", "a": recipes["a"], "b": recipes["b"]}


def _copy(run: Path, to: Path) -> Path:
    shutil.copytree(run, to)
    return to


# ---------------------------------------------------------------------------------------------- run folders
@pytest.mark.parametrize("resume", [[], ["--resume", "auto"]], ids=["fresh", "resume_auto"])
def test_results_without_a_checkpoint_are_never_replaced_by_a_fresh_start(tmp_path, capsys, two_runs, resume):
    run = _copy(two_runs["A"], tmp_path / "run")
    shutil.rmtree(run / "checkpoints")  # deleted to save space
    before = _tree(run)
    capsys.readouterr()
    assert run_cli("fit", "--config", str(two_runs["b"]), "--output_dir", str(run), *resume) == 2
    message = _one_line(capsys)
    assert "holds a run's results (metrics.csv, summary.json) but no checkpoints/last.ckpt" in message
    assert "another --output_dir" in message and "--resume PATH" in message
    assert _tree(run) == before
    (run / "summary.json").unlink()  # metrics.csv alone (a run stopped before its first checkpoint) is kept too
    assert run_cli("fit", "--config", str(two_runs["a"]), "--output_dir", str(run), *resume) == 2
    assert "(metrics.csv)" in _one_line(capsys)


def test_another_runs_last_ckpt_under_resume_auto_is_named_as_such(tmp_path, capsys, two_runs):
    run = _copy(two_runs["A"], tmp_path / "run")
    shutil.copyfile(two_runs["B"] / "checkpoints/last.ckpt", run / "checkpoints/last.ckpt")
    before = _tree(run)
    capsys.readouterr()
    argv = ["fit", "--config", str(two_runs["a"]), "--output_dir", str(run), "--rounds", "3", "--resume", "auto"]
    assert run_cli(*argv) == 2
    message = _one_line(capsys)
    assert "--resume auto:" in message and "is another run's checkpoint" in message and "run.json" in message
    assert _tree(run) == before


def test_a_checkpoint_sealed_again_with_a_tensor_of_another_shape_is_refused_naming_it(tmp_path, capsys, two_runs):
    import torch

    from fl_lightning.run.checkpoint import load_checkpoint, save_checkpoint

    run = _copy(two_runs["A"], tmp_path / "run")
    last = run / "checkpoints/last.ckpt"
    state = load_checkpoint(last)
    del state["loaded_from"]
    state["strategy"]["global_weights"]["global"]["head.weight"] = torch.zeros(10, 31)
    save_checkpoint(last, state)  # a valid checksum over the edited content
    before = _tree(run)
    capsys.readouterr()
    argv = ["fit", "--config", str(two_runs["a"]), "--output_dir", str(run), "--rounds", "3", "--resume", "auto"]
    assert run_cli(*argv) == 2
    message = _one_line(capsys)
    assert "strategy/global_weights/global/head.weight of shape [10, 31]" in message
    assert "sets it up with shape [10, 32]" in message
    assert _tree(run) == before


# ------------------------------------------------------------------------------------ names that become folders
@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ""])
@pytest.mark.parametrize("ranks", [[], ["--runtime.devices", "2"]], ids=["fit", "launcher"])
def test_a_run_name_must_be_one_folder_name(tmp_path, capsys, monkeypatch, name, ranks):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    work = tmp_path / "deep/work"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert run_cli("fit", "--config", str(recipe), "--name", name, *ranks) == 2
    message = _one_line(capsys)
    assert f"--name {name!r}" in message and "must be a single folder name" in message, message
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["deep", "r.yaml", "work"]  # nothing written anywhere


def test_with_an_output_dir_a_name_only_names_the_run(tmp_path):  # a sweep's trials are called study/trial_0000
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    assert run_cli("fit", "--config", str(recipe), "--name", "s/t", "--output_dir", str(tmp_path / "o")) == 0
    assert json.loads((tmp_path / "o/summary.json").read_text())["name"] == "s/t"


def _sweep_file(folder: Path, **changes) -> Path:
    recipe = write_recipe(folder / "base.yaml", **FAST)
    sweep = {
        "base": recipe.name,
        "metric": "global/test_acc",
        "n_trials": 1,
        "parameters": {"training.optimizer.init_args.lr": {"type": "float", "low": 0.01, "high": 0.1}},
        **changes,
    }
    import yaml

    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(sweep))
    return path


@pytest.mark.parametrize("name", ["../x", "a/b", "", "."])
def test_a_study_name_must_be_one_folder_name(tmp_path, capsys, monkeypatch, name):
    sweep = _sweep_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert run_cli("sweep", "--config", str(sweep), "--study_name", name) == 2
    message = _one_line(capsys)
    assert f"study_name {name!r}" in message and "runs/sweeps/<name>" in message, message
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------------------------------------- sweeps
def test_a_sweep_into_a_runs_folder_is_refused_and_the_run_still_resumes(tmp_path, capsys, two_runs):
    run = _copy(two_runs["A"], tmp_path / "run")
    before = _tree(run)
    sweep = _sweep_file(tmp_path)
    capsys.readouterr()
    assert run_cli("sweep", "--config", str(sweep), "--output_dir", str(run)) == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("flrun sweep: error: --output_dir") and "holds a run of flrun fit" in message
    assert _tree(run) == before


def test_a_study_in_memory_is_refused_for_worker_processes(tmp_path, capsys, monkeypatch):
    sweep = _sweep_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    for storage in ("sqlite:///:memory:", "sqlite://"):
        assert run_cli("sweep", "--config", str(sweep), "--storage", storage, "--n_jobs", "2") == 2
        message = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"--storage {storage} keeps the study in this process's memory" in message, message
        assert "the 2 worker processes" in message
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize(
    ("fit_args", "expect"),
    [(["--rounds", "0"], "rounds must be at least 1, got 0"), (["--eval_every", "0"], "eval_every must be at least 1")],
)
def test_fit_arguments_no_trial_can_run_are_refused_before_the_study_starts(
    tmp_path, capsys, monkeypatch, fit_args, expect
):
    sweep = _sweep_file(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert run_cli("sweep", "--config", str(sweep), "--", *fit_args) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "the fit arguments after --" in message and expect in message, message
    assert not (tmp_path / "runs").exists()  # no study, no trial


# ---------------------------------------------------------------------------------------------- hostile paths
def test_a_sweeps_base_that_is_a_fifo_is_named_as_such(tmp_path, capsys):
    import os

    sweep = _sweep_file(tmp_path)
    (tmp_path / "base.yaml").unlink()
    os.mkfifo(tmp_path / "base.yaml")  # never opened: a reader would wait for a writer forever
    assert run_cli("sweep", "--config", str(sweep)) == 2
    message = _one_line(capsys)
    assert "base.yaml (base: base.yaml in" in message and "is not a regular file (a named pipe, FIFO)" in message
    assert "does not exist" not in message


@pytest.mark.parametrize("command", ["fit", "sweep"])
@pytest.mark.parametrize("kind", ["FIFO", "latin-1"])
def test_a_recipe_or_sweep_file_that_is_a_fifo_or_not_utf8_is_named_as_such(tmp_path, capsys, command, kind):
    import os

    path = tmp_path / "given.yaml"
    if kind == "FIFO":
        os.mkfifo(path)
        said = "is not a regular file (a named pipe, FIFO)"
    else:
        path.write_bytes("# caf\u00e9 recipe\nrounds: 3\n".encode("latin-1"))
        said = "is not a text (YAML) file: byte 0xe9 at offset 5 is not UTF-8"
    assert run_cli(command, "--config", str(path)) == 2
    message = _one_line(capsys)
    assert said in message and "given.yaml" in message, message


# ---------------------------------------------------------------------------------------------- misspelled choices
@pytest.mark.parametrize(
    ("changes", "said"),
    [
        ({"direction": "maximise"}, "direction 'maximise' in the sweep file is not one of maximize, minimize "
         "(did you mean 'maximize'?)."),
        ({"use": "later"}, "use 'later' in the sweep file is not one of best, final."),
        ({"sampler": {"name": "tpee"}}, "sampler.name 'tpee' in the sweep file is not one of tpe, random "
         "(did you mean 'tpe'?)."),
        ({"sampler": {"name": "cmaes2"}}, "sampler.name 'cmaes2' in the sweep file is not one of tpe, random."),
        ({"pruner": {"name": "HyperBand"}}, "pruner.name 'HyperBand' in the sweep file is not one of median, "
         "hyperband, none (did you mean 'hyperband'?)."),
        ({"pruner": "median"}, "pruner must be a mapping, e.g. pruner: {name: median}, got 'median'."),
    ],
)  # fmt: skip
def test_a_misspelled_choice_names_the_key_the_value_and_the_closest_choice(tmp_path, capsys, changes, said):
    sweep = _sweep_file(tmp_path, **changes)
    assert run_cli("sweep", "--config", str(sweep)) == 2
    assert _one_line(capsys) == f"flrun sweep: error: {said}"


def test_bad_choice_offers_only_a_close_choice():
    from fl_lightning.federation.errors import bad_choice

    assert str(bad_choice("k", "Tpe", ("tpe", "random"))) == "k 'Tpe' is not one of tpe, random (did you mean 'tpe'?)."
    assert str(bad_choice("k", 3, ("tpe", "random"))) == "k '3' is not one of tpe, random."


# ------------------------------------------------------------------------------------------ the command's own output
def _flrun(args: list[str], cwd: Path, stdout, **env: str):
    import os
    import subprocess
    import sys

    from conftest import ROOT

    environment = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.run(
        [sys.executable, "-m", "fl_lightning", *args], cwd=cwd, stdout=stdout, stderr=subprocess.PIPE, env=environment,
        timeout=300, text=True,
    )  # fmt: skip


@pytest.mark.parametrize("command", [["models"], ["fit", "--json"]], ids=["models", "fit"])
def test_an_output_that_cannot_be_written_is_one_sentence_without_resume_advice(tmp_path, command):
    if not Path("/dev/full").exists():
        pytest.skip("no /dev/full on this system")
    args = [*command, "--config", str(write_recipe(tmp_path / "r.yaml", **FAST)), "--output_dir", str(tmp_path / "o")]
    with open("/dev/full", "w") as full:
        done = _flrun(args if command[0] == "fit" else command, tmp_path, full)
    lines = [line for line in done.stderr.splitlines() if line.startswith("flrun")]
    assert done.returncode == 2 and "Traceback" not in done.stderr and "Exception ignored" not in done.stderr
    assert lines == [
        f"flrun {command[0]}: error: its output could not be written to stdout (No space left on device); free space "
        "on its disk, or send the output elsewhere."
    ]
    if command[0] == "fit":  # the run itself is complete
        assert json.loads((tmp_path / "o/summary.json").read_text())["complete"] is True


def test_characters_the_output_cannot_encode_are_escaped(tmp_path):
    import subprocess

    args = [
        "fit",
        "--config",
        str(write_recipe(tmp_path / "r.yaml", **FAST)),
        "--output_dir",
        str(tmp_path / "run\u00e9"),
    ]
    done = _flrun(args, tmp_path, subprocess.PIPE, PYTHONIOENCODING="ascii")
    assert done.returncode == 0, done.stderr
    assert f"run folder: {tmp_path}/run\\xe9" in done.stdout
