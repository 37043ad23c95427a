"""The trade-off heterogeneous-model methods argue about: accuracy against what each client sent and received
and against the local training it did, per setting, one curve per method and seed, with the paper's points.

A **setting** is a set of experiments whose accuracies compare: in ``flrun report``, the experiments
(``groups.py``) on one data set, the same ``data`` block of their recipes, whose reported metrics are of one
kind (``test_acc``); in ``flrun report --table``, the cells of one setting of the table (a column of paper
004's Table 3), each method its cell. A method is drawn with its first reported metric (the reference block's,
else the run's monitor) that is not a traffic, compute or rounds figure; its curve per seed runs through its
evaluated rounds (metrics.csv): x is the cumulative traffic down and up (``comm/uplink_bytes +
comm/downlink_bytes``, the ledger's) or local training FLOPs (``compute/train_flops``, ``client/flops.py``'s
estimate) divided by the population's clients (``population.num_clients`` of the run's config.yaml): what the
mean client spent. The paper's points come from the reference block: ``comm/kib_to/<metric>@X`` (paper 004's
CO, total KiB until the metric reaches X) is the point (CO / clients, X); ``comm/kib_per_client_round`` (its
CO/c/r, per participating client and round) with the paper's value of the metric is placed after the recipe's
rounds, each taking its clients per round.

Everything is read from files a run wrote (or someone handed over): numbers are used only where they are numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .groups import UNKNOWN, _differences, _digest, _flatten, _label, _short_names
from .runs import (
    KIB_PER_CLIENT_ROUND,
    KIB_TO,
    ROUNDS_TO,
    clients_per_round_of,
    fmt,
    number,
    paper_values,
    read_config,
    run_metric,
)

MIB = 2**20
TRAFFIC = ("comm/uplink_bytes", "comm/downlink_bytes")
FLOPS = "compute/train_flops"


@dataclass
class RunCurve:
    """One run's points, one per evaluated round: its metric, and per client of the population the MiB sent and
    received and the local training GFLOPs so far (None: the run recorded no compute); its directory and name."""

    root: str
    name: str
    seed: Any
    metric: str
    rounds: list[float]
    acc: list[float]
    mib: list[float]
    gflops: list[float] | None


@dataclass
class PaperPoint:
    """A point the paper states: its metric's value at the MiB per client it puts it at, and where it comes from."""

    acc: float
    mib: float
    source: str


@dataclass
class Method:
    """One method of a setting: an experiment (``flrun report``) or a table cell (``--table``)."""

    label: str
    metric: str
    curves: list[RunCurve]
    paper: list[PaperPoint]


@dataclass
class Setting:
    """The methods whose trade-off one figure draws, and what was left out of it."""

    title: str
    methods: list[Method]
    notes: list[str] = field(default_factory=list)


NOT_DRAWN = ("comm/", "compute/", ROUNDS_TO)  # the x axes themselves, and rounds: never a method's y


def drawn_metric(metrics: list[str]) -> int | None:
    """The position of the metric a method is drawn with: its reference's (or monitor's) first that is not a
    traffic, compute or rounds figure; None when all are."""
    return next((i for i, metric in enumerate(metrics) if not metric.startswith(NOT_DRAWN)), None)


def population_size(config: dict | None) -> int | None:
    """``population.num_clients`` of a resolved recipe (None when it names none)."""
    population = config.get("population") if isinstance(config, dict) else None
    clients = number(population.get("num_clients")) if isinstance(population, dict) else None
    return int(clients) if clients is not None and clients >= 1 else None


def run_curve(run: dict, metric: str) -> RunCurve | None:
    """The run's curve of ``metric`` against the traffic and compute per client; None without its population
    size (config.yaml) or an evaluated round with the metric and the traffic."""
    clients = population_size(read_config(run["root"]))
    rows = [r for r in run["curve"] if metric in r and all(k in r for k in TRAFFIC)]
    if clients is None or not rows:
        return None
    flops = [r.get(FLOPS) for r in rows]
    return RunCurve(
        root=str(run["root"]),
        name=str(run["summary"].get("name") or run["root"].name),
        seed=run["summary"].get("seed"),
        metric=metric,
        rounds=[r["round"] for r in rows],
        acc=[r[metric] for r in rows],
        mib=[(r[TRAFFIC[0]] + r[TRAFFIC[1]]) / clients / MIB for r in rows],
        gflops=None if None in flops else [f / clients / 1e9 for f in flops],
    )


