"""A report's content from run and sweep directories: one section per experiment (a name and recipe, one run
per seed) with its comparison against the paper and its figures, the sweeps, and the warnings."""

from __future__ import annotations

from typing import Any

from .figures import client_histogram_figure, curve_panels, learning_curve_figure, png, tradeoff_figure
from .groups import group_experiments, group_warnings
from .runs import compare, find_runs, load_run, plural
from .sweeps import load_sweep_dir
from .tradeoff import drawn_metric, report_settings


def build_report(paths: list[str]) -> dict[str, Any]:
    """One section per experiment (``report.groups``: one name and recipe, one run per seed), the trade-off of
    each setting holding two experiments or more (``report.tradeoff``), the sweeps, the number of runs found
    and the warnings (copies of a seed, differing reference blocks)."""
    run_dirs, sweep_dirs = find_runs(paths)
    runs = [load_run(root) for root in run_dirs]
    sections, warnings, experiments = [], [], []
    for group in group_experiments(runs):
        comparison = compare(group["runs"], group["duplicates"])
        row = comparison["rows"][0]
        sections.append(
            {
                "name": group["label"],
                "recipe": group["name"],
                "experiment": group["experiment"],
                "differs": group["differs"],
                "comparison": comparison,
                "monitor": str(group["runs"][0]["summary"].get("monitor") or row["metric"]),
                "curve": png(learning_curve_figure(group["runs"], row["metric"], row["paper"])),
                "panels": curve_panels(group["runs"], row["metric"]),
                "clients": png(client_histogram_figure(group["runs"])),
            }
        )
        warnings += group_warnings(group)
        metrics = [r["metric"] for r in comparison["rows"]]
        position = drawn_metric(metrics)
        if position is not None:
            metric, reference = metrics[position], comparison["reference"]
            experiments.append(
                {"label": group["label"], "metric": metric, "runs": group["runs"], "reference": reference}
            )
    warnings += [warning for run in runs for warning in run["warnings"]]
    sweeps = [load_sweep_dir(root) for root in sweep_dirs]
    tradeoffs = [{"setting": s, "figure": png(tradeoff_figure(s))} for s in report_settings(experiments)]
    return {"sections": sections, "tradeoffs": tradeoffs, "sweeps": sweeps, "runs": len(runs), "warnings": warnings}


def headline(report: dict) -> str:
    text = f"{plural(report['runs'], 'run')} in {plural(len(report['sections']), 'recipe')}"
    return text + (f" and {plural(len(report['sweeps']), 'sweep')}" if report["sweeps"] else "")
