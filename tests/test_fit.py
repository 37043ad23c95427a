"""End to end through the CLI entry point on the real digits data."""

import json
import struct
from pathlib import Path

import pytest
import torch
from conftest import ROOT, assert_resumed_equals, metrics_rows, read_summary, run_cli, write_recipe


def _final_metrics(summary):
    return {"final": summary["final"], "best": summary["best"], "comm": summary["comm"]}


def test_quickstart_recipe_reaches_90_percent(tmp_path):
    out = tmp_path / "qs"
    assert (
        run_cli(
            "fit",
            "--config",
            str(ROOT / "recipes/quickstart.yaml"),
            "--output_dir",
            str(out),
            "--runtime.progress",
            "false",
        )
        == 0
    )
    summary = read_summary(out)
    assert summary["final"]["global/test_acc"] >= 0.90
    assert summary["rounds"] == 40 and summary["complete"] and summary["seed"] == 0
    from fl_lightning.models import ModelSpec

    model_bytes = sum(t.numel() * t.element_size() for t in ModelSpec("digits_cnn").build().state_dict().values())
    # 40 rounds x 10 sampled clients x one model each way: FedAvg sends nothing but the weights
    assert summary["comm"]["uplink_bytes"] == summary["comm"]["downlink_bytes"] == 40 * 10 * model_bytes


def test_run_files_and_metrics_rows(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    out = tmp_path / "run"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(out)) == 0
    for name in ("config.yaml", "metrics.csv", "summary.json", "partition.json", "checkpoints/last.ckpt"):
        assert (out / name).is_file(), name
    rows = metrics_rows(out)
    assert [int(r["round"]) for r in rows] == [2, 4]  # eval_every 2 of 4 rounds
    summary = read_summary(out)
    assert set(summary) >= {"final", "best", "comm", "rounds", "seed", "wall_time_s"}
    assert any("acc" in k for k in summary["final"]) and any("acc" in k for k in summary["best"])
    assert float(rows[-1]["comm/uplink_bytes"]) == summary["comm"]["uplink_bytes"]
    assert "rounds: 4" in (out / "config.yaml").read_text()


def test_summary_records_the_hardware_the_wall_time_comes_from(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=1, eval_every=1)
    out = tmp_path / "run"
    argv = ["--output_dir", str(out), "--runtime.num_threads", "1", "--runtime.accelerator", "cpu"]
    assert run_cli("fit", "--config", str(recipe), *argv) == 0
    hardware = read_summary(out)["hardware"]
    assert hardware["device"] == "cpu" and "gpu" not in hardware
    assert hardware["threads"] == 1 and hardware["ranks"] == 1
    assert hardware["cpu"] and hardware["cpu_count"] >= 1
    assert hardware["cpu_instruction_set"] == torch.backends.cpu.get_cpu_capability()


def test_hardware_names_the_gpus_a_process_was_given(monkeypatch):
    import torch

    from fl_lightning.run.provenance import hardware

    # the function alone: a whole run would let CUDA start up under this setting on a GPU machine
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")  # as a sweep worker given the fourth GPU
    assert hardware(torch.device("cpu"), world=2)["cuda_visible_devices"] == "3"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    record = hardware(torch.device("cpu"), world=2)
    assert "cuda_visible_devices" not in record and record["ranks"] == 2


def test_fedavg_ledger_counts_model_bytes_per_client(tmp_path):
    # digits_mlp(hidden=32): 64*32 + 32 + 32*10 + 10 = 2,410 float32 parameters = 9,640 bytes.
    recipe = write_recipe(tmp_path / "r.yaml", rounds=3, eval_every=3)
    out = tmp_path / "run"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(out)) == 0
    summary = read_summary(out)
    clients_per_round = 4  # fraction 0.5 of 8
    assert summary["comm"]["uplink_bytes"] == 3 * clients_per_round * 9_640
    assert summary["comm"]["downlink_bytes"] == 3 * clients_per_round * 9_640


def test_same_seed_same_numbers(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml")
    summaries = []
    for name in ("a", "b"):
        assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / name)) == 0
        summaries.append(_final_metrics(read_summary(tmp_path / name)))
    assert summaries[0] == summaries[1]
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "c"), "--seed", "1") == 0
    assert _final_metrics(read_summary(tmp_path / "c")) != summaries[0]