def paper_points(reference: dict, metric: str, config: dict | None) -> list[PaperPoint]:
    """The points the reference block states for ``metric`` (module docstring), placed with ``config``'s
    population, rounds and sampler."""
    values = {name: value for name, (value, _) in paper_values(reference).items() if value is not None}
    clients = population_size(config)
    if clients is None:
        return []
    points = []
    per_round, final = values.get(KIB_PER_CLIENT_ROUND), values.get(metric)
    rounds = number(config.get("rounds"))
    sampled = clients_per_round_of(config)
    if per_round is not None and final is not None and rounds and sampled:
        mib = per_round * rounds * sampled / clients / 1024
        points.append(PaperPoint(final, mib, f"CO/c/r {per_round:g} KiB x {rounds:g} rounds"))
    for name, kib in values.items():
        target_metric, _, target = name[len(KIB_TO) :].rpartition("@")
        reached = number(_float(target))
        if name.startswith(KIB_TO) and target_metric == metric and reached is not None:
            points.append(PaperPoint(reached, kib / clients / 1024, f"CO {kib:g} KiB to {target}"))
    return points


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def method_of(label: str, metric: str, runs: list[dict], reference: dict, config: dict | None) -> Method:
    """A method's curves (its runs, one per seed, each measured with ``metric``) and the paper's points."""
    curves = [c for run in runs if (c := run_curve(run, metric)) is not None]
    return Method(label, metric, curves, paper_points(reference, metric, config))


def left_out(setting: Setting, runs: int) -> list[str]:
    """Why runs of the setting are not drawn, or not on the compute axis."""
    notes = []
    curves = [c for m in setting.methods for c in m.curves]
    if len(curves) < runs:
        notes.append(
            f"{runs - len(curves)} of {runs} runs are not drawn: their config.yaml names no population size or "
            "metrics.csv has no evaluated round with the metric and the traffic."
        )
    no_compute = sum(c.gflops is None for c in curves)
    if no_compute:
        notes.append(
            f"{no_compute} of {len(curves)} runs recorded no local training FLOPs (no compute/train_flops in "
            "metrics.csv: an older run, or a model whose step could not be counted, as summary.json's compute "
            "says) and are left out of the compute panel."
        )
    return notes


# ------------------------------------------------------------------ flrun report: settings from experiments
def _data_block(config: dict | None) -> dict[str, Any]:
    """The recipe's ``data`` keys, flattened, which say whether two experiments' accuracies compare."""
    flat = _flatten(config.get("data")) if isinstance(config, dict) else {}
    return {UNKNOWN: "present" if isinstance(config, dict) else "missing", **{f"data.{k}": v for k, v in flat.items()}}


def report_settings(experiments: list[dict]) -> list[Setting]:
    """The settings of ``flrun report``'s experiments (each ``{"label", "metric", "runs", "reference"}``) that
    hold two methods or more, titled by the data set's class and, where two settings share it, what differs."""
    grouped: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for experiment in experiments:
        config = read_config(experiment["runs"][0]["root"])
        data = _data_block(config)
        kind = experiment["metric"].rpartition("/")[2]
        grouped.setdefault((_digest(data), kind), []).append((experiment, {"config": config, "data": data}))
    chosen = [(key, members) for key, members in grouped.items() if len(members) > 1]
    titles = _titles([(key[1], members[0][1]["data"]) for key, members in chosen])
    settings = []
    for title, (_, members) in zip(titles, chosen):
        methods = [
            method_of(e["label"], e["metric"], e["runs"], e["reference"], found["config"]) for e, found in members
        ]
        setting = Setting(title, methods)
        setting.notes = left_out(setting, sum(len(e["runs"]) for e, _ in members))
        settings.append(setting)
    return sorted(settings, key=lambda s: s.title)


def _titles(keyed: list[tuple[str, dict[str, Any]]]) -> list[str]:
    """``DigitsData, test_acc``; where settings share that, the keys their data blocks differ in
    (``DigitsData, test_acc (partitioner.class_path=...)``)."""
    names = [f"{str(data.get('data.class_path', 'data unknown')).rpartition('.')[2]}, {kind}" for kind, data in keyed]
    titles = []
    for name, (_, data) in zip(names, keyed):
        alike = [d for n, (_, d) in zip(names, keyed) if n == name]
        keys = _differences(alike) if len(alike) > 1 else []
        every = list(dict.fromkeys(k for d in alike for k in d))
        titles.append(_label(name, data, keys, _short_names(keys, every)) if keys else name)
    return titles


