"""HTML, Markdown and W&B-run output of ``flrun report``: the HTML page from ``templates/report.html.j2``
(autoescaped), Markdown with every value read from a file escaped by ``markup.md``."""

from __future__ import annotations

import io
from pathlib import Path

from ..federation.files import atomic_write
from .build import headline
from .groups import value_text
from .markup import md, md_table, save_figure
from .runs import MEASURED_NOTE, fmt, plural
from .tradeoff import TRADEOFF_NOTE, tradeoff_markdown, tradeoff_view

SUMMARY_HEADER = [
    "recipe",
    "metric",
    "paper",
    "paper std",
    "measured (final round)",
    "std over seeds",
    "at the best round",
    "best round",
    "runs",
    "measured − paper",
]


def _summary_cells(s: dict, row: dict) -> list[str]:
    return [
        str(s["name"]),
        str(row["metric"]),
        fmt(row["paper"]),
        fmt(row["paper_std"]),
        fmt(row["mean"]),
        fmt(row["std"]),
        fmt(row["best_mean"]),
        _rounds_text(s["comparison"]["best_rounds"]),
        str(row["n"]),
        fmt(row["delta"]),
    ]


def _rounds_text(rounds: list) -> str:
    """Each seed's best round, in seed order (``35, 38``), once when they agree; ``n/a`` where none is known."""
    shown = [str(r) if isinstance(r, int) and not isinstance(r, bool) else "n/a" for r in rounds]
    return shown[0] if len(set(shown)) == 1 else ", ".join(shown) if shown else "n/a"


def versions_text(versions: dict) -> str:
    """``fl_lightning 0.1.0, torch 2.6.0, lightning 2.5.1, python 3.11.7``: a run's package versions as words."""
    return ", ".join(f"{name} {version}" for name, version in versions.items()) or "n/a"


def summary_rows(report: dict) -> list[list[str]]:
    """The paper-vs-measured table's rows: one per experiment and metric."""
    return [_summary_cells(s, row) for s in report["sections"] for row in s["comparison"]["rows"]]


def _runs_text(c: dict) -> str:
    """``2 runs, seeds 0, 1 (1 copy of a seed not counted); communication per run: ...``."""
    copies = sum(1 for p in c["provenance"] if not p["counted"])
    not_counted = f" ({copies} {'copy' if copies == 1 else 'copies'} of a seed not counted)" if copies else ""
    return (
        f"{plural(len(c['seeds']), 'run')}, {'seed' if len(c['seeds']) == 1 else 'seeds'} "
        f"{', '.join(map(str, c['seeds']))}{not_counted}"
        f"{'' if c['complete'] else ' (some runs incomplete)'}; communication per run: "
        f"{fmt(c['uplink_mb'], 2)} MiB up, {fmt(c['downlink_mb'], 2)} MiB down."
    )


def _experiment_text(s: dict) -> str:
    """Where runs of this name have other recipes: this experiment's values of the keys they differ in."""
    if not s["differs"]:
        return ""
    values = "; ".join(f"{key} = {value_text(value)}" for key, value in s["differs"].items())
    return (
        f"Runs named {s['recipe']} come from different recipes (config.yaml) and are reported apart; this "
        f"experiment ({s['experiment']}) has {values}."
    )


def _seed_text(p: dict) -> str:
    return str(p["seed"]) + ("" if p["counted"] else " (same seed again, not counted)")


def _reference_text(ref: dict) -> str:
    parts = [str(ref[k]) for k in ("paper", "table", "row", "column") if ref.get(k) not in (None, "")]
    return ", ".join(parts)


def write_html(report: dict, path: Path) -> None:
    from .html import write_page
    from .sweeps import sweep_view

    write_page(
        "report.html.j2",
        path,
        headline=headline(report),
        warnings=report["warnings"],
        summary_header=SUMMARY_HEADER,
        summary_rows=[[(cell, "num" if i >= 2 else "") for i, cell in enumerate(row)] for row in summary_rows(report)],
        measured_note=MEASURED_NOTE,
        tradeoffs=[tradeoff_view(t) for t in report["tradeoffs"]],
        tradeoff_note=TRADEOFF_NOTE,
        sections=[section_view(s) for s in report["sections"]],
        sweeps=[sweep_view(sweep) for sweep in report["sweeps"]],
    )


