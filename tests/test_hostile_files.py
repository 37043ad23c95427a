"""Hostile or broken files and environments: nothing a user has is overwritten, and every case ends in one sentence
(exit status 2, or the signal's), in bounded time and memory, never a traceback or a silently wrong result.

The one-sentence cases that need no more than a file are rows of test_bad_inputs.py; these need a run, several
processes, a symbolic link, a FIFO or a check of what is on disk afterwards.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, TINY, read_summary, run_cli, write_recipe

FAST = {"rounds": 4, "eval_every": 1}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert len(lines[0]) < 700, lines[0][:300]  # no message quotes more than a few hundred characters of input
    return lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (what must stay as it was)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _final(run: Path) -> dict:
    return read_summary(run)["final"]


# ---------------------------------------------------------------------------------------------- run directories
def test_resuming_another_runs_checkpoint_into_a_run_directory_is_refused_and_changes_nothing(tmp_path, capsys):
    a = write_recipe(tmp_path / "a.yaml", **FAST)
    b = write_recipe(tmp_path / "b.yaml", **{**FAST, "seed": 3})
    assert run_cli("fit", "--config", str(a), "--output_dir", str(tmp_path / "A")) == 0
    assert run_cli("fit", "--config", str(b), "--output_dir", str(tmp_path / "B")) == 0
    before = _tree(tmp_path / "A")
    capsys.readouterr()
    other = str(tmp_path / "B/checkpoints/last.ckpt")
    assert (
        run_cli("fit", "--config", str(b), "--rounds", "6", "--resume", other, "--output_dir", str(tmp_path / "A")) == 2
    )
    message = _one_line(capsys)
    assert "holds another run" in message and "new --output_dir" in message
    assert _tree(tmp_path / "A") == before
    # into a new directory the same resume continues a copy of B there
    assert (
        run_cli("fit", "--config", str(b), "--rounds", "6", "--resume", other, "--output_dir", str(tmp_path / "C")) == 0
    )
    assert read_summary(tmp_path / "C")["rounds"] == 6


FOREIGN = {
    "a user's folder": {"config.yaml": b"my settings\n", "metrics.csv": b"day,steps\n1,9000\n", "notes.txt": b"x"},
    "a Lightning log folder": {"metrics.csv": b"epoch,loss\n0,1.0\n", "checkpoints/epoch=0.ckpt.tmp": b"\x00" * 64},
    "a recipes folder": {"quickstart.yaml": (ROOT / "recipes/quickstart.yaml").read_bytes()},
    # Lightning's own last.ckpt is not an flrun run's: the folder is not taken for a run written before run.json
    "a Lightning checkpoint folder": {"hparams.yaml": b"lr: 0.1\n", "checkpoints/last.ckpt": b"PK\x03\x04" + bytes(60)},
}


@pytest.mark.parametrize("kind", FOREIGN)
@pytest.mark.parametrize("resume", [[], ["--resume", "auto"]], ids=["fresh", "resume_auto"])
def test_a_folder_that_holds_no_run_is_never_written(tmp_path, capsys, kind, resume):
    folder = tmp_path / "folder"
    for name, content in FOREIGN[kind].items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    before = _tree(folder)
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(folder), *resume) == 2
    assert "holds no flrun run" in _one_line(capsys)
    assert _tree(folder) == before and not (folder / "run.lock").exists()


def test_a_run_directory_is_marked_and_takes_its_own_checkpoints_even_after_losing_the_mark(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    run = tmp_path / "run"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--stop_after", "2") == 0
    marker = json.loads((run / "run.json").read_text())
    assert marker["kind"] == "flrun fit run directory" and read_summary(run)["run_id"] == marker["run_id"]
    previous = str(run / "checkpoints/previous.ckpt")
    assert (
        run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", previous, "--stop_after", "2")
        == 0
    )
    (run / "run.json").unlink()  # a directory copied without its hidden files, or a run written before markers
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto") == 0
    assert json.loads((run / "run.json").read_text())["run_id"] == marker["run_id"]
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "whole")) == 0
    assert _final(run) == _final(tmp_path / "whole")


def test_run_files_that_are_directories_are_refused_before_anything_is_written(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    run = tmp_path / "run"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--stop_after", "2") == 0
    (run / "run.lock").unlink()
    (run / "run.lock").mkdir()
    before = _tree(run)
    capsys.readouterr()
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto") == 2
    assert "run.lock is a directory" in _one_line(capsys)
    assert _tree(run) == before


# ---------------------------------------------------------------------------------------------- YAML
def _bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "anchors:\n" + "".join(f"  {line}\n" for line in lines)


PROBLEMS = {  # YAML lines added to a file, and what its message says
    "alias bomb": (_bomb(6), "aliases (*name) that stand for"),
    "deep nesting": ("deep: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests deeper than 100 levels"),
    "key given twice": ("seed: 1\nseed: 2\n", "gives the key 'seed' twice"),
}


@pytest.mark.parametrize("where", ["recipe", "base file", "sweep file"])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_hostile_yaml_is_one_sentence_wherever_it_is(tmp_path, capsys, where, problem):
    text, said = PROBLEMS[problem]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**TINY, "rounds": 1}) + (text if where == "recipe" else ""))
    if where == "base file":
        (tmp_path / "shared.yaml").write_text(text)
        recipe.write_text(f"base: shared.yaml\n{recipe.read_text()}")
    if where == "sweep file":
        sweep = tmp_path / "sweep.yaml"
        sweep.write_text(
            f"base: {recipe}\nmetric: global/test_acc\nparameters: {{seed: {{type: int, low: 0, high: 3}}}}\n{text}"
        )
        command = ["sweep", "--config", str(sweep), "--output_dir", str(tmp_path / "sweep")]
    else:
        command = ["fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")]
    assert run_cli(*command) == 2
    message = _one_line(capsys)
    assert said in message and ("shared.yaml" if where == "base file" else Path(command[2]).name) in message
    assert not (tmp_path / "run").exists()


def test_libyaml_s_parser_reads_every_shipped_file_as_pythons_does():
    """Files are parsed by libyaml (when PyYAML has it) under the same checks and scalars; a refused one is read
    again in Python for the message. Both readers give the same values for every recipe, base and sweep file."""
    from fl_lightning.run import safe_yaml

    files = [*(ROOT / "recipes").rglob("*.yaml"), *(ROOT / "sweeps").rglob("*.yaml")]
    assert len(files) > 400
    for path in files:
        text = path.read_text()
        assert yaml.load(text, Loader=safe_yaml._FastLoader) == yaml.load(text, Loader=safe_yaml._Loader), path
    assert yaml.__with_libyaml__ is False or safe_yaml._FastLoader is not safe_yaml._Loader


def test_a_diamond_of_base_files_reads_each_file_once(tmp_path):
    for i in range(30):  # each file builds on the next one twice: 2^30 paths to the last file
        (tmp_path / f"d{i}.yaml").write_text(f"base: [d{i + 1}.yaml, d{i + 1}.yaml]\nk{i}: {i}\n")
    (tmp_path / "d30.yaml").write_text("rounds: 3\n")
    program = (
        "from fl_lightning.run.recipes import base_files, load_recipe; "
        f"r = load_recipe('{tmp_path}/d0.yaml'); print(len(r), len(base_files('{tmp_path}/d0.yaml')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["31", "30"]  # k0..k29 and rounds; d1..d30


BASES = {  # what `base:` names, how to make it, what the message says
    "binary": ("model.ckpt", lambda p: p.write_bytes(bytes(range(256)) * 8), "is not a text (YAML) file"),
    "symlink loop": ("loop.yaml", lambda p: os.symlink(p.name, p), "symbolic link that leads back to itself"),
    "invalid YAML": ("broken.yaml", lambda p: p.write_text("rounds: [1, 2\n"), "is not valid YAML"),
    "python tag": (
        "tag.yaml",
        lambda p: p.write_text("rounds: !!python/object/apply:os.getpid []\n"),
        "remove the tag",
    ),
    "directory": ("shared", lambda p: p.mkdir(), "is a directory"),
    "URL": ("https://example.org/shared.yaml", lambda p: None, "is a URL"),
    "FIFO": ("pipe.yaml", lambda p: os.mkfifo(p), "is not a regular file"),
}


@pytest.mark.parametrize("kind", BASES)
def test_a_base_file_that_is_not_a_recipe_is_named_in_one_sentence(tmp_path, capsys, kind):
    name, make, said = BASES[kind]
    make(tmp_path / name)
    recipe = tmp_path / "variant.yaml"
    recipe.write_text(f"base: {name}\n" + yaml.safe_dump(TINY))
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")) == 2
    message = _one_line(capsys)
    assert said in message and name in message and "variant.yaml" in message


# ---------------------------------------------------------------------------------------------- class paths
def test_a_class_path_outside_the_trusted_modules_is_refused_before_its_module_is_imported(
    tmp_path, capsys, monkeypatch
):
    marker = tmp_path / "imported.txt"
    (tmp_path / "lab_strategies.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("FLRUN_TRUSTED_MODULES", raising=False)
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    argv = ["fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run"), "--strategy", "lab_strategies.Nope"]
    try:
        assert run_cli(*argv) == 2
        message = _one_line(capsys)
        assert "not in a trusted module" in message and "FLRUN_TRUSTED_MODULES=lab_strategies" in message
        assert not marker.exists()
        monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "conftest,lab_strategies")
        assert run_cli(*argv) == 2  # trusted: imported, and the missing class named
        assert "has no attribute 'Nope'" in _one_line(capsys) and marker.exists()
    finally:
        sys.modules.pop("lab_strategies", None)


# ---------------------------------------------------------------------------------------------- the file system
def test_an_output_dir_that_cannot_be_created_is_one_sentence(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", "/proc/flrun/run") == 2
    assert "/proc/flrun" in _one_line(capsys)


def _full_disk_at(monkeypatch, fails):
    """os.fsync raises ENOSPC for the files ``fails(path)`` picks (a disk that fills up while a run writes)."""
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if fails(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def test_a_full_disk_mid_run_is_one_sentence_and_the_run_resumes_to_the_same_numbers(tmp_path, capsys, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "whole")) == 0
    run = tmp_path / "run"
    saves = []
    _full_disk_at(monkeypatch, lambda path: path.endswith("last.ckpt.tmp") and (saves.append(path) or len(saves) > 2))
    capsys.readouterr()
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run)) == 2
    message = _one_line(capsys)
    assert "checkpoints/last.ckpt" in message and "No space left on device" in message and "--resume auto" in message
    assert not list(run.rglob("*.tmp"))  # the failed write took its partial file with it
    from fl_lightning.run.checkpoint import load_checkpoint

    assert load_checkpoint(run / "checkpoints/last.ckpt")["rounds_done"] == 2  # the last good one
    monkeypatch.undo()
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto") == 0
    assert _final(run) == _final(tmp_path / "whole")


def test_a_resume_on_a_full_disk_frees_its_own_leftovers_before_it_writes(tmp_path, capsys, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    run = tmp_path / "run"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--stop_after", "2") == 0
    leftovers = [
        run / "checkpoints/last.ckpt.tmp",
        run / "metrics.csv.tmp",
        run / "checkpoints/clients/3-00000000000000aa-9.pt",
    ]
    for path in leftovers:  # what a run killed while writing, or a save that failed, leaves
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"\x00" * 4096)
    present_at_first_write = []

    def left(path: Path) -> bool:  # the leftover as it was (the first write may be a new file of the same name)
        return path.exists() and path.read_bytes() == b"\x00" * 4096

    _full_disk_at(monkeypatch, lambda path: present_at_first_write.append([left(p) for p in leftovers]) or True)
    capsys.readouterr()
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("resuming ") and len(err) == 2 and "No space left on device" in err[1]
    assert present_at_first_write[0] == [False, False, False]


def test_a_report_written_where_it_cannot_be_is_one_sentence(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")) == 0
    (tmp_path / "afile").write_text("not a folder")
    capsys.readouterr()
    assert run_cli("report", str(tmp_path / "run"), "--output", str(tmp_path / "afile/report.html")) == 2
    assert "afile" in _one_line(capsys)


def _disk_fills_up(monkeypatch, folder: Path, room: int = 64) -> None:
    """Files opened for writing in ``folder`` take ``room`` bytes in all, then a write fails with ENOSPC after
    writing what still fitted: a nearly full disk under whichever open() the writer uses."""
    import builtins
    import io

    real_open, written = io.open, [0]

    class Filling:
        def __init__(self, f):
            self.f = f

        def write(self, data):
            if written[0] + len(data) > room:
                self.f.write(data[: max(room - written[0], 0)])
                self.f.flush()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            written[0] += len(data)
            return self.f.write(data)

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    def filling_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        writes = any(flag in mode for flag in "wax+")
        if writes and isinstance(file, (str, os.PathLike)) and Path(file).resolve().parent == folder.resolve():
            return Filling(f)
        return f

    monkeypatch.setattr(builtins, "open", filling_open)
    monkeypatch.setattr(io, "open", filling_open)


@pytest.mark.parametrize("suffix", [".html", ".md"])
def test_a_report_over_the_users_report_on_a_full_disk_keeps_it_and_names_it(tmp_path, capsys, monkeypatch, suffix):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")) == 0
    out = tmp_path / "out"
    report = out / f"report{suffix}"
    assert run_cli("report", str(tmp_path / "run"), "--output", str(report)) == 0
    before = _tree(out)
    _disk_fills_up(monkeypatch, out)
    capsys.readouterr()
    assert run_cli("report", str(tmp_path / "run"), "--output", str(report)) == 2
    message = _one_line(capsys)
    assert f"{report}: No space left on device; free space on its disk" in message
    assert _tree(out) == before  # the old report whole, no partial or temporary file beside it


def test_a_chart_over_the_users_chart_on_a_full_disk_keeps_it_and_names_it(tmp_path, capsys, monkeypatch):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    out = tmp_path / "out"
    chart = out / "chart.png"
    assert run_cli("data", "inspect", "--config", str(recipe), "--output", str(chart)) == 0
    before = _tree(out)
    assert before["chart.png"].startswith(b"\x89PNG")
    _disk_fills_up(monkeypatch, out, room=100)
    capsys.readouterr()
    assert run_cli("data", "inspect", "--config", str(recipe), "--output", str(chart)) == 2
    assert f"{chart}: No space left on device" in _one_line(capsys)
    assert _tree(out) == before


@pytest.mark.parametrize(
    "stop, status, said", [(signal.SIGTERM, 143, "stopped by SIGTERM"), (signal.SIGINT, 130, "interrupted")]
)
def test_a_stop_while_a_checkpoint_is_written_ends_as_a_stop_between_writes(
    tmp_path, capsys, monkeypatch, terminal_sigint, stop, status, said
):
    """The signal arrives in the middle of torch.save's writes of the second checkpoint: the command ends with
    the stop's one line (not torch's ``unexpected pos``), the checkpoint being written is complete, and the
    run resumes to the numbers of an uninterrupted one."""
    import fl_lightning.run.checkpoint as checkpoint

    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "whole")) == 0
    real_save, saves = torch.save, []

    class Signalling:
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                os.kill(os.getpid(), stop)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    def save(obj, f, *args, **kwargs):
        saves.append(f)
        return real_save(obj, Signalling(f) if len(saves) == 2 else f, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save)
    run = tmp_path / "run"
    capsys.readouterr()
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run)) == status
    message = _one_line(capsys)
    assert message.startswith(f"flrun fit: {said}") and "--resume auto" in message
    assert checkpoint.load_checkpoint(run / "checkpoints/last.ckpt")["rounds_done"] == 2
    assert not list(run.rglob("*.tmp"))
    monkeypatch.undo()
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto") == 0
    assert _final(run) == _final(tmp_path / "whole")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_report_into_a_read_only_folder_is_one_sentence(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")) == 0
    (tmp_path / "ro").mkdir(mode=0o555)
    capsys.readouterr()
    assert run_cli("report", str(tmp_path / "run"), "--output", str(tmp_path / "ro/report.html")) == 2
    assert "Permission denied" in _one_line(capsys)


def test_output_read_by_a_reader_that_went_away_ends_quietly(tmp_path):
    """``flrun models | head -1``: the reader closes the pipe; the command ends as a shell shows SIGPIPE, without
    naming "a file" or printing a traceback."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "fl_lightning", "models"]
    process = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    process.stdout.close()  # before the command has written anything (it is still starting)
    err = process.stderr.read().decode()
    assert process.wait(timeout=120) == 128 + signal.SIGPIPE and err == "", err


