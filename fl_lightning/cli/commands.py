"""``flrun``: the command line. ``flrun fit --config recipes/quickstart.yaml [--key.sub value ...]``.

The parser is generated from the typed signature of :func:`fl_lightning.run.fit.fit` (jsonargparse), so
``flrun fit --help`` documents every knob and recipes name components by ``class_path`` / ``init_args``.
Every user error ends as one line on stderr and exit status 2, never a traceback; an error the user's own code
raised (a builder, a LightningModule, a Strategy subclass, a data set, a trusted module) as one sentence naming
it, then that code's own frames, and exit status 3 (:mod:`fl_lightning.federation.user_code`).
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from ..federation.release import VERSION
from ..run.arguments import FIT_SUMMARY, UserError, fit_from_argv, fit_parser, parse_fit, recipe_name
from ..run.arguments import USAGE as USAGE_FIT
from .data import run_data
from .diagnostics import show_messages
from .errors import Terminated, error_status, guarded_output, stopped_by_sigterm
from .flower import run_flower
from .models import run_models
from .report import run_report
from .studies import run_sweep_command, run_table

_UserError, _recipe_name = UserError, recipe_name  # the names other modules and tests knew
__all__ = ["fit_from_argv", "fit_parser", "main", "parse_fit"]

USAGE = """usage: flrun COMMAND [options]    (flrun --version: the installed version)

commands:
  fit      run a federated experiment from a recipe: flrun fit -c recipes/quickstart.yaml
  flower   a recipe as Flower apps: flrun flower -c RECIPE [--supernodes N] [--simulation]
  models   list the registered model builders with their parameter counts (--json; --count builds them)
  data     flrun data inspect --config RECIPE: per-client statistics and a client-by-class chart
           flrun data fetch DATASET [--data_dir data]: download and verify a data set (on a machine online)
  sweep    flrun sweep --config sweeps/NAME.yaml [-- FIT_ARGS]: an Optuna study over a recipe
  report   flrun report RUN_DIRS... --output report.html: measured vs the papers' numbers
           (--wandb ENTITY/PROJECT also saves a W&B Report)
           flrun report RUN_DIRS --table paper-001/table-5: one paper table, paper vs measured per cell
  table    flrun table paper-001/table-5 [--seeds 0 1 2] [--n_jobs K]: run what the table lacks, then build it

