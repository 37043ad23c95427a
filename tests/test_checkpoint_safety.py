"""Checkpoints cannot run code, damaged ones are refused, resume refuses a changed recipe, files are fsynced."""

import json
import os
import stat
import struct
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import read_summary, run_cli, write_recipe


def _final(summary: dict) -> dict:
    return {"final": summary["final"], "best": summary["best"], "comm": summary["comm"]}


def _error_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # one sentence, no traceback
    return err


def _run_files(run: Path) -> dict[str, bytes]:
    return {name: (run / name).read_bytes() for name in ("config.yaml", "partition.json", "summary.json")}


class _RunsAShellCommand:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_checkpoint_that_would_run_code_is_refused_and_the_code_does_not_run(tmp_path, capsys):
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.ckpt"
    torch.save({"rounds_done": 1, "payload": _RunsAShellCommand(marker)}, evil)
    recipe = write_recipe(tmp_path / "r.yaml", rounds=2)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run"), "--resume", str(evil)) == 2
    err = _error_line(capsys)
    assert str(evil) in err and "system" in err and "could run code" in err
    assert not marker.exists()
    assert not (tmp_path / "run").exists()  # refused before anything was written


def _flip_tensor_bytes(checkpoint: Path) -> None:
    """Inverts 64 bytes inside the largest tensor record: the zip and the pickle stay readable."""
    with zipfile.ZipFile(checkpoint) as archive:
        record = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    data = bytearray(checkpoint.read_bytes())
    name_len, extra_len = struct.unpack("<HH", data[record.header_offset + 26 : record.header_offset + 30])
    start = record.header_offset + 30 + name_len + extra_len + 100
    data[start : start + 64] = bytes(b ^ 0xFF for b in data[start : start + 64])
    checkpoint.write_bytes(bytes(data))


def test_a_damaged_checkpoint_is_refused_and_the_previous_one_resumes_exactly(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=4, eval_every=1)
    common = ("--config", str(recipe))
    assert run_cli("fit", *common, "--output_dir", str(tmp_path / "full")) == 0
    run = tmp_path / "cut"
    assert run_cli("fit", *common, "--output_dir", str(run), "--stop_after", "2") == 0
    last, previous = run / "checkpoints/last.ckpt", run / "checkpoints/previous.ckpt"
    assert torch.load(previous, weights_only=True)["rounds_done"] == 1  # kept when round 2 was saved
    _flip_tensor_bytes(last)
    torch.load(last, weights_only=True)  # the damage is invisible to torch itself
    capsys.readouterr()

    assert run_cli("fit", *common, "--output_dir", str(run), "--resume", "auto") == 2
    err = _error_line(capsys)
    assert f"checkpoint {last} is damaged" in err and f"--resume {previous}" in err

    assert run_cli("fit", *common, "--output_dir", str(run), "--resume", str(previous), "--stop_after", "2") == 0
    from fl_lightning.run.checkpoint import load_checkpoint

    assert load_checkpoint(previous)["rounds_done"] == 1  # the damaged file did not replace the good one
    assert run_cli("fit", *common, "--output_dir", str(run), "--resume", "auto") == 0
    assert _final(read_summary(run)) == _final(read_summary(tmp_path / "full"))


