"""``flrun report RUNS --wandb ENTITY/PROJECT``: a W&B Report (``wandb-workspaces``, the W&B Reports API) of the
runs, in the project their ``--logger wandb`` runs went to.

Per setting holding two experiments or more (``report.tradeoff``), the trade-off: each run's metric against the
MiB each client sent and received and against its local training GFLOPs per client, and the paper's points. Per
experiment (a recipe and its seeds, as the HTML report groups them): its paper reference, a run set of its
W&B runs grouped by recipe (the seeds as one line with their spread), a line plot of every round's monitored
metric, a run comparer (the runs' config side by side) and a table of each run's seed, W&B run, code version
(git commit), config hash and versions; before them the paper-vs-measured table, after them the sweeps. A
run's W&B id is read from the ``wandb/`` folder in its directory; runs logged without W&B are selected by
their recipe's name and seeds instead, and the report says so.

Building needs no account (``build_wandb_report``); saving does (``save_wandb_report``), and
``check_account`` says so in one sentence before anything is read.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from ..federation.errors import ConfigError
from .build import headline
from .figures import TRADEOFF_AXES, x_scale
from .markup import md, md_table
from .render import SUMMARY_HEADER, section_view, summary_rows
from .runs import BEST, KIB_PER_CLIENT_ROUND, KIB_TO, ROUNDS_TO
from .sweeps import sweep_view
from .tradeoff import TRADEOFF_NOTE, tradeoff_view

RUN_FOLDER = re.compile(r"^(?:offline-)?run-\d{8}_\d{6}-([A-Za-z0-9_-]+)$")  # wandb/run-20260101_120000-<id>
ACCOUNT = (
    "log in with `wandb login` (or set WANDB_API_KEY) and leave WANDB_MODE unset; without an account, "
    "--wandb_run logs the report's tables into an offline W&B run"
)


def report_target(text: str) -> tuple[str, str]:
    """``--wandb ENTITY/PROJECT`` as (entity, project), once the account is checked."""
    if text == "":  # --wandb alone: what it meant before it took the project
        raise ConfigError(
            "--wandb takes the W&B project of the runs as ENTITY/PROJECT and saves a W&B Report there; to log the "
            "report's tables into a W&B run instead (as --wandb alone did before), use --wandb_run [PROJECT]."
        )
    target = wandb_target(text)
    check_account()
    return target


def wandb_target(text: str) -> tuple[str, str]:
    """``ENTITY/PROJECT`` as (entity, project)."""
    entity, _, project = text.partition("/")
    if not entity or not project or "/" in project or any(c.isspace() for c in text):
        raise ConfigError(
            f"--wandb {text!r} must name the W&B entity and project of the runs as ENTITY/PROJECT, e.g. "
            "--wandb my-team/fl-lightning."
        )
    return entity, project


def check_account() -> None:
    """Refuses, before any work, to build a report that could not be saved: no account or W&B offline."""
    mode = os.environ.get("WANDB_MODE", "").lower()
    if mode in ("offline", "dryrun", "disabled"):
        raise ConfigError(f"saving a W&B Report needs a W&B account online, but WANDB_MODE is {mode}; {ACCOUNT}.")
    import wandb

    try:
        wandb.Api()
    except wandb.errors.UsageError:
        raise ConfigError(
            f"saving a W&B Report needs a W&B account, and no API key is configured; {ACCOUNT}."
        ) from None


def run_ids(run_dir: Path) -> list[str]:
    """The W&B run ids a run directory's ``wandb/`` folder holds (one, or one per resumed invocation alike)."""
    folder = run_dir / "wandb"
    found = [m.group(1) for p in sorted(folder.iterdir()) if (m := RUN_FOLDER.match(p.name))] if folder.is_dir() else []
    return list(dict.fromkeys(found))