@pytest.mark.parametrize("optimizer_state", ["reset", "per_client", "shared"])
def test_resume_gives_exactly_the_uninterrupted_result(tmp_path, optimizer_state):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=6, eval_every=1)
    common = ("--config", str(recipe), "--training.optimizer_state", optimizer_state)
    assert run_cli("fit", *common, "--output_dir", str(tmp_path / "full")) == 0
    assert run_cli("fit", *common, "--output_dir", str(tmp_path / "cut"), "--stop_after", "2") == 0
    stopped = read_summary(tmp_path / "cut")
    assert stopped["rounds"] == 2 and not stopped["complete"]
    assert run_cli("fit", *common, "--output_dir", str(tmp_path / "cut"), "--resume", "auto") == 0
    assert read_summary(tmp_path / "cut")["rounds"] == 6
    assert_resumed_equals(tmp_path / "cut", tmp_path / "full")


def test_resume_says_where_it_continues(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=3)
    out = tmp_path / "x"
    common = ("fit", "--config", str(recipe), "--output_dir", str(out), "--resume", "auto")
    assert run_cli(*common, "--stop_after", "1") == 0
    assert f"no checkpoint in {out}; starting a new run" in capsys.readouterr().err
    assert run_cli(*common) == 0
    assert f"resuming {out} from {out}/checkpoints/last.ckpt: 1 of 3 rounds done, continuing with round 2" in (
        capsys.readouterr().err
    )
    assert run_cli(*common) == 0
    assert "all 3 rounds are done; only the summary is rewritten" in capsys.readouterr().err


def test_a_resume_keeps_the_runs_identity_byte_for_byte(tmp_path, capsys):
    """config.yaml and partition.json are the run's identity: resuming an interrupted run, then the finished one,
    leaves them as they were, and the report and the table still see one complete experiment."""
    import hashlib

    from fl_lightning.report.build import build_report
    from fl_lightning.sweep.table import TableRun

    recipe = write_recipe(tmp_path / "r.yaml", rounds=3, eval_every=1)
    run = TableRun(recipe, 0, tmp_path / "runs" / "r" / "seed0")  # as flrun table starts it: --resume auto
    assert run_cli("fit", *run.fit_argv([]), "--stop_after", "1") == 0
    identity = {name: (run.output_dir / name).read_bytes() for name in ("config.yaml", "partition.json")}
    started = read_summary(run.output_dir)
    assert started["config_sha256"] == hashlib.sha256(identity["config.yaml"]).hexdigest()
    assert run_cli("fit", *run.fit_argv([])) == 0  # the interrupted run continues
    finished = read_summary(run.output_dir)
    assert finished["complete"] and finished["resumed_with"] == [{"round": 1, "changed": {"stop_after": [1, None]}}]
    capsys.readouterr()
    assert run_cli("fit", *run.fit_argv([]), "--runtime.progress", "true") == 0  # the finished run, again
    assert "all 3 rounds are done; only the summary is rewritten" in capsys.readouterr().err
    assert {name: (run.output_dir / name).read_bytes() for name in identity} == identity
    again = read_summary(run.output_dir)  # how it was resumed is recorded; the hash, versions and hardware stay
    assert again["resumed_with"][1:] == [{"round": 3, "changed": {"runtime.progress": [False, True]}}]
    assert {**again, "resumed_with": finished["resumed_with"]} == finished
    assert finished["config_sha256"] == started["config_sha256"]
    assert run.state([]) == "done"
    # beside an uninterrupted run of another seed: one experiment of two seeds
    other = TableRun(recipe, 1, tmp_path / "runs" / "r" / "seed1")
    assert run_cli("fit", *other.fit_argv([])) == 0
    report = build_report([str(tmp_path / "runs")])
    assert [s["comparison"]["seeds"] for s in report["sections"]] == [[0, 1]]
    assert report["sections"][0]["comparison"]["complete"]