def test_saving_state_that_would_not_load_safely_fails_before_writing(tmp_path):
    from fl_lightning.run.checkpoint import save_checkpoint

    path = tmp_path / "checkpoints/last.ckpt"
    with pytest.raises(TypeError, match=r"state\['history'\]\[0\] is a numpy.float64"):
        save_checkpoint(path, {"history": [np.float64(0.5)]})
    assert not path.exists() and not path.with_name("last.ckpt.tmp").exists()


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A 4-round run stopped after round 2 (resume refusals leave it untouched, so tests share it)."""
    root = tmp_path_factory.mktemp("stopped")
    recipe = write_recipe(root / "r.yaml", rounds=4, eval_every=1)
    run = root / "run"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--stop_after", "2") == 0
    return recipe, run


@pytest.mark.parametrize(
    "override, key",
    [
        (("--training.optimizer.init_args.lr", "0.2"), "training.optimizer.init_args.lr (0.1 -> 0.2)"),
        (("--training.batch_size", "8"), "training.batch_size (16 -> 8)"),
        (("--sampler.init_args.fraction", "0.25"), "sampler.init_args.fraction (0.5 -> 0.25)"),
        (("--training.optimizer_state", "per_client"), "training.optimizer_state ('reset' -> 'per_client')"),
        (("--eval_every", "2"), "eval_every (1 -> 2)"),
        (("--rounds", "3"), "rounds (4 -> 3)"),  # fewer than planned, more than done
    ],
)
def test_resume_refuses_a_changed_recipe_and_writes_nothing(stopped_run, capsys, override, key):
    recipe, run = stopped_run
    before = _run_files(run)
    capsys.readouterr()
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto", *override) == 2
    err = _error_line(capsys)
    assert f"the recipe changed {key};" in err and "config.yaml" in err
    assert _run_files(run) == before


def test_resume_with_fewer_rounds_than_done_is_refused(stopped_run, capsys):
    recipe, run = stopped_run
    before = _run_files(run)
    capsys.readouterr()
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto", "--rounds", "1") == 2
    assert "it has already run 2 rounds; pass --rounds 2 or more" in _error_line(capsys)
    assert _run_files(run) == before


def test_a_refused_start_keeps_the_existing_runs_files(stopped_run, capsys, tmp_path):
    recipe, run = stopped_run
    before = _run_files(run)
    other = write_recipe(tmp_path / "other.yaml", rounds=4, eval_every=1, seed=5)
    for argv in (
        ("--config", str(other)),  # no --resume: the directory holds a run
        ("--config", str(recipe), "--resume", "auto", "--population.num_clients", "6"),  # another partition
    ):
        capsys.readouterr()
        assert run_cli("fit", *argv, "--output_dir", str(run)) == 2
        assert str(run) in _error_line(capsys)
        assert _run_files(run) == before


def test_resume_accepts_safe_changes_records_them_and_adds_rounds_exactly(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=4, eval_every=1)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "six"), "--rounds", "6") == 0
    run = tmp_path / "cut"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--stop_after", "2") == 0
    argv = ("--resume", "auto", "--rounds", "6", "--checkpoint_every", "2", "--name", "longer")
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), *argv) == 0
    summary = read_summary(run)
    assert summary["resumed_with"] == [
        {
            "round": 2,
            "changed": {"rounds": [4, 6], "checkpoint_every": [1, 2], "stop_after": [2, None], "name": ["r", "longer"]},
        }
    ]
    assert summary["rounds"] == 6 and summary["complete"]
    assert "rounds: 6" in (run / "config.yaml").read_text()
    # constant learning rate and FedAvg: nothing depends on the planned total, so 4 + 2 rounds equal 6
    assert _final(summary) == _final(read_summary(tmp_path / "six"))


def test_run_files_and_checkpoints_are_fsynced_with_their_directory(tmp_path, monkeypatch):
    from fl_lightning.run.checkpoint import save_checkpoint
    from fl_lightning.tracking import CsvLogger, RunFiles

    synced: list[tuple[int, bool]] = []
    real_fsync = os.fsync

    def recording_fsync(fd):
        info = os.fstat(fd)
        synced.append((info.st_ino, stat.S_ISDIR(info.st_mode)))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", recording_fsync)
    files = RunFiles(tmp_path / "run")
    csv_logger = CsvLogger()
    csv_logger.start(files.root, "run", {}, None)
    writes = [
        (files.summary, lambda: files.write_json(files.summary, {"a": 1})),
        (files.metrics, lambda: csv_logger.log_evaluation([{"round": 1, "acc": 0.5}])),
        (files.config, lambda: files.write_text(files.config, "rounds: 1\n")),
        (files.last_checkpoint, lambda: save_checkpoint(files.last_checkpoint, {"w": torch.ones(2)})),
    ]
    for path, write in writes:
        synced.clear()
        write()
        directory = path.parent.stat().st_ino
        assert (path.stat().st_ino, False) in synced, path  # the file's bytes, before the rename
        assert synced[-1] == (directory, True), path  # then the rename, in its directory
    assert json.loads(files.summary.read_text()) == {"a": 1}
    assert files.metrics.read_bytes() == b"round,acc\r\n1,0.5\r\n"


def test_random_streams_are_named_distinct_and_keep_their_numbers():
    from fl_lightning.federation.seeding import MAX_PHASES, Owner, Stream, derive_seed, server_phase

    # the numbers every recorded result was drawn with (benchmarks/digits_fingerprint.json); new streams add to them
    recorded = {
        "DROPOUT": 0,
        "BATCH_ORDER": 1,
        "SAMPLER": 2,
        "CLIENT_INIT": 3,
        "ARRIVAL": 4,
        "SPEEDS": 5,
        "ASYNC_START": 6,
        "SERVER_PHASE": 10,
    }
    assert {name: int(Stream[name]) for name in recorded} == recorded
    assert (int(Owner.SERVER), int(Owner.COHORTS)) == (2**31 - 1, 2**31 - 2)
    # @unique refuses two members with one number; a new stream must also stay out of the server phases' range
    phases = {server_phase(k) for k in range(MAX_PHASES)}
    others = {int(s) for s in Stream if s is not Stream.SERVER_PHASE}
    assert len(phases) == MAX_PHASES and not phases & others
    with pytest.raises(ValueError):
        server_phase(MAX_PHASES)
    assert derive_seed(0, 1, Owner.SERVER, Stream.SAMPLER) == derive_seed(0, 1, 2**31 - 1, 2)
    assert derive_seed(0, 1, 2, 3) != derive_seed(0, 1, 2, 4)


def test_tensors_by_path_names_every_tensor_and_leaves_out_the_writers_of_client_states():
    from fl_lightning.run.checkpoint import tensors_by_path

    a, b, c = torch.zeros(2), torch.ones(3), torch.arange(4)
    tree = {"strategy": {"w": a, "banks": [b, (c, "not a tensor")]}, "clients": {"writers": torch.tensor([7])}}
    found = tensors_by_path(tree)
    assert list(found) == ["/strategy/w", "/strategy/banks/0", "/strategy/banks/1/0"]
    assert found["/strategy/banks/1/0"] is c  # the checkpoint's own tensors, not copies


def test_a_run_saved_before_runtime_lockstep_existed_resumes_without_a_recorded_change(tmp_path):
    """A checkpoint whose recipe has no runtime.lockstep (saved by the code before the option) resumes: the code
    then ran as lockstep false, the default, so nothing changed (the option was refused as a change)."""
    import yaml

    from fl_lightning.run.checkpoint import load_checkpoint, save_checkpoint

    recipe = write_recipe(tmp_path / "r.yaml", rounds=3, eval_every=1)
    run = tmp_path / "run"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--stop_after", "1") == 0
    path = run / "checkpoints" / "last.ckpt"
    state = load_checkpoint(path)
    config = yaml.safe_load(state["config"])
    del config["runtime"]["lockstep"]
    save_checkpoint(
        path, {k: v for k, v in state.items() if k not in ("format", "sha256")} | {"config": yaml.safe_dump(config)}
    )
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto") == 0
    assert [list(r["changed"]) for r in read_summary(run)["resumed_with"]] == [["stop_after"]]
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "on"), "--stop_after", "1") == 0
    on = ("--runtime.executor", "batched", "--runtime.lockstep", "true")
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "on"), "--resume", "auto", *on) == 2