def build_wandb_report(report: dict[str, Any], entity: str, project: str):
    """The W&B Report of ``report`` (``report.build.build_report``), for runs in ``entity/project``; not saved."""
    import wandb_workspaces.reports.v2 as wr

    blocks: list = [wr.P(f"{headline(report)}."), wr.TableOfContents()]
    blocks += [wr.P(f"Warning: {warning}") for warning in report["warnings"]]
    if report["sections"]:
        rows = [[md(cell) for cell in row] for row in summary_rows(report)]
        blocks += [wr.H2("Paper vs measured"), wr.MarkdownBlock("\n".join(md_table(SUMMARY_HEADER, rows)))]
    for tradeoff in report["tradeoffs"]:
        blocks += _tradeoff_blocks(wr, tradeoff, entity, project)
    for section in report["sections"]:
        blocks += _experiment_blocks(wr, section, entity, project)
    for sweep in report["sweeps"]:
        blocks += _sweep_blocks(wr, sweep)
    return wr.Report(
        project=project,
        entity=entity,
        title="Reproducibility report",
        description=f"{headline(report)}, from flrun report.",
        blocks=blocks,
        width="fluid",
    )


def _experiment_blocks(wr, section: dict, entity: str, project: str) -> list:
    view = section_view(section)
    counted = [p for p in section["comparison"]["provenance"] if p["counted"]]
    ids = {p["dir"]: run_ids(Path(p["dir"])) for p in counted}
    blocks = [wr.H2(view["name"])]
    if view["reference"]:
        blocks.append(wr.P(f"Paper: {view['reference']}."))
    blocks += [wr.P(text) for text in (view["runs"], view["experiment"]) if text]
    if all(ids.values()):
        filters = f"Metric('ID') in {sorted({i for found in ids.values() for i in found})!r}"
    else:
        seeds = sorted({p["seed"] for p in counted if isinstance(p["seed"], int) and not isinstance(p["seed"], bool)})
        filters = f"Config('name') == {_literal(section['recipe'])} and Config('seed') in {seeds!r}"
        missing = [d for d, found in ids.items() if not found]
        blocks.append(
            wr.P(
                f"Note: {len(missing)} of these runs have no W&B run in their directory (not logged with --logger "
                f"wandb), so this run set selects the runs of {project} named {section['recipe']} with seeds "
                f"{', '.join(map(str, seeds))}."
            )
        )
    runset = wr.Runset(entity=entity, project=project, name=view["name"], filters=filters, groupby=["config.name"])
    blocks.append(wr.PanelGrid(runsets=[runset], panels=_panels(wr, _plotted(section))))
    header = ["seed", "final", "best (round)", "wandb run id", "git commit", "config sha256", "versions", "hardware"]
    rows = [
        [md(text) for text, _ in row[:3]]
        + [md(", ".join(ids.get(p["dir"], [])) or "n/a"), md(p["git_commit"]), md(p["config_sha256"])]
        + [md(text) for text, _ in row[6:]]
        for row, p in zip(view["rows"], section["comparison"]["provenance"])
    ]
    blocks.append(wr.MarkdownBlock("\n".join(md_table(header, rows))))
    return blocks