def test_a_loss_monitor_picks_the_lowest_loss_and_a_resume_may_change_the_monitor(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=4, eval_every=1)
    common = ("fit", "--config", str(recipe))
    loss = ("--monitor", "global/test_loss")
    assert run_cli(*common, "--output_dir", str(tmp_path / "full"), *loss) == 0
    rows = metrics_rows(tmp_path / "full")
    losses = {int(r["round"]): float(r["global/test_loss"]) for r in rows}
    full = read_summary(tmp_path / "full")
    assert full["best_round"] == min(losses, key=losses.get) and full["best"]["global/test_loss"] == min(
        losses.values()
    )
    assert full["best_round"] != max(losses, key=losses.get)
    # a run picking by accuracy, stopped, then continued picking by loss: the best round is found again
    assert run_cli(*common, "--output_dir", str(tmp_path / "cut"), "--stop_after", "2") == 0
    assert run_cli(*common, "--output_dir", str(tmp_path / "cut"), "--resume", "auto", *loss) == 0
    resumed = read_summary(tmp_path / "cut")
    assert (resumed["best_round"], resumed["best"], resumed["final"]) == (
        full["best_round"],
        full["best"],
        full["final"],
    )
    assert resumed["resumed_with"][0]["changed"]["monitor"] == [None, "global/test_loss"]
    # a misspelled monitor stops the run at its first evaluation; the corrected one continues it
    typo = tmp_path / "typo"
    capsys.readouterr()
    assert run_cli(*common, "--output_dir", str(typo), "--monitor", "global/test_los") == 2
    assert "continue with --resume auto and --monitor set to one of them" in capsys.readouterr().err
    assert run_cli(*common, "--output_dir", str(typo), "--resume", "auto", *loss) == 0
    assert read_summary(typo)["best"] == full["best"]
    # a resume naming a monitor the evaluations do not produce is refused before anything is written
    saved = {name: (typo / name).read_bytes() for name in ("config.yaml", "summary.json", "checkpoints/last.ckpt")}
    for wrong in ("global/test_acx", "train/loss"):  # train/loss is a metrics.csv column, not an evaluation's
        assert run_cli(*common, "--output_dir", str(typo), "--resume", "auto", "--monitor", wrong) == 2
        assert f"monitor metric '{wrong}' is not among the evaluation metrics" in capsys.readouterr().err
    assert {name: (typo / name).read_bytes() for name in saved} == saved


def test_a_resumed_personalized_run_keeps_each_clients_accuracy_in_its_summary(tmp_path):
    common = ("fit", "--config", str(ROOT / "recipes/digits_fedgh.yaml"), "--rounds", "2", "--eval_every", "1")
    assert run_cli(*common, "--output_dir", str(tmp_path / "full")) == 0
    full = read_summary(tmp_path / "full")["per_client_acc"]
    assert len(full) > 1 and all(0.0 <= acc <= 1.0 for acc in full.values())
    # run again on the complete run (a job script's --resume auto), and stopped then resumed
    assert run_cli(*common, "--output_dir", str(tmp_path / "full"), "--resume", "auto") == 0
    assert read_summary(tmp_path / "full")["per_client_acc"] == full
    assert run_cli(*common, "--output_dir", str(tmp_path / "cut"), "--stop_after", "1") == 0
    assert run_cli(*common, "--output_dir", str(tmp_path / "cut"), "--resume", "auto") == 0
    assert read_summary(tmp_path / "cut")["per_client_acc"] == full


def test_a_run_whose_last_checkpoint_is_gone_is_not_restarted_over_its_previous_one(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=4)
    run = tmp_path / "x"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--stop_after", "2") == 0
    previous = run / "checkpoints/previous.ckpt"
    saved = previous.read_bytes()
    (run / "checkpoints/last.ckpt").rename(tmp_path / "moved.ckpt")  # a partial copy of the directory
    capsys.readouterr()
    for resume in ([], ["--resume", "auto"]):
        assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), *resume) == 2
        assert (
            f"holds previous.ckpt but no last.ckpt; continue from it with --resume {previous}"
            in capsys.readouterr().err
        )
    assert previous.read_bytes() == saved
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", str(previous)) == 0
    assert read_summary(run)["complete"]