def test_a_users_own_sqlite_database_is_not_taken_for_a_study(tmp_path, capsys):
    database = tmp_path / "lab.db"
    with sqlite3.connect(database) as connection:
        connection.execute("CREATE TABLE grades (student TEXT, grade REAL)")
        connection.execute("INSERT INTO grades VALUES ('ada', 1.0)")
    before = database.read_bytes()
    recipe = write_recipe(tmp_path / "r.yaml", rounds=1)
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(
        f"base: {recipe}\nmetric: global/test_acc\nn_trials: 1\n"
        "parameters: {training.optimizer.init_args.lr: {type: float, low: 0.01, high: 0.1}}\n"
    )
    argv = ["sweep", "--config", str(sweep), "--storage", f"sqlite:///{database}", "--output_dir", str(tmp_path / "s")]
    assert run_cli(*argv) == 2
    assert "holds tables that are not an Optuna study's (grades)" in _one_line(capsys)
    assert database.read_bytes() == before


# ---------------------------------------------------------------------------------------------- signals and ranks
def _start(argv: list[str], cwd: Path, **env_vars: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_vars}
    command = [sys.executable, "-m", "fl_lightning", "fit", *argv]
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, process: subprocess.Popen, seconds: float = 240) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.2)


def test_sigterm_ends_a_run_in_one_line_and_it_resumes(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=5000, eval_every=1000)
    run = tmp_path / "run"
    process = _start(["--config", str(recipe), "--output_dir", str(run)], tmp_path)
    _wait_for(run / "checkpoints/last.ckpt", process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signal.SIGTERM
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "stopped by SIGTERM" in lines[0] and "--resume auto" in lines[0], err
    from fl_lightning.run.checkpoint import load_checkpoint

    done = load_checkpoint(run / "checkpoints/last.ckpt")["rounds_done"]
    resume = ["--resume", "auto", "--stop_after", str(done + 1)]
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), *resume) == 0
    assert load_checkpoint(run / "checkpoints/last.ckpt")["rounds_done"] == done + 1