def _tradeoff_blocks(wr, tradeoff: dict, entity: str, project: str) -> list:
    """A setting's trade-off as the HTML report draws it: a line plot of each method's metric against the runs'
    logged ``comm/mib_per_client`` and ``compute/gflops_per_client`` (one line per run), the points table with
    the paper's points, which a W&B plot cannot hold."""
    view = tradeoff_view(tradeoff)
    curves = [c for m in tradeoff["setting"].methods for c in m.curves]
    blocks = [wr.H2(f"Trade-off: {view['title']}"), wr.P(TRADEOFF_NOTE)]
    blocks += [wr.P(f"Note: {note}") for note in view["notes"]]
    ids = {c.root: run_ids(Path(c.root)) for c in curves}
    if all(ids.values()):
        filters = f"Metric('ID') in {sorted({i for found in ids.values() for i in found})!r}"
    else:
        names = ", ".join(_literal(n) for n in sorted({c.name for c in curves}))
        seeds = sorted({c.seed for c in curves if isinstance(c.seed, int) and not isinstance(c.seed, bool)})
        filters = f"Config('name') in [{names}] and Config('seed') in {seeds!r}"
        blocks.append(
            wr.P(
                f"Note: {sum(not found for found in ids.values())} of these runs have no W&B run in their directory "
                f"(not logged with --logger wandb), so this run set selects the runs of {project} by recipe name "
                "and seed."
            )
        )
    metrics = sorted({c.metric for c in curves})
    plots = []
    for i, (field, key, title) in enumerate(
        (
            ("mib", "comm/mib_per_client", TRADEOFF_AXES[0][1]),
            ("gflops", "compute/gflops_per_client", TRADEOFF_AXES[1][1]),
        )
    ):
        scale, _ = x_scale([x for c in curves for x in (getattr(c, field) or [])])
        plots.append(
            wr.LinePlot(
                title=f"{', '.join(metrics)} against {title}",
                x=key,  # logged every round by the runs, as the report computes it from their files
                y=metrics,
                title_x=title,
                title_y=", ".join(metrics),
                log_x=scale != "linear",
                layout=wr.Layout(x=12 * i, y=0, w=12, h=9),
            )
        )
    runset = wr.Runset(entity=entity, project=project, name=view["title"], filters=filters)
    rows = [[md(text) for text, _ in row] for row in view["rows"]]
    return [
        *blocks,
        wr.PanelGrid(runsets=[runset], panels=plots),
        wr.MarkdownBlock("\n".join(md_table(view["header"], rows))),
    ]


def _literal(text: str) -> str:
    """``text`` as a Python string literal for a run set's filter expression, which wandb-workspaces parses as
    Python: a name from a file cannot change the expression. Its ``=``, ``<`` and ``>`` are escapes, because
    the parser rewrites those characters (``<`` to ``<=``) even inside a string before it parses."""
    return repr(str(text)).replace("=", "\\x3d").replace("<", "\\x3c").replace(">", "\\x3e")


def _plotted(section: dict) -> list[str]:
    """The monitored metric, then the paper's other metrics that runs log every round (not derived ones; a
    ``best/<metric>`` as the curve of its metric)."""
    derived = (KIB_PER_CLIENT_ROUND, ROUNDS_TO, KIB_TO)
    metrics = [section["monitor"], *(row["metric"].removeprefix(BEST) for row in section["comparison"]["rows"])]
    return [m for m in dict.fromkeys(metrics) if not m.startswith(derived)]


def _panels(wr, metrics: list[str]) -> list:
    """A line plot per metric over rounds (the seeds' mean and standard deviation), then the runs' configs."""
    plots = [
        wr.LinePlot(
            title=f"{metric} per round",
            x="Step",  # runs log each round's metrics at step = round
            y=[metric],
            title_x="round",
            title_y=metric,
            groupby_aggfunc="mean",
            groupby_rangefunc="stddev",
            layout=wr.Layout(x=12 * (i % 2), y=8 * (i // 2), w=12, h=8),
        )
        for i, metric in enumerate(metrics)
    ]
    below = 8 * ((len(plots) + 1) // 2)
    return [*plots, wr.RunComparer(diff_only="split", layout=wr.Layout(x=0, y=below, w=24, h=10))]


def _sweep_blocks(wr, sweep: dict) -> list:
    view = sweep_view(sweep)
    blocks = [wr.H2(f"Sweep {view['study']}"), *(wr.P(fact) for fact in view["facts"])]
    blocks += [wr.P(f"Note: {note}") for note in view["notes"]]
    blocks.append(wr.P(f"The live study: {view['dashboard']} (pip install optuna-dashboard)."))
    rows = [[md(text) for text, _ in row] for row in view["rows"]]
    return [*blocks, wr.MarkdownBlock("\n".join(md_table(view["header"], rows)))]


def save_wandb_report(report) -> str:
    """Saves the report to W&B; returns its URL."""
    try:
        report.save()
        return report.url
    except Exception as err:  # noqa: BLE001 - wandb's and its HTTP client's errors, whatever their types
        reason = (str(err).strip() or type(err).__name__).splitlines()[0].rstrip(".")
        raise ConfigError(
            f"the W&B Report could not be saved to {report.entity}/{report.project} ({reason}); check that the "
            "entity and project exist and that your account may write there."
        ) from None