def test_a_run_directory_in_use_by_another_process_is_refused(tmp_path, capsys):
    import fcntl

    recipe = write_recipe(tmp_path / "r.yaml", rounds=2)
    run = tmp_path / "x"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--stop_after", "1") == 0
    saved = (run / "checkpoints/last.ckpt").read_bytes()
    with open(run / "run.lock", "ab") as held:  # as another flrun fit writing this run holds it
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        capsys.readouterr()
        assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto") == 2
        assert f"{run} is in use by another flrun process" in capsys.readouterr().err
        assert (run / "checkpoints/last.ckpt").read_bytes() == saved
        # with several ranks the launching process refuses at once (rank 0 alone would leave the others waiting)
        argv = ["--output_dir", str(run), "--resume", "auto", "--runtime.devices", "2"]
        assert run_cli("fit", "--config", str(recipe), *argv) == 2
        assert f"{run} is in use by another flrun process" in capsys.readouterr().err
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto") == 0
    assert read_summary(run)["complete"]


def test_a_resume_at_or_past_its_stop_round_trains_nothing(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=4)
    common = ("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "x"))
    assert run_cli(*common, "--stop_after", "2") == 0
    saved = (tmp_path / "x/checkpoints/last.ckpt").read_bytes()
    capsys.readouterr()
    for stop in ("2", "1"):  # a job chain's rerun after its round: exit 0 (afterok), nothing trained
        assert run_cli(*common, "--resume", "auto", "--stop_after", stop) == 0
        assert f"at or past --stop_after {stop}; nothing to train" in capsys.readouterr().err
        assert read_summary(tmp_path / "x")["rounds"] == 2 and not read_summary(tmp_path / "x")["complete"]
    assert (tmp_path / "x/checkpoints/last.ckpt").read_bytes() == saved
    assert run_cli(*common, "--resume", "auto", "--stop_after", "3") == 0
    assert read_summary(tmp_path / "x")["rounds"] == 3


def test_a_sweep_directory_is_not_taken_as_a_run_directory(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=1)
    (tmp_path / "sweep").mkdir()
    (tmp_path / "sweep/sweep.json").write_text("{}")
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "sweep")) == 2
    assert "holds a sweep (sweep.json); give the run a directory of its own" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["sweep.json"]


def test_a_run_saved_by_another_process_while_this_one_set_up_is_not_overwritten(tmp_path, capsys, monkeypatch):
    from fl_lightning.data import DigitsData

    recipe = write_recipe(tmp_path / "r.yaml", rounds=1)
    run = tmp_path / "new"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "other")) == 0
    real_setup = DigitsData.setup

    def setup_while_another_saves(self, *args, **kwargs):  # the other process finishes its run meanwhile
        real_setup(self, *args, **kwargs)
        (run / "checkpoints").mkdir(parents=True, exist_ok=True)
        (run / "checkpoints/last.ckpt").write_bytes((tmp_path / "other/checkpoints/last.ckpt").read_bytes())

    monkeypatch.setattr(DigitsData, "setup", setup_while_another_saves)
    capsys.readouterr()
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run)) == 2
    assert "received another process's run while this one started" in capsys.readouterr().err
    assert (run / "checkpoints/last.ckpt").read_bytes() == (tmp_path / "other/checkpoints/last.ckpt").read_bytes()


def test_a_file_system_without_locks_runs_with_a_warning(tmp_path, capsys, monkeypatch):
    import errno

    from fl_lightning.tracking import run_files

    def no_flock(file, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_files.fcntl, "flock", no_flock)
    recipe = write_recipe(tmp_path / "r.yaml", rounds=1)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "x")) == 0
    assert (
        "cannot be locked (No locks available); make sure no other flrun process writes it" in capsys.readouterr().err
    )


def test_existing_run_is_not_overwritten_without_resume(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=1)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "x")) == 0
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "x")) == 2
    assert "--resume auto" in capsys.readouterr().err


