"""``flrun``: the command line. ``flrun fit --config recipes/quickstart.yaml [--key.sub value ...]``.

The parser is generated from the typed signature of :func:`fl_lightning.run.fit.fit` (jsonargparse), so
``flrun fit --help`` documents every knob and recipes name components by ``class_path`` / ``init_args``.
Every user error ends as one line on stderr and exit status 2, never a traceback.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from ..run.arguments import UserError, fit_from_argv, fit_parser, parse_fit, recipe_name
from .errors import Terminated, error_status, stopped_by_sigterm
from .models import run_models

_UserError, _recipe_name = UserError, recipe_name  # the names other modules and tests knew
__all__ = ["fit_from_argv", "fit_parser", "main", "parse_fit"]

USAGE = """usage: flrun COMMAND [options]

commands:
  fit      run a federated experiment from a recipe: flrun fit --config recipes/quickstart.yaml
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
    if argv in (["--help"], ["-h"]):
        return _fit_help()
    _, init, resolved = parse_fit(argv)  # first: a mistake is answered before the imports a run needs
    from ..distributed.launch import launch
    from ..distributed.ranks import check_shardable, from_env, needs_launch
    from ..run.fit import fit, summary_metrics

    runtime = init.runtime
    if needs_launch(runtime.devices):  # --runtime.devices N: this process starts the N ranks and waits for them
        check_shardable(runtime.devices, init.schedule, init.training.optimizer_state)
        root = Path(init.output_dir or Path("runs") / (init.name or "run") / f"seed{init.seed}")
        from ..run.run_dir import check_output_dir

        check_output_dir(root)  # a folder that is not this run's is refused before run.lock is put in it
        if root.is_dir():  # a run another process writes: refused here, not by rank 0 while the others wait
            from ..tracking.run_files import RunLock

            with RunLock(root) as probe:
                probe.acquire()
        return launch(["fit", *argv], runtime.devices)
    from ..distributed.fabric import fabric_class

    fabric_class()  # the last import of start-up: fit() makes its Fabric from it
    _end_start_up()
    summary = fit(**{k: v for k, v in vars(init).items() if k not in ("config", "__path__")}, resolved_config=resolved)
    if from_env().rank > 0:  # under torchrun or srun every rank ends here: rank 0 reports
        return 0
    print(summary_metrics(summary))
    print(f"run files: {summary['output_dir']}")
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


def run_data(argv: list[str]) -> int:
    """``flrun data inspect --config RECIPE [--output PNG] [overrides]`` or
    ``flrun data fetch DATASET [--data_dir data] [--revision COMMIT] [--force]``."""
    if argv and argv[0] == "fetch":
        import argparse

        from ..data import catalog, sources

        names = ", ".join(s.name for s in catalog.SOURCES)
        parser = argparse.ArgumentParser(
            prog="flrun data fetch",
            description="Download a data set (or the ViT weights) into data_dir and verify its checksums, e.g. on "
            "a login node with internet, so that runs on an offline machine find the files.",
            allow_abbrev=False,
        )
        parser.add_argument("dataset", help=f"one of {names} (or the data set's class name)")
        parser.add_argument("--data_dir", default="data", help="the recipes' data_dir (default: data)")
        parser.add_argument("--revision", help="Hub commit for Hub data sets (FEMNIST and C4 have none pinned)")
        parser.add_argument("--force", action="store_true", help="download again even if the files are present")
        args = parser.parse_args(argv[1:])
        source = catalog.source(args.dataset)
        if sources.present(source, Path(args.data_dir)) and not args.force:
            sources.ensure(source.name, args.data_dir, download=False, revision=args.revision)
            print(f"{source.title}: already in {Path(args.data_dir) / source.layout} (--force downloads it again)")
            return 0
        paths = sources.fetch(source.name, args.data_dir, args.revision, force=args.force)
        print(f"{source.title}: downloaded and verified, {len(paths)} files in {Path(args.data_dir) / source.layout}")
        return 0
    from ..data.inspect import bubble_chart, client_table, print_summary

    if not argv or argv[0] != "inspect":
        raise _UserError(
            "usage: flrun data inspect --config RECIPE [--output chart.png] [--key value ...], or "
            "flrun data fetch DATASET [--data_dir data]."
        )
    argv = argv[1:]
    output = None
    if "--output" in argv:
        i = argv.index("--output")
        output = argv[i + 1] if i + 1 < len(argv) else None
        argv = argv[:i] + argv[i + 2 :]
    cfg, init, _ = parse_fit(argv, prog="flrun data inspect")
    data, clients = init.data, init.population.build(cfg.seed)
    data.setup(len(clients), cfg.seed)
    rows = client_table(data)
    print_summary(data, rows)
    name = cfg.get("name") or _recipe_name(argv)
    print(f"client-by-class chart: {bubble_chart(data, _chart_path(output, cfg.output_dir, name, cfg.seed))}")
    return 0


# what makes a folder a run's (flrun fit writes them): inspect's chart never goes into one
RUN_FILES = ("config.yaml", "summary.json", "metrics.csv", "partition.json", "checkpoints")


