"""``flrun report``: reproducibility reports from run (or sweep) directories against the papers' numbers."""

from __future__ import annotations

import base64
import csv
import html
import io
import json
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ConfigError


def find_runs(paths: list[str]) -> list[Path]:
    """Every run directory (one holding summary.json) at or below ``paths``."""
    runs: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ConfigError(f"{path} does not exist; give run or sweep directories (those holding summary.json).")
        runs += sorted(p.parent for p in path.rglob("summary.json"))
    if not runs:
        raise ConfigError(f"no run directory (with a summary.json) under {', '.join(paths)}.")
    return runs


def load_run(root: Path) -> dict[str, Any]:
    summary = json.loads((root / "summary.json").read_text())
    curve = []
    if (root / "metrics.csv").is_file():
        with (root / "metrics.csv").open() as f:
            curve = [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f)]
    return {"root": root, "summary": summary, "curve": curve}


def group_runs(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs of one recipe (its name) with different seeds form one group."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run["summary"].get("name") or run["root"].name, []).append(run)
    return groups


def compare(group: list[dict]) -> dict[str, Any]:
    """Measured mean and spread over seeds of every metric the paper reports for this recipe."""
    first = group[0]["summary"]
    reference = first.get("reference") or {}
    wanted = dict(reference.get("metrics") or {})
    if not wanted and "metric" in reference:
        wanted = {reference["metric"]: reference.get("value")}
    if not wanted:
        wanted = {first["monitor"]: None}
    rows = []
    for metric, paper in wanted.items():
        values = [r["summary"]["final"].get(metric) for r in group if metric in r["summary"]["final"]]
        mean = float(np.mean(values)) if values else None
        rows.append(
            {
                "metric": metric,
                "paper": paper,
                "mean": mean,
                "std": float(np.std(values)) if values else None,
                "n": len(values),
                "delta": (mean - paper) if (mean is not None and paper is not None) else None,
            }
        )
    return {
        "rows": rows,
        "reference": reference,
        "seeds": sorted(r["summary"].get("seed") for r in group),
        "complete": all(r["summary"].get("complete", True) for r in group),
        "uplink_mb": np.mean([r["summary"]["comm"]["uplink_bytes"] for r in group]) / 2**20,
        "downlink_mb": np.mean([r["summary"]["comm"]["downlink_bytes"] for r in group]) / 2**20,
        "provenance": [
            {
                "seed": r["summary"].get("seed"),
                "dir": str(r["root"]),
                "config_sha256": (r["summary"].get("config_sha256") or "")[:12],
                "git_commit": r["summary"].get("versions", {}).get("git_commit", "n/a")[:12],
                "versions": {k: v for k, v in r["summary"].get("versions", {}).items() if k != "git_commit"},
            }
            for r in group
        ],
    }


def _figure_png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
    return buffer.getvalue()


def learning_curve(group: list[dict], metric: str) -> bytes | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    drawn = False
    for run in group:
        points = [(row["round"], row[metric]) for row in run["curve"] if metric in row]
        if points:
            ax.plot(*zip(*points), marker=".", label=f"seed {run['summary'].get('seed')}")
            drawn = True
    reference = group[0]["summary"].get("reference") or {}
    paper = (reference.get("metrics") or {}).get(
        metric, reference.get("value") if reference.get("metric") == metric else None
    )
    if paper is not None:
        ax.axhline(paper, color="black", linestyle="--", label="paper")
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.legend(fontsize=7)
    data = _figure_png(fig) if drawn else None
    plt.close(fig)
    return data


def client_histogram(group: list[dict]) -> bytes | None:
    accs = [a for r in group for a in r["summary"].get("per_client_acc", {}).values()]
    if not accs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5, 3))
    ax.hist(accs, bins=min(20, max(5, len(accs) // 2)), color="tab:green", alpha=0.8)
    ax.set_xlabel("personalized test accuracy")
    ax.set_ylabel("clients (all seeds)")
    data = _figure_png(fig)
    plt.close(fig)
    return data


def _fmt(value, digits=4):
    return "n/a" if value is None else f"{value:.{digits}f}"


def build_report(paths: list[str]) -> dict[str, Any]:
    runs = [load_run(root) for root in find_runs(paths)]
    sections = []
    for name, group in sorted(group_runs(runs).items()):
        comparison = compare(group)
        metric = comparison["rows"][0]["metric"]
        sections.append(
            {
                "name": name,
                "comparison": comparison,
                "curve": learning_curve(group, metric),
                "clients": client_histogram(group),
            }
        )
    return {"sections": sections, "runs": len(runs)}


def write_html(report: dict, path: Path) -> None:
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>fl-lightning reproducibility report</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px}h2{margin-top:2em}</style></head><body>",
        f"<h1>Reproducibility report</h1><p>{report['runs']} runs in {len(report['sections'])} recipes.</p>",
        "<table><tr><th>recipe</th><th>metric</th><th>paper</th><th>measured mean</th><th>std</th><th>seeds</th>"
        "<th>measured - paper</th></tr>",
    ]
    for s in report["sections"]:
        for row in s["comparison"]["rows"]:
            parts.append(
                f"<tr><td>{html.escape(s['name'])}</td><td>{html.escape(row['metric'])}</td>"
                f"<td>{_fmt(row['paper'])}</td><td>{_fmt(row['mean'])}</td><td>{_fmt(row['std'])}</td>"
                f"<td>{row['n']}</td><td>{_fmt(row['delta'])}</td></tr>"
            )
    parts.append("</table>")
    for s in report["sections"]:
        c = s["comparison"]
        ref = c["reference"]
        parts.append(f"<h2>{html.escape(s['name'])}</h2>")
        if ref:
            parts.append(
                f"<p>Paper: {html.escape(str(ref.get('paper', '')))}, {html.escape(str(ref.get('table', '')))}, "
                f"{html.escape(str(ref.get('column', '')))}.</p>"
            )
        parts.append(
            f"<p>Seeds {c['seeds']}{'' if c['complete'] else ' (some runs incomplete)'}; communication per run: "
            f"{c['uplink_mb']:.2f} MiB up, {c['downlink_mb']:.2f} MiB down.</p>"
        )
        for title, image in (("learning curve", s["curve"]), ("per-client accuracy", s["clients"])):
            if image:
                parts.append(f"<img alt='{title}' src='data:image/png;base64,{base64.b64encode(image).decode()}'>")
        parts.append(
            "<table><tr><th>seed</th><th>run</th><th>config sha256</th><th>git commit</th><th>versions</th></tr>"
        )
        for p in c["provenance"]:
            parts.append(
                f"<tr><td>{p['seed']}</td><td>{html.escape(p['dir'])}</td><td>{p['config_sha256']}</td>"
                f"<td>{p['git_commit']}</td><td>{html.escape(json.dumps(p['versions']))}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts))


def write_markdown(report: dict, path: Path) -> None:
    lines = [
        "# Reproducibility report",
        "",
        f"{report['runs']} runs in {len(report['sections'])} recipes.",
        "",
        "| recipe | metric | paper | measured mean | std | seeds | measured - paper |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in report["sections"]:
        for row in s["comparison"]["rows"]:
            lines.append(
                f"| {s['name']} | {row['metric']} | {_fmt(row['paper'])} | {_fmt(row['mean'])} | "
                f"{_fmt(row['std'])} | {row['n']} | {_fmt(row['delta'])} |"
            )
    figures = path.parent / f"{path.stem}_figures"
    for s in report["sections"]:
        c = s["comparison"]
        lines += [
            "",
            f"## {s['name']}",
            "",
            f"Seeds {c['seeds']}; {c['uplink_mb']:.2f} MiB up, {c['downlink_mb']:.2f} MiB down per run.",
        ]
        for kind, image in (("curve", s["curve"]), ("clients", s["clients"])):
            if image:
                figures.mkdir(parents=True, exist_ok=True)
                file = figures / f"{s['name'].replace('/', '_')}_{kind}.png"
                file.write_bytes(image)
                lines.append(f"![{kind}]({figures.name}/{file.name})")
        lines += ["", "| seed | config sha256 | git commit |", "|---|---|---|"]
        lines += [f"| {p['seed']} | {p['config_sha256']} | {p['git_commit']} |" for p in c["provenance"]]
    path.write_text("\n".join(lines) + "\n")


def log_to_wandb(report: dict, project: str, directory: Path) -> None:
    """The comparison table and the figures as one W&B run (offline with WANDB_MODE=offline), whose
    files go under ``directory`` (beside the report)."""
    import wandb

    run = wandb.init(
        project=project, job_type="report", name="reproducibility-report", dir=str(directory), reinit="finish_previous"
    )
    table = wandb.Table(columns=["recipe", "metric", "paper", "mean", "std", "seeds"])
    for s in report["sections"]:
        for row in s["comparison"]["rows"]:
            table.add_data(s["name"], row["metric"], row["paper"], row["mean"], row["std"], row["n"])
        if s["curve"]:
            from PIL import Image

            run.log({f"curves/{s['name']}": wandb.Image(Image.open(io.BytesIO(s["curve"])))})
    run.log({"paper_vs_measured": table})
    run.finish()