def test_resume_refuses_a_different_partition(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=3)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "x"), "--stop_after", "1") == 0
    assert (
        run_cli(
            "fit",
            "--config",
            str(recipe),
            "--output_dir",
            str(tmp_path / "x"),
            "--resume",
            "auto",
            "--population.num_clients",
            "6",
        )
        == 2
    )
    assert "different data partition (data, seed or population changed, population.num_clients (8 -> 6))" in (
        capsys.readouterr().err
    )


def _wandb_history(path: Path) -> list[dict]:
    """The history rows of a W&B offline ``.wandb`` file: a LevelDB-style log of 32 KiB blocks (after a 7-byte
    header), each record a 7-byte header (CRC-32, length, type: full, first, middle, last) and a protobuf
    ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data, block, position, pending, rows = path.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while position + 7 <= len(data):
        if block - position % block < 7:  # a block's tail too short for a header is padding
            position += block - position % block
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
                )
    return rows


def test_wandb_offline_and_tensorboard_log_the_values_of_metrics_csv(tmp_path, monkeypatch):
    """Every metric of every round, read back from the W&B offline file and the TensorBoard events, is the
    value metrics.csv has (TensorBoard stores 32-bit floats)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    recipe = write_recipe(tmp_path / "r.yaml", rounds=2, eval_every=1)
    out = tmp_path / "run"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(out), "--logger", "[wandb, tensorboard]") == 0
    every = metrics_rows(out, timings=True)  # the wall-clock columns are logged too
    rows = {int(row.pop("round")): {k: float(v) for k, v in row.items()} for row in every}
    assert sorted(rows) == [1, 2] and "global/test_acc" in rows[2]
    import wandb

    wandb.teardown()  # the W&B service of this process (shared with earlier tests' runs) writes out what it holds
    (offline,) = (out / "wandb").glob("offline-run-*/*.wandb")
    logged = {row["_step"]: row for row in _wandb_history(offline) if "_step" in row and row["_step"] in rows}
    assert sorted(logged) == [1, 2]
    for rnd, row in rows.items():
        assert {k: logged[rnd][k] for k in row} == row, rnd
    (events,) = (out / "tensorboard").glob("events.out.tfevents.*")
    board = EventAccumulator(str(events))
    board.Reload()
    assert set(rows[2]) <= set(board.Tags()["scalars"])
    for key in rows[2]:
        scalars = {event.step: event.value for event in board.Scalars(key)}
        assert scalars == {rnd: pytest.approx(row[key], rel=1e-6) for rnd, row in rows.items()}, key


def test_the_round_plan_says_which_rounds_run_evaluate_checkpoint_and_stop():
    """By hand: 10 rounds, evaluated every 4th and the last, checkpointed every 3rd, the last and at the stop."""
    from fl_lightning.federation.errors import ConfigError
    from fl_lightning.run.options import RoundPlan

    plan = RoundPlan(rounds=10, eval_every=4, checkpoint_every=3, stop_after=7)
    assert list(plan.rounds_to_run(0)) == [1, 2, 3, 4, 5, 6, 7] and list(plan.rounds_to_run(5)) == [6, 7]
    assert list(plan.rounds_to_run(7)) == [] and list(plan.rounds_to_run(9)) == []  # a job chain's rerun: none
    assert [r for r in range(1, 11) if plan.evaluates(r)] == [4, 8, 10]
    assert [r for r in range(1, 11) if plan.checkpoints(r)] == [3, 6, 7, 8, 9, 10]  # 7: where it stops
    assert list(RoundPlan(rounds=3).rounds_to_run(1)) == [2, 3]
    with pytest.raises(ConfigError, match=r"^eval_every must be at least 1, got 0; e.g. --eval_every 1\.$"):
        RoundPlan(rounds=3, eval_every=0)


def test_robustness_may_lose_updates_only_with_faults_or_dropped_divergence():
    from fl_lightning.run.robustness import Faults, Robustness

    assert not Robustness().may_lose_updates and Robustness().fault_of(0, 1, 2) is None
    assert Robustness(divergence="drop").may_lose_updates
    assert Robustness(divergence="drop").event_keys == ("dropped_nonfinite", "phases_without_updates")
    faulty = Robustness(Faults(crash=1.0))
    assert faulty.may_lose_updates and faulty.fault_of(0, 1, 2) == "crash" and "crash" in faulty.event_keys