def _ranks(launcher: int) -> dict[int, int]:
    """{rank: pid} of the processes ``launcher`` started (their RANK variable)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                env = (entry / "environ").read_bytes().split(b"\0") if parent == launcher else []
            except OSError:
                continue
            ranks = [int(v.split(b"=", 1)[1]) for v in env if v.startswith(b"RANK=")]
            if ranks:
                found[ranks[0]] = int(entry.name)
    return found


@pytest.mark.slow  # a launcher and two ranks, each importing the stack
@pytest.mark.parametrize("stop, how", [(signal.SIGTERM, "exit status 143"), (signal.SIGKILL, "killed by SIGKILL")])
def test_the_launcher_names_a_rank_that_ended_and_how_to_continue(tmp_path, stop, how):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=5000, eval_every=1000)
    run, scratch = tmp_path / "run", tmp_path / "tmp"
    scratch.mkdir()
    argv = ["--config", str(recipe), "--output_dir", str(run), "--runtime.devices", "2"]
    process = _start(argv, tmp_path, TMPDIR=str(scratch))
    _wait_for(run / "checkpoints/last.ckpt", process)
    ranks = _ranks(process.pid)
    assert sorted(ranks) == [0, 1]
    os.kill(ranks[1], stop)
    _, err = process.communicate(timeout=120)
    assert "Traceback" not in err and "gloo" not in err, err
    last = err.strip().splitlines()[-1]
    assert f"rank 1 ended ({how})" in last and "--resume auto" in last, err
    assert process.returncode == 128 + stop
    # the ranks' scratch folders went with the run, a killed rank's too (torch keeps a cache of its own there)
    assert [p.name for p in scratch.glob("flrun-*")] == []


@pytest.mark.slow  # three processes, each importing the stack
def test_ranks_end_when_their_launcher_is_killed_and_the_run_resumes(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=5000, eval_every=1000)
    run = tmp_path / "run"
    process = _start(["--config", str(recipe), "--output_dir", str(run), "--runtime.devices", "2"], tmp_path)
    _wait_for(run / "checkpoints/last.ckpt", process)
    ranks = _ranks(process.pid)
    assert sorted(ranks) == [0, 1]
    try:
        process.kill()  # SIGKILL: the launcher can neither stop its ranks nor wait for them
        _, err = process.communicate(timeout=300)  # rank 0 shares its stderr: closed once rank 0 has ended
        deadline = time.monotonic() + 120
        while any(Path(f"/proc/{pid}").exists() for pid in ranks.values()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(Path(f"/proc/{pid}").exists() for pid in ranks.values()), "ranks outlived their launcher"
    finally:
        for pid in ranks.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert "Traceback" not in err and "stopped by SIGTERM" in err.strip().splitlines()[-1], err
    from fl_lightning.run.checkpoint import load_checkpoint

    done = load_checkpoint(run / "checkpoints/last.ckpt")["rounds_done"]
    resume = ["--resume", "auto", "--stop_after", str(done + 1)]
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), *resume) == 0
    assert load_checkpoint(run / "checkpoints/last.ckpt")["rounds_done"] == done + 1


# ---------------------------------------------------------------------------------------------- silent wrong results
@pytest.mark.parametrize("damage", ["cut short", "missing"])
def test_a_report_says_when_metrics_csv_lacks_rounds_the_summary_has(tmp_path, capsys, damage):
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    run = tmp_path / "run"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run)) == 0
    metrics = run / "metrics.csv"
    if damage == "missing":
        metrics.unlink()
    else:
        metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:-2]))  # rounds 3 and 4 gone
    capsys.readouterr()
    assert run_cli("report", str(run), "--output", str(tmp_path / "report.md")) == 0
    err = capsys.readouterr().err
    assert f"{metrics} is {damage}" in err and "summary.json" in err and "round 4" in err
    assert f"{metrics} is {damage}" in (tmp_path / "report.md").read_text().replace("\\", "")


def test_resumes_of_a_personalized_run_keep_only_the_client_files_a_checkpoint_names(tmp_path):
    from fl_lightning.run.checkpoint import load_checkpoint
    from fl_lightning.run.client_store import CLIENTS_DIR, MANIFEST

    run = tmp_path / "run"
    recipe = ["--config", str(ROOT / "recipes/digits_fedhe.yaml"), "--rounds", "8", "--eval_every", "4"]
    for stop in (2, 4, 6, 8):
        resume = ["--resume", "auto"] if stop > 2 else []
        assert run_cli("fit", *recipe, "--output_dir", str(run), "--stop_after", str(stop), *resume) == 0
    named = set()
    for name in ("last.ckpt", "previous.ckpt"):
        manifest = load_checkpoint(run / "checkpoints" / name)["client_states"]
        assert manifest["manifest"] == MANIFEST
        named |= {
            f"{c}-{w:016x}-{n}.pt" for c, w, n in zip(*(manifest[k].tolist() for k in ("ids", "writers", "numbers")))
        }
    on_disk = {p.name for p in (run / "checkpoints" / CLIENTS_DIR).iterdir()}
    assert on_disk == named and torch.load(run / "checkpoints/last.ckpt", weights_only=True)["rounds_done"] == 8
