"""What a user sees while a run goes on: plain lines when output is not a terminal, a warning for long runs."""

import io

from conftest import run_cli, write_recipe
from rich.console import Console

from fl_lightning.tracking import progress
from fl_lightning.tracking.progress import duration, long_run_warning


def test_durations_read_naturally():
    assert [duration(s) for s in (42, 450, 3 * 3600, 60 * 3600)] == ["42 s", "7.5 min", "3.0 h", "2.5 days"]


def test_a_sixty_hour_cpu_run_is_announced_with_advice():
    message = long_run_warning(540.0, 400, "cpu")  # the flagship on this CPU: about 9 minutes a round
    assert message.startswith("this run will take about 2.5 days on cpu (9.0 min per round measured, 400 rounds")
    assert "--runtime.accelerator cuda" in message and "--stop_after" in message
    assert long_run_warning(0.2, 400, "cpu") is None  # 80 s: nothing to say


def test_redirected_output_gets_one_plain_line_per_round_and_keeps_the_last_accuracy(tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=4, eval_every=2, runtime={"progress": True})
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("round ")]
    assert [line.split()[1] for line in lines] == ["1/4", "2/4", "3/4", "4/4"]
    assert "global/test_acc" not in lines[0] and "global/test_acc" in lines[2]  # round 3 shows round 2's value
    assert all("eta" in line and "train/loss" in line for line in lines)


def test_a_round_without_evaluation_names_the_round_its_value_is_from(capsys):
    """The monitored value of round 2 shown again on round 3 says it is round 2's: a repeated number looked stuck."""
    shown = progress.RoundProgress(enabled=True, total=4, done=0, monitor="global/test_acc")
    for rnd, metrics in [(1, {}), (2, {"global/test_acc": 0.5}), (3, {}), (4, {"global/test_acc": 0.75})]:
        shown.update(rnd, {**metrics, "train/loss": 1.0})
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("round ")]
    assert "global/test_acc" not in lines[0]
    assert "global/test_acc 0.5000  train/loss" in lines[1]
    assert "global/test_acc 0.5000 (round 2)  train/loss" in lines[2]
    assert "global/test_acc 0.7500  train/loss" in lines[3]


def test_long_run_warning_is_printed_once_during_the_first_round(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(progress, "LONG_RUN_S", 0.0)  # every run is "long"
    recipe = write_recipe(tmp_path / "r.yaml", rounds=3, runtime={"progress": False})
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")) == 0
    err = capsys.readouterr().err
    assert err.count("this run will take about") == 1 and "estimated from the first client" in err


def test_a_narrow_terminal_keeps_the_round_counter_elapsed_time_and_eta_and_shortens_the_value(monkeypatch):
    """rich squeezes every column of a line too long for the terminal; the status is what gives way instead."""
    screen = io.StringIO()
    terminal = Console(file=screen, width=80, force_terminal=True, color_system=None)
    monkeypatch.setattr(progress, "Console", lambda file: terminal)
    shown = progress.RoundProgress(enabled=True, total=100, done=0, monitor="global/test_acc")
    shown.update(1, {"global/test_acc": 0.5, "train/loss": 1.0})
    shown.update(2, {"train/loss": 0.9})  # not evaluated: the value names its round
    shown.start_round(3)
    shown.start_phase("train", 10)
    shown.client_done()
    shown.close()
    line = rendered(shown, width=80)
    assert line.count("\n") == 1 and "…" not in line, line
    assert line.startswith("round   2/100") and "clients 1/10" in line and " eta " in line
    assert "test_acc 0.5000 (r1)" in line and "train/loss" not in line
    wide = Console(file=io.StringIO(), width=200, force_terminal=True, color_system=None)
    monkeypatch.setattr(progress, "Console", lambda file: wide)
    shown = progress.RoundProgress(enabled=True, total=100, done=0, monitor="global/test_acc")
    shown.update(1, {"global/test_acc": 0.5, "train/loss": 1.0})
    shown.update(2, {"train/loss": 0.9})
    shown.close()
    assert "global/test_acc 0.5000 (round 1)  train/loss 0.9000" in rendered(shown, width=200)


def rendered(shown, width):
    """The bar's line as a terminal of that width shows it, once its live display has stopped."""
    screen = Console(file=io.StringIO(), width=width, force_terminal=True, color_system=None)
    with screen.capture() as captured:
        screen.print(shown.bar.make_tasks_table(shown.bar.tasks))
    return captured.get()