def section_view(s: dict) -> dict:
    """One experiment's texts, figures and provenance rows, as report.html.j2 shows them."""
    c = s["comparison"]
    metric = c["rows"][0]["metric"]
    rows = [
        [
            (_seed_text(p), "num"),
            (fmt(p["final"]), "num"),
            (f"{fmt(p['best'])} (round {_rounds_text([p['best_round']])})", "num"),
            (p["dir"], ""),
            (p["config_sha256"], ""),
            (p["git_commit"], ""),
            (versions_text(p["versions"]), ""),
            (p["hardware"], ""),
        ]
        for p in c["provenance"]
    ]
    return {
        "name": s["name"],
        "reference": _reference_text(c["reference"]) if c["reference"] else "",
        "runs": _runs_text(c),
        "experiment": _experiment_text(s),
        "metric": metric,
        "curve": s["curve"],
        "panels": s["panels"],
        "clients": s["clients"],
        "header": [
            "seed",
            f"{metric} final",
            "best (round)",
            "run",
            "config sha256",
            "git commit",
            "versions",
            "hardware",
        ],
        "rows": rows,
    }


def write_markdown(report: dict, path: Path) -> None:
    from .sweeps import sweep_markdown

    lines = ["# Reproducibility report", "", f"{md(headline(report))}.", ""]
    lines += [f"Warning: {md(warning)}" for warning in report["warnings"]] + ([""] if report["warnings"] else [])
    if report["sections"]:
        rows = [[md(c) for c in row] for row in summary_rows(report)]
        lines += md_table(SUMMARY_HEADER, rows) + ["", md(MEASURED_NOTE)]
    figures = path.parent / f"{path.stem}_figures"
    for tradeoff in report["tradeoffs"]:
        lines += tradeoff_markdown(tradeoff_view(tradeoff), figures)
    for s in report["sections"]:
        c = s["comparison"]
        lines += ["", f"## {md(s['name'])}", ""]
        if c["reference"]:
            lines += [f"Paper: {md(_reference_text(c['reference']))}.", ""]
        lines.append(md(_runs_text(c)))
        if s["differs"]:
            lines += ["", md(_experiment_text(s))]
        for kind, image in (("curve", s["curve"]), ("clients", s["clients"])):
            if image:
                lines.append(f"![{kind}]({figures.name}/{save_figure(figures, s['name'], kind, image)})")
        lines.append("")
        lines += md_table(
            ["seed", "final", "best (round)", "config sha256", "git commit", "versions", "hardware"],
            [
                [
                    md(_seed_text(p)),
                    fmt(p["final"]),
                    f"{fmt(p['best'])} ({_rounds_text([p['best_round']])})",
                    md(p["config_sha256"]),
                    md(p["git_commit"]),
                    md(versions_text(p["versions"])),
                    md(p["hardware"]),
                ]
                for p in c["provenance"]
            ],
        )
    for sweep in report["sweeps"]:
        lines += sweep_markdown(sweep, figures)
    atomic_write(path, "\n".join(lines) + "\n")


def log_to_wandb(report: dict, project: str, directory: Path):
    """The comparison table, the sweeps' trials and the figures as one W&B run (offline with
    WANDB_MODE=offline), whose files go under ``directory``; returns the finished run."""
    import wandb
    from PIL import Image

    run = wandb.init(
        project=project, job_type="report", name="reproducibility-report", dir=str(directory), reinit="finish_previous"
    )
    table = wandb.Table(
        columns=["recipe", "metric", "paper", "paper_std", "final_mean", "final_std", "best_mean", "runs"]
    )
    for s in report["sections"]:
        for row in s["comparison"]["rows"]:
            table.add_data(
                s["name"],
                row["metric"],
                row["paper"],
                row["paper_std"],
                row["mean"],
                row["std"],
                row["best_mean"],
                row["n"],
            )
        if s["curve"]:
            run.log({f"curves/{s['name']}": wandb.Image(Image.open(io.BytesIO(s["curve"])))})
    for t in report["tradeoffs"]:
        if t["figure"]:
            run.log({f"tradeoff/{t['setting'].title}": wandb.Image(Image.open(io.BytesIO(t["figure"])))})
    run.log({"paper_vs_measured": table})
    for sweep in report["sweeps"]:
        if sweep["history"]:
            run.log({f"sweeps/{sweep['study']}/history": wandb.Image(Image.open(io.BytesIO(sweep["history"])))})
    run.finish()
    return run