def _chart_path(output: str | None, output_dir: str | None, name: str, seed: int) -> Path:
    """``--output``, or beside the recipe's run folder (``runs/<name>/seed<k>.partition.png``): a run's folder holds
    only what its run wrote, so a later run there is not refused and a run's own files are not replaced."""
    run = Path(output_dir or Path("runs") / name / f"seed{seed}")
    path = Path(output) if output else run.with_name(f"{run.name}.partition.png")
    if any((path.parent / file).exists() for file in RUN_FILES):
        raise _UserError(
            f"--output {path} lies in the run folder {path.parent}, which holds a run's files; give a path outside "
            f"it, e.g. --output {path.parent.with_name(path.parent.name + '.partition.png')}."
        )
    return path


def run_sweep_command(argv: list[str]) -> int:
    """``flrun sweep --config SWEEP.yaml [--n_trials N] [--timeout S] [--n_jobs K] [--storage URL] [-- FIT_ARGS]``."""
    import argparse
    import json

    from ..sweep.spec import check_against_recipe, read_sweep

    fit_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="flrun sweep",
        description="Optuna study over a base recipe. Arguments after -- go to every trial's flrun fit "
        "(e.g. -- --rounds 4); like the sweep file's overrides, they are part of what defines the study.",
        allow_abbrev=False,
    )
    parser.add_argument("--config", required=True, help="sweep file (sweeps/*.yaml)")
    parser.add_argument("--n_trials", type=int, help="trials in the study in total (re-running resumes up to it)")
    parser.add_argument("--timeout", type=float, help="seconds to keep starting trials")
    parser.add_argument("--n_jobs", type=int, default=1, help="worker processes sharing the study's storage")
    parser.add_argument("--storage", help="Optuna RDB URL (default: SQLite in the sweep directory)")
    parser.add_argument("--study_name", help="study name (default: the sweep file's name)")
    parser.add_argument("--output_dir", help="sweep directory (default runs/sweeps/<study>)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of the table")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set by the coordinator for its workers
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    storage = args.storage or (os.environ.get("FLRUN_SWEEP_STORAGE") if args.worker else None) or None
    cli = {"n_trials": args.n_trials, "timeout": args.timeout, "storage": storage}
    cli.update(study_name=args.study_name, output_dir=args.output_dir)
    spec = read_sweep(args.config, fit_args, **cli)
    if args.worker:
        from ..sweep.workers import run_worker

        return run_worker(spec, json.loads(args.worker))
    if not args.json:  # said before the recipe is parsed (torch, Optuna): the first seconds are not silent
        trials = f" -- {' '.join(fit_args)}" if fit_args else ""
        print(
            f"sweep {spec.study_name}: {spec.n_trials} trial{'s' * (spec.n_trials != 1)} of {spec.base}{trials}, "
            f"{spec.direction} {spec.metric} "
            f"({spec.use}); checking the recipe and the search space",
            flush=True,
        )
    warnings = check_against_recipe(spec)
    from ..sweep.run import run_sweep

    try:
        if args.json:
            with open(os.devnull, "w") as quiet:
                result, status = run_sweep(spec, args.n_jobs, args.config, out=quiet, warnings=warnings)
            print(json.dumps(result, indent=2, default=str))
        else:
            result, status = run_sweep(spec, args.n_jobs, args.config, warnings=warnings)
    except KeyboardInterrupt:
        print("flrun sweep: interrupted; re-run the same command to finish the study.", file=sys.stderr)
        return 130
    return status


def run_report(argv: list[str]) -> int:
    """``flrun report RUN_OR_SWEEP_DIR... --output report.html|report.md [--wandb ENTITY/PROJECT] [--wandb_run
    [PROJECT]] [--table PAPER/TABLE]``."""
    import argparse

    from ..report.build import build_report, headline
    from ..report.render import log_to_wandb, write_html, write_markdown
    from ..report.runs import report_output
    from ..report.wandb_report import build_wandb_report, report_target, save_wandb_report

    parser = argparse.ArgumentParser(prog="flrun report", description="Reproducibility report against the papers.")
    parser.add_argument("paths", nargs="+", help="run or sweep directories")
    parser.add_argument("--output", default="report.html", help="report file (.html or .md)")
    parser.add_argument(
        "--wandb", nargs="?", const="", metavar="ENTITY/PROJECT",
        help="also save a W&B Report in the W&B project the runs were logged to (--logger wandb; needs an account)",
    )  # fmt: skip
    parser.add_argument(
        "--wandb_run", nargs="?", const="fl-lightning", metavar="PROJECT",
        help="also log the tables and figures into a W&B run of PROJECT (default fl-lightning; works offline)",
    )  # fmt: skip
    parser.add_argument("--table", help="render one paper table instead, e.g. paper-001/table-5 (docs/howto/paper_tables.md)")
    parser.add_argument("--recipes", help="recipe folder whose reference blocks define the table (default: recipes/)")
    args = parser.parse_args(argv)
    output = report_output(args.output)  # .html or .md, refused before anything is read
    if args.table is not None:
        return _report_table(args)
    # --wandb: refused (no account, W&B offline) before anything is read
    target = None if args.wandb is None else report_target(args.wandb)
    report = build_report(args.paths)
    for warning in report["warnings"]:
        print(f"flrun report: warning: {warning}", file=sys.stderr)
    output.parent.mkdir(parents=True, exist_ok=True)
    (write_markdown if output.suffix == ".md" else write_html)(report, output)
    if args.wandb_run:
        log_to_wandb(report, args.wandb_run, output.parent)
    print(f"report of {headline(report)}: {output}")
    if target is not None:
        print(f"W&B Report: {save_wandb_report(build_wandb_report(report, *target))}")
    return 0


