"""``flrun report``: a reproducibility report of run and sweep directories, or one paper table."""

from __future__ import annotations

import sys
from pathlib import Path

from ..run.arguments import UserError
from .parsers import CommandParser


def run_report(argv: list[str]) -> int:
    """``flrun report RUN_OR_SWEEP_DIR... --output report.html|report.md [--wandb ENTITY/PROJECT] [--wandb_run
    [PROJECT]] [--table PAPER/TABLE]``."""

    from ..report.build import build_report, headline
    from ..report.render import write_html, write_markdown
    from ..report.runs import report_output
    from ..report.wandb_report import build_wandb_report, report_target, save_wandb_report

    parser = CommandParser(prog="flrun report", description="Reproducibility report against the papers.")
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
    parser.add_argument(
        "--table", help="render one paper table instead, e.g. paper-001/table-5 (docs/howto/paper_tables.md)"
    )
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
    print(f"report of {headline(report)}: {output}")
    if args.wandb_run:
        _log_run(report, args.wandb_run, output)
    if target is not None:
        print(f"W&B Report: {save_wandb_report(build_wandb_report(report, *target))}")
    return 0


def _log_run(report: dict, project: str, output: Path) -> None:
    """``--wandb_run``: the W&B run's files go beside the report, in ``<report>_wandb/`` (as a Markdown report's
    figures go in ``<report>_figures/``), not into a folder of runs or the working folder's ``wandb/``."""
    from ..report.render import log_to_wandb
    from ..tracking.loggers import shown_path

    folder = output.with_name(f"{output.stem}_wandb")
    folder.mkdir(parents=True, exist_ok=True)  # wandb falls back to a temporary folder for one that is missing
    run = log_to_wandb(report, project, folder)
    where = shown_path(run.settings.sync_dir)
    if run.offline:  # flrun silences wandb's own lines, its sync hint among them
        print(f"W&B run (offline): {where}; upload it with: wandb sync {where}")
    else:
        print(f"W&B run: {run.url}")


def _report_table(args) -> int:
    """``flrun report RUN_DIRS --table paper-001/table-5``: the paper's table, paper vs measured per cell."""
    from ..report.tables import build_table, write_table_html, write_table_markdown
    from ..run.recipes import RECIPES_DIR

    if args.wandb is not None or args.wandb_run:
        raise UserError(
            "--table writes a file only; leave out --wandb and --wandb_run (or run flrun report without --table)."
        )
    recipes = Path(args.recipes) if args.recipes else RECIPES_DIR
    if not recipes.is_dir():
        raise UserError(f"--recipes {recipes} is not a folder; give the folder holding the recipes (recipes/).")
    table = build_table(args.paths, args.table, recipes)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    (write_table_markdown if output.suffix == ".md" else write_table_html)(table, output)
    for warning in table["warnings"]:
        print(f"flrun report: warning: {warning}", file=sys.stderr)
    print(f"{table['id']}: {len(table['cells'])} cells, {table['runs']} runs: {output}")
    return 0
