"""One channel for the package's messages: modules log (no print outside the command line and the report
writer), ``flrun`` shows their notes and warnings on stderr; metrics.csv is written by the CSV logger, which
every run has, last."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

import fl_lightning
from fl_lightning.tracking import CsvLogger, RunLogger, TensorBoardLogger, resolve_loggers

PACKAGE = Path(fl_lightning.__file__).parent
MAY_PRINT = ("cli", "report")  # the command line's output and the report writer's


def _print_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "print"
    ]


def test_no_module_outside_the_command_line_and_the_report_calls_print():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] not in MAY_PRINT
        for line in _print_calls(path)
    ]
    assert found == [], f"print calls (log to logging.getLogger(__name__) instead): {found}"


def test_the_print_finder_finds_a_print(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("import sys\n\ndef f():\n    sys.stdout.write('x')\n    print('y', file=sys.stderr)\n")
    assert _print_calls(source) == [5]


def test_flrun_shows_a_modules_note_on_stderr_as_written_and_no_other_librarys(capsys):
    from fl_lightning.cli.commands import main

    assert main(["--version"]) == 0 and main(["models", "list", "--help"]) in (0, 2)  # the handler comes with a command
    capsys.readouterr()
    logging.getLogger("fl_lightning.data.download").info("downloading x -> y")
    logging.getLogger("elsewhere").warning("not ours")  # another library's messages are its own business
    assert capsys.readouterr().err == "downloading x -> y\n"


def test_the_csv_logger_is_in_every_list_once_and_last():
    assert [type(x) for x in resolve_loggers("csv")] == [CsvLogger]
    assert [type(x) for x in resolve_loggers(None)] == [CsvLogger]
    assert [type(x) for x in resolve_loggers(["csv", "tensorboard"])] == [TensorBoardLogger, CsvLogger]

    class Watch(RunLogger):
        def log_metrics(self, metrics, step):
            pass

    mine = CsvLogger()
    first = resolve_loggers([mine, "tensorboard"])
    again = resolve_loggers([*first, Watch()])  # a list resolved again with a logger added (a sweep's pruning)
    assert [type(x) for x in again] == [TensorBoardLogger, Watch, CsvLogger] and again[-1] is mine


def test_the_csv_logger_writes_every_evaluated_round_with_the_union_of_columns(tmp_path):
    csv_logger = CsvLogger()
    with pytest.raises(RuntimeError, match="before its start"):
        csv_logger.log_evaluation([])
    csv_logger.start(tmp_path, "run", {}, None)
    csv_logger.log_metrics({"train/loss": 1.0}, step=1)  # a round without evaluation: no row
    assert not (tmp_path / "metrics.csv").exists()
    history = [{"round": 2, "acc": 0.5}, {"round": 4, "acc": 0.75, "comm/uplink_bytes": 12}]
    csv_logger.log_evaluation(history)
    assert (tmp_path / "metrics.csv").read_bytes() == b"round,acc,comm/uplink_bytes\r\n2,0.5,\r\n4,0.75,12\r\n"


def test_a_rank_that_ended_is_reported_with_the_end_of_its_output(caplog):
    import io

    from fl_lightning.distributed.launch import _show_log

    with caplog.at_level(logging.ERROR, logger="fl_lightning"):
        _show_log(1, 3, io.BytesIO(b"step 1\nTraceback: boom\n"))
    assert [r.getMessage() for r in caplog.records] == [
        "flrun fit: output of rank 1:\nstep 1\nTraceback: boom",
        "flrun fit: rank 1 ended (exit status 3) and the run stopped; the last checkpoint is intact: run the same "
        "command with --resume auto to continue.",
    ]
