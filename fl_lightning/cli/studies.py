"""``flrun sweep`` (an Optuna study over a recipe) and ``flrun table`` (the runs a paper table lacks, then the
table): the commands that start many ``flrun fit`` runs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..run.arguments import UserError
from .parsers import CommandParser


def split_fit_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """The command's own arguments, and those after ``--``, which go to every ``flrun fit`` it starts (``-c`` in
    them written as ``--config``, as ``flrun fit`` reads it)."""
    from ..run.messages import long_config

    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], long_config(argv[cut + 1 :])


def run_sweep_command(argv: list[str]) -> int:
    """``flrun sweep --config SWEEP.yaml [--n_trials N] [--timeout S] [--n_jobs K] [--storage URL] [-- FIT_ARGS]``."""
    import argparse
    import json

    from ..sweep.spec import check_against_recipe, read_sweep

    argv, fit_args = split_fit_args(argv)
    parser = CommandParser(
        prog="flrun sweep",
        description="Optuna study over a base recipe. Arguments after -- go to every trial's flrun fit "
        "(e.g. -- --rounds 4); like the sweep file's overrides, they are part of what defines the study.",
    )
    parser.add_argument("-c", "--config", required=True, help="sweep file (sweeps/*.yaml)")
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


def run_table(argv: list[str]) -> int:
    """``flrun table PAPER/TABLE [--seeds ...] [--runs DIR] [--n_jobs K] [--dry_run] [--skip_missing] [-- FIT_ARGS]``.

    The data of every run to do are checked before any starts (:mod:`fl_lightning.sweep.table_data`).
    """

    from ..report.runs import report_output
    from ..report.tables import build_table, write_table_html, write_table_markdown
    from ..run.recipes import RECIPES_DIR
    from ..sweep.table import check_fit_args, plan, run_all

    argv, fit_args = split_fit_args(argv)
    parser = CommandParser(
        prog="flrun table",
        description="Runs every recipe x seed a paper table still lacks (complete runs are skipped, interrupted "
        "ones resume), then writes the table as flrun report --table does. Arguments after -- go to every flrun fit.",
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
    parser.add_argument(
        "--skip_missing",
        action="store_true",
        help="run only the runs whose data sets are there and say how many were skipped (without it, runs that "
        "lack their data stop the command before any run starts)",
    )
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    recipes = Path(args.recipes) if args.recipes else RECIPES_DIR
    if not recipes.is_dir():
        raise UserError(f"--recipes {recipes} is not a folder; give the folder holding the recipes (recipes/).")
    if args.n_jobs < 1:
        raise UserError(f"--n_jobs must be at least 1, got {args.n_jobs}.")
    check_fit_args(fit_args)
    if args.output:
        report_output(args.output)  # .html or .md, refused before any run starts
    runs = plan(args.table, args.seeds, Path(args.runs), recipes)
    if args.dry_run:
        from ..sweep.table_preview import preview

        preview(runs, fit_args, args.n_jobs, sys.stdout)
        return 0
    from ..sweep.table_data import check_data

    states = {id(run): run.state(fit_args) for run in runs}
    _, skipped = check_data([r for r in runs if states[id(r)] != "done"], fit_args, args.skip_missing, sys.stdout)
    runs = [run for run in runs if run not in skipped]
    try:
        done, failed = run_all(runs, fit_args, args.n_jobs, sys.stdout, states)
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
    if skipped:
        print(f"{len(skipped)} runs skipped: their data are missing (--dry_run lists them)")
    return 1 if failed else 0