Run `flrun COMMAND --help` for the options of a command."""


_start_up_gc_paused = False


def _pause_gc_for_start_up() -> None:
    """Pauses the cyclic garbage collector while the program imports and parses (``flrun`` itself only).

    Start-up makes about 550,000 long-lived objects (torch, torch._dynamo, Fabric), and every full collection
    during it walks all of them again: five such collections took 0.46 s of a 2.3 s digits run
    (``gc.callbacks``; benchmarks/startup.py measures the whole effect). :func:`_end_start_up` then freezes
    them, out of the collector's sight for the rest of the run, so later collections stay short too.
    """
    global _start_up_gc_paused
    gc.disable()
    _start_up_gc_paused = True


def _end_start_up(freeze: bool = True) -> None:
    """Resumes collection, after freezing what start-up made (a no-op unless start-up paused it).

    The price of the freeze: start-up's own cyclic garbage (about 10,000 objects, 8 MB in a digits run) is
    never freed. Memory freed by reference counting (tensors, a run's data) is not affected, and a caller that
    runs ``main([...])`` in its own process (tests, notebooks) is left alone: nothing of theirs is frozen.
    """
    global _start_up_gc_paused
    if _start_up_gc_paused:
        _start_up_gc_paused = False
        if freeze:
            gc.freeze()
        gc.enable()


def run_fit(argv: list[str]) -> int:
    if argv == ["-h"]:  # the usage and the common options, at once
        print(f"usage: {USAGE_FIT % {'prog': 'flrun fit'}}\n\n{FIT_SUMMARY}")
        return 0
    if argv == ["--help"]:
        return _fit_help()
    given, as_json = argv, "--json" in argv  # --json is this command's own, not a recipe key
    argv = [arg for arg in argv if arg != "--json"]
    _, init, resolved = parse_fit(argv)  # first: a mistake is answered before the imports a run needs
    from ..distributed.launch import launch
    from ..distributed.ranks import check_shardable, from_env, needs_launch
    from ..run.fit import fit

    runtime = init.runtime
    if needs_launch(runtime.devices):  # --runtime.devices N: this process starts the N ranks and waits for them
        check_shardable(runtime.devices, init.schedule, init.training.optimizer_state)
        from ..run.run_dir import check_output_dir, run_root

        root = run_root(init.output_dir, init.name, init.seed)

        check_output_dir(root)  # a folder that is not this run's is refused before run.lock is put in it
        if root.is_dir():  # a run another process writes: refused here, not by rank 0 while the others wait
            from ..tracking.run_files import RunLock

            with RunLock(root) as probe:
                probe.acquire()
        return launch(["fit", *given], runtime.devices, runtime.accelerator)
    from ..distributed.fabric import fabric_class

    fabric_class()  # the last import of start-up: fit() makes its Fabric from it
    _end_start_up()
    summary = fit(**{k: v for k, v in vars(init).items() if k not in ("config", "__path__")}, resolved_config=resolved)
    if from_env().rank > 0:  # under torchrun or srun every rank ends here: rank 0 reports
        return 0
    if as_json:  # summary.json as written (its NaNs as nulls)
        print((Path(summary["output_dir"]) / "summary.json").read_text(), end="")
    else:
        from ..tracking.progress import run_summary

        print(run_summary(summary))
    return 0


def _fit_help() -> int:
    """``flrun fit --help``: the stored text when the code and the packages it is rendered from are unchanged
    (no torch import), else rendered by the parser and stored (:mod:`fl_lightning.cli.help_cache`)."""
    from .help_cache import cached_help, store_help

    text = cached_help()
    if text is None:
        text = fit_parser().format_help()
        store_help(text)
    print(text, end="")
    return 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "report": run_report,
    "fit": run_fit,
    "flower": run_flower,
    "models": run_models,
    "data": run_data,
    "sweep": run_sweep_command,
    "table": run_table,
}


def main(argv: list[str] | None = None) -> int:
    """The program (``flrun``, ``python -m fl_lightning``): reads ``sys.argv`` unless given ``argv``."""
    if argv is None and sys.argv[1:2] == ["fit"]:  # flrun fit's own process (a sweep's workers run trials)
        _pause_gc_for_start_up()
    try:
        return _main(list(sys.argv[1:] if argv is None else argv))
    finally:
        _end_start_up(freeze=False)  # a fit that ended before its start-up did (--help, an error, ranks)


def _main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] in ("--version", "-V"):
        print(f"flrun (fl-lightning) {VERSION}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"flrun: error: unknown command {command!r}; use one of {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    os.environ.setdefault("WANDB_SILENT", "true")
    show_messages()  # the package's notes and warnings (its modules log them) on stderr
    try:
        with guarded_output(), stopped_by_sigterm(command == "fit"):
            status = COMMANDS[command](rest)
            sys.stdout.flush()  # here, not at exit: an output that cannot be written is one line too
            return status
    except KeyboardInterrupt:
        print(f"flrun {command}: interrupted{_AFTER_INTERRUPT.get(command, '.')}", file=sys.stderr)
        return 130
    except Terminated:
        print(f"flrun {command}: stopped by SIGTERM{_AFTER_INTERRUPT.get(command, '.')}", file=sys.stderr)
        return 128 + signal.SIGTERM
    except Exception as err:  # noqa: BLE001 - a user error or the file system's: one line; anything else re-raised
        return error_status(command, err)


# what an interrupted command leaves, for its message (sweep and table say it themselves while they run)
_AFTER_INTERRUPT = {
    "fit": "; run the same command with --resume auto to continue from the last checkpoint, if one was written.",
    "sweep": "; run the same command again to finish the study.",
    "table": "; run the same command again to resume the runs.",
}


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