def _report_table(args) -> int:
    """``flrun report RUN_DIRS --table paper-001/table-5``: the paper's table, paper vs measured per cell."""
    from ..report.tables import build_table, write_table_html, write_table_markdown
    from ..run.recipes import RECIPES_DIR

    if args.wandb is not None or args.wandb_run:
        raise _UserError(
            "--table writes a file only; leave out --wandb and --wandb_run (or run flrun report without --table)."
        )
    recipes = Path(args.recipes) if args.recipes else RECIPES_DIR
    if not recipes.is_dir():
        raise _UserError(f"--recipes {recipes} is not a folder; give the folder holding the recipes (recipes/).")
    table = build_table(args.paths, args.table, recipes)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    (write_table_markdown if output.suffix == ".md" else write_table_html)(table, output)
    for warning in table["warnings"]:
        print(f"flrun report: warning: {warning}", file=sys.stderr)
    print(f"{table['id']}: {len(table['cells'])} cells, {table['runs']} runs: {output}")
    return 0


def run_table(argv: list[str]) -> int:
    """``flrun table PAPER/TABLE [--seeds ...] [--runs DIR] [--n_jobs K] [--dry_run] [-- FIT_ARGS...]``."""
    import argparse

    from ..report.runs import report_output
    from ..report.tables import build_table, write_table_html, write_table_markdown
    from ..run.recipes import RECIPES_DIR
    from ..sweep.table import check_fit_args, plan, run_all

    fit_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(
        prog="flrun table",
        description="Runs every recipe x seed a paper table still lacks (complete runs are skipped, interrupted "
        "ones resume), then writes the table as flrun report --table does. Arguments after -- go to every flrun fit.",
        allow_abbrev=False,
    )
    parser.add_argument("table", help="the table's id, e.g. paper-001/table-5 (an unknown id lists the known ones)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of every cell (default 0 1 2)")
    parser.add_argument("--runs", default="runs/tables", help="run directories go under RUNS/<paper>/<recipe>/")
    parser.add_argument("--n_jobs", type=int, default=1, help="runs at once, each its own process on one GPU")
    parser.add_argument("--recipes", help="recipe folder whose reference blocks define the table (default: recipes/)")
    parser.add_argument("--output", help="the table file, .html or .md (default RUNS/<paper>/<table>.html)")
    parser.add_argument(
        "--dry_run",
        action="store_true",
        help="list the runs, whether each is done and whether its data is there, their total and a time estimate",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    recipes = Path(args.recipes) if args.recipes else RECIPES_DIR
    if not recipes.is_dir():
        raise _UserError(f"--recipes {recipes} is not a folder; give the folder holding the recipes (recipes/).")
    if args.n_jobs < 1:
        raise _UserError(f"--n_jobs must be at least 1, got {args.n_jobs}.")
    check_fit_args(fit_args)
    if args.output:
        report_output(args.output)  # .html or .md, refused before any run starts
    runs = plan(args.table, args.seeds, Path(args.runs), recipes)
    if args.dry_run:
        from ..sweep.table_preview import preview

        preview(runs, fit_args, args.n_jobs, sys.stdout)
        return 0
    try:
        done, failed = run_all(runs, fit_args, args.n_jobs, sys.stdout)
    except KeyboardInterrupt:
        print("flrun table: interrupted; run the same command again to resume the runs.", file=sys.stderr)
        return 130
    paper, _, name = args.table.partition("/")
    output = report_output(args.output) if args.output else Path(args.runs) / paper / f"{name}.html"
    table = build_table([str(run.output_dir) for run in done], args.table, recipes)  # this plan's complete runs
    output.parent.mkdir(parents=True, exist_ok=True)
    (write_table_markdown if output.suffix == ".md" else write_table_html)(table, output)
    for warning in table["warnings"]:
        print(f"flrun table: warning: {warning}", file=sys.stderr)
    print(f"{table['id']}: {len(table['cells'])} cells, {table['runs']} runs: {output}")
    for run, reason in failed:
        print(f"flrun table: {run.name} failed: {reason} (log {run.log})", file=sys.stderr)
    return 1 if failed else 0


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "report": run_report,
    "fit": run_fit,
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
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"flrun: error: unknown command {command!r}; use one of {', '.join(COMMANDS)}.", file=sys.stderr)
        return 2
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        with stopped_by_sigterm(command == "fit"):
            return COMMANDS[command](rest)
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