# ------------------------------------------------------------------ flrun report --table: settings from cells
def table_settings(table: dict, configs: dict[tuple[str, str], dict | None]) -> list[Setting]:
    """One setting per label of the table's settings axis (the axis that is not its methods'), a method per
    cell: its runs, each measured with its own reference's first metric, and the paper's points placed with
    ``configs[(row, column)]`` (the cell's runs' or recipe's)."""
    by_rows = table["method_axis"] == "row"
    settings = []
    for label in table["columns"] if by_rows else table["rows"]:
        methods, runs = [], 0
        for method in table["rows"] if by_rows else table["columns"]:
            key = (method, label) if by_rows else (label, method)
            cell = table["cells"].get(key)
            position = drawn_metric([v["metric"] for v in cell["values"]]) if cell is not None else None
            if position is None:
                continue
            metric = cell["values"][position]["metric"]
            curves = [c for r in cell["runs"] if (c := run_curve(r, run_metric(r, position, metric))) is not None]
            paper = paper_points(cell["reference"], metric, configs.get(key))
            runs += len(cell["runs"])
            if curves or paper:
                methods.append(Method(method, metric, curves, paper))
        if methods:
            setting = Setting(f"{table['id']}: {label}" if label else table["id"], methods)
            setting.notes = left_out(setting, runs)
            settings.append(setting)
    return settings


def cell_config(cell: dict, recipes_dir: Path) -> dict | None:
    """The resolved recipe a cell's paper points are placed with: its first run's config.yaml, else its recipe."""
    from ..federation.errors import ConfigError
    from ..run.recipes import load_recipe

    if cell["runs"]:
        return read_config(cell["runs"][0]["root"])
    if not cell.get("recipe"):
        return None
    try:
        return load_recipe(recipes_dir / cell["recipe"])
    except (ConfigError, OSError):
        return None


# ------------------------------------------------------------------ what the pages show
TRADEOFF_NOTE = (
    "Each method's metric against the MiB each client sent and received (the ledger's bytes down and up, over the "
    "population's clients) and against its local training GFLOPs per client (an estimate: one training step's "
    "FLOPs per model, times the steps its clients took), both cumulative over the rounds; a line per method and "
    "seed through its evaluated rounds, a large marker at the last; a star: a point the paper states (its "
    "communication figures). The table: the last evaluated round, means over the method's runs."
)


def tradeoff_view(tradeoff: dict) -> dict[str, Any]:
    """A setting's title, figure, notes and points table, as the pages show them (text cells)."""
    setting = tradeoff["setting"]
    return {
        "title": setting.title,
        "figure": tradeoff["figure"],
        "caption": "accuracy against communication and compute: " + ", ".join(m.label for m in setting.methods),
        "notes": setting.notes,
        "header": POINTS_HEADER,
        "rows": [[(text, "num" if 2 <= i <= 5 else "") for i, text in enumerate(row)] for row in points_rows(setting)],
    }


POINTS_HEADER = [
    "method",
    "metric",
    "runs",
    "final (mean)",
    "MiB per client (mean)",
    "GFLOPs per client (mean)",
    "paper's points",
]


def points_rows(setting: Setting) -> list[list[str]]:
    """Per method: its last evaluated round's value, MiB and GFLOPs per client (means over its runs), and the
    paper's points."""
    rows = []
    for method in setting.methods:
        last = [(c.acc[-1], c.mib[-1], c.gflops[-1] if c.gflops else None) for c in method.curves]
        acc, mib, gflops = (_mean([v[i] for v in last]) for i in range(3))
        paper = "; ".join(f"{p.acc:.4g} at {p.mib:.4g} MiB ({p.source})" for p in method.paper) or "none stated"
        rows.append([method.label, method.metric, str(len(method.curves)), fmt(acc), fmt(mib), fmt(gflops), paper])
    return rows


def _mean(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) if known else None


def tradeoff_markdown(view: dict[str, Any], figures: Path) -> list[str]:
    """A setting's trade-off as Markdown lines: its figure (a PNG under ``figures``), notes and points table."""
    from .markup import md, md_table, save_figure

    lines = ["", f"## Trade-off: {md(view['title'])}", ""]
    if view["figure"]:
        lines += [f"![tradeoff]({figures.name}/{save_figure(figures, view['title'], 'tradeoff', view['figure'])})", ""]
    lines += [f"Note: {md(note)}" for note in view["notes"]] + ([""] if view["notes"] else [])
    lines += md_table(view["header"], [[md(text) for text, _ in row] for row in view["rows"]])
    return lines + ["", md(TRADEOFF_NOTE)]
