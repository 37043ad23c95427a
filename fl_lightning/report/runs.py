"""``flrun report``: reproducibility reports from run and sweep directories against the papers' numbers.

Everything shown comes from files (``summary.json``, ``metrics.csv``, a sweep's ``sweep.json`` and
``trials.csv``) that may have been handed over by someone else: every value is HTML-escaped (or
Markdown-escaped) and numbers are used only where they are numbers.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..federation.errors import ConfigError
from ..run.safe_yaml import read_file

KIB_PER_CLIENT_ROUND = "comm/kib_per_client_round"
GFLOPS_PER_CLIENT_ROUND = "compute/gflops_per_client_round"  # local training GFLOPs, as KiB per client and round
ROUNDS_TO = "rounds_to/"  # rounds_to/<metric>@<target>: the first round the metric reaches the target
KIB_TO = "comm/kib_to/"  # comm/kib_to/<metric>@<target>: KiB sent down and up until that round
BEST = "best/"  # best/<metric>: the metric's highest value over the evaluated rounds (HtFLlib reports the best round)

MEASURED_NOTE = (
    "Measured = the value after the last round (summary.json final), the mean over seeds; std over seeds = the "
    "sample standard deviation (n/a for one seed). Best round = the mean of each run's best evaluation during "
    "training (summary.json best, picked by the run's monitor on the test set, hence optimistic). Paper and "
    "paper std = the recipe's reference block."
)


def number(value) -> float | None:
    """``value`` as a float when it is a real number (not a bool, a string or NaN), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def json_object(value: Any) -> dict[str, Any]:
    """``value`` when it is a JSON object (a dict), else an empty one: a field of a file written by anyone."""
    return value if isinstance(value, dict) else {}


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"{path} is not valid JSON ({getattr(err, 'msg', 'not text')}); the run was cut short or the file "
            "was edited: re-run it or leave its directory out."
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object; re-run that run or leave its directory out.")
    return data


def find_runs(paths: list[str], allow_empty: bool = False) -> tuple[list[Path], list[Path]]:
    """Run directories (holding summary.json) and sweep directories (holding sweep.json) at or below
    ``paths``; a sweep's trial runs belong to its sweep, not to the runs. Finding neither is an error
    unless ``allow_empty``."""
    runs: list[Path] = []
    sweeps: list[Path] = []
    for path in map(Path, paths):
        if not path.exists():
            raise ConfigError(f"{path} does not exist; give run or sweep directories (those holding summary.json).")
        sweeps += sorted(p.parent for p in path.rglob("sweep.json"))
        runs += sorted(p.parent for p in path.rglob("summary.json"))
    runs = [r for r in dict.fromkeys(runs) if not any(s in r.parents for s in sweeps)]
    if not runs and not sweeps and not allow_empty:
        raise ConfigError(f"no run directory (with a summary.json) under {', '.join(paths)}.")
    return runs, list(dict.fromkeys(sweeps))


def read_curve(path: Path) -> list[dict[str, float]]:
    """The numeric columns of a metrics.csv, one dict per logged round."""
    return _curve_rows(_csv_text(path) or "")


def _csv_text(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace") if path.is_file() else None
    except OSError:
        return None


def _curve_rows(text: str) -> list[dict[str, float]]:
    rows = []
    for row in csv.DictReader(io.StringIO(text, newline="")):
        values = {}
        for key, cell in row.items():
            try:
                values[key] = float(cell)
            except (TypeError, ValueError):
                continue
        if "round" in values:
            rows.append(values)
    return rows


def read_config(root: Path) -> dict[str, Any] | None:
    """A run's config.yaml as plain data (read as any YAML handed over: bounded, duplicate keys refused); None when
    it is missing or unreadable."""
    try:
        config = read_file(root / "config.yaml", f"{root / 'config.yaml'}", "the config.yaml flrun fit wrote")
    except ConfigError:
        return None
    return config if isinstance(config, dict) else None


def load_run(root: Path) -> dict[str, Any]:
    """A run's summary and learning curve; ``warnings`` says when metrics.csv lacks rounds summary.json has."""
    summary = read_json(root / "summary.json")
    for key in ("final", "best"):
        if not isinstance(summary.get(key, {}), dict):
            raise ConfigError(f"{root / 'summary.json'} has no `{key}` metrics; re-run that run or leave it out.")
    path = root / "metrics.csv"
    text = _csv_text(path)
    curve = _curve_rows(text or "")
    problem = _curve_problem(path, text, curve, summary.get("final_round"))
    if problem:  # a shorter curve would pass for the run's: none is shown, and rounds-to-target read n/a
        curve = []
    return {"root": root, "summary": summary, "curve": curve, "warnings": [problem] if problem else []}


def _curve_problem(path: Path, text: str | None, curve: list[dict[str, float]], last: Any) -> str | None:
    """Why metrics.csv cannot be the run's curve: missing, cut off mid-line, or ending before summary.json's last
    evaluated round; None when it is whole (or the summary names no round to compare with)."""
    if isinstance(last, bool) or not isinstance(last, int):
        return None
    fix = "its learning curve is left out; restore the file or re-run the run"
    if text is None:
        return f"{path} is missing although summary.json records evaluations up to round {last}; {fix}."
    ends = max((row["round"] for row in curve), default=None)
    if not text.endswith("\n") or ends is None or ends < last:
        shown = "no round" if ends is None else f"round {ends:g}"
        return f"{path} is cut short (it ends at {shown}, summary.json at round {last}); {fix}."
    return None


def report_output(text: str) -> Path:
    """The report file ``--output`` names, refused unless it is ``.html`` or ``.md`` (what is written)."""
    path = Path(text)
    if path.suffix not in (".html", ".md"):
        raise ConfigError(f"--output {text} must end in .html or .md: flrun report writes HTML or Markdown only.")
    return path


def _reference(summary: dict) -> dict:
    reference = summary.get("reference")
    return reference if isinstance(reference, dict) else {}


def paper_values(reference: dict) -> dict[str, tuple[float | None, float | None]]:
    """{metric: (paper value, paper std)} from a recipe's reference block: ``metrics`` (the headline
    first) with ``std`` for the headline, or per metric in ``stds``; older runs' ``metric`` / ``value``."""
    metrics = json_object(reference.get("metrics"))
    stds = json_object(reference.get("stds"))
    wanted = {str(k): [number(v), number(stds.get(k))] for k, v in metrics.items()}
    headline = reference.get("metric") if isinstance(reference.get("metric"), str) else next(iter(wanted), None)
    if headline is not None:
        entry = wanted.setdefault(headline, [None, None])
        entry[0] = entry[0] if number(reference.get("value")) is None else number(reference.get("value"))
        entry[1] = entry[1] if number(reference.get("std")) is None else number(reference.get("std"))
        wanted = {headline: entry, **wanted}  # the headline first
    return {k: (v[0], v[1]) for k, v in wanted.items()}


def run_metric(run: dict, position: int, metric: str) -> str:
    """The metric a run measures a table cell's ``position``-th metric with: the one at that position of its own
    reference block (the same name for a run of the cell's recipe; a digits run given the cell with
    ``--reference`` may name its own, e.g. small/test_acc for aux/test_acc)."""
    metrics = _reference(run["summary"]).get("metrics")
    own = [str(m) for m in metrics] if isinstance(metrics, dict) else []
    return own[position] if position < len(own) else metric


def measured_value(run: dict, metric: str) -> float | None:
    """A run's final value of ``metric``; ``comm/kib_per_client_round`` is derived from its traffic,
    ``compute/gflops_per_client_round`` from its local training FLOPs (summary.json's ``compute``), and
    ``rounds_to/<metric>@<target>`` / ``comm/kib_to/<metric>@<target>`` / ``best/<metric>`` from its
    metrics.csv."""
    if metric == KIB_PER_CLIENT_ROUND:
        return kib_per_client_round(run)
    if metric == GFLOPS_PER_CLIENT_ROUND:
        return gflops_per_client_round(run)
    if metric.startswith(BEST):
        values = [row[metric[len(BEST) :]] for row in run["curve"] if metric[len(BEST) :] in row]
        values = [v for v in values if not math.isnan(v)]
        return max(values) if values else None
    for prefix in (ROUNDS_TO, KIB_TO):
        if metric.startswith(prefix) and "@" in metric:
            name, _, target = metric[len(prefix) :].rpartition("@")
            return to_target(run, name, number(_float(target)), traffic=prefix == KIB_TO)
    final = run["summary"].get("final")
    return number(final.get(metric)) if isinstance(final, dict) else None


def _float(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def to_target(run: dict, metric: str, target: float | None, traffic: bool) -> float | None:
    """Paper 004's Rounds (X) and CO: the first logged round whose ``metric`` reaches ``target``, or the KiB
    sent down and up until the end of that round (metrics.csv's cumulative traffic); None if no logged round
    reaches it. Rounds are those the run evaluated, so a recipe that wants the exact round evaluates every
    round (``eval_every: 1``)."""
    if target is None:
        return None
    for row in run["curve"]:
        value = row.get(metric)
        if value is not None and value >= target:
            if not traffic:
                return row["round"]
            up, down = row.get("comm/uplink_bytes"), row.get("comm/downlink_bytes")
            return None if up is None or down is None else (up + down) / 1024
    return None


def kib_per_client_round(run: dict) -> float | None:
    """KiB sent down and up per participating client and round (paper 004's CO/c/r): the ledger's total
    over the rounds run and the clients the run's UniformSampler takes per round (config.yaml, which may come
    from anyone: it is parsed as plain YAML only); None when any of these is unknown."""
    summary = run["summary"]
    comm = json_object(summary.get("comm"))
    up, down, rounds = (
        number(comm.get("uplink_bytes")),
        number(comm.get("downlink_bytes")),
        number(summary.get("rounds")),
    )
    per_round = clients_per_round_of(read_config(run["root"]))
    if up is None or down is None or not rounds or not per_round:
        return None
    return (up + down) / 1024 / (rounds * per_round)


def gflops_per_client_round(run: dict) -> float | None:
    """Local training GFLOPs per participating client and round (``client/flops.py``'s estimate), as
    :func:`kib_per_client_round` divides the traffic; None when the run recorded no compute."""
    summary = run["summary"]
    compute = json_object(summary.get("compute"))
    flops, rounds = number(compute.get("train_flops")), number(summary.get("rounds"))
    per_round = clients_per_round_of(read_config(run["root"]))
    if flops is None or not rounds or not per_round:
        return None
    return flops / 1e9 / (rounds * per_round)


def clients_per_round_of(config: dict | None) -> int | None:
    """Clients a recipe's UniformSampler (fit's default when the recipe has none: every client) draws per
    round, from the resolved recipe; None for another sampler or a recipe that does not say."""
    from ..federation.population import Population, Tier
    from ..federation.sampling import round_half

    if config is None:
        return None
    try:
        sampler = config.get("sampler") or {
            "class_path": "fl_lightning.federation.sampling.UniformSampler"
        }  # fit's default
        population = config["population"]
        if sampler.get("class_path") != "fl_lightning.federation.sampling.UniformSampler":
            return None
        args = sampler.get("init_args") or {}
        tiers = [Tier(**tier) for tier in population["tiers"]]
        counts = Population(num_clients=population["num_clients"], tiers=tiers).tier_counts()
        eligible = sum(n for tier, n in zip(tiers, counts) if args.get("tiers") is None or tier.name in args["tiers"])
        if args.get("num_per_round") is not None:
            return int(args["num_per_round"])
        return max(1, round_half(float(args.get("fraction", 1.0)) * eligible))
    except (KeyError, TypeError, ValueError, AttributeError, ConfigError):
        return None


def _spread(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return float(np.mean(values)), (float(np.std(values, ddof=1)) if len(values) > 1 else None)


def compare(group: list[dict], duplicates: list[dict] | None = None) -> dict[str, Any]:
    """Measured (final-round) mean and spread over seeds (``group``: one run per seed of one experiment) of
    every metric the paper reports for this recipe, or of its monitor; ``duplicates`` (runs of a seed
    already in ``group``) are listed in the provenance, not counted."""
    first = group[0]["summary"]
    reference = _reference(first)
    wanted = paper_values(reference) or {str(first.get("monitor")): (None, None)}
    rows: list[dict[str, Any]] = []
    for metric, (paper, paper_std) in wanted.items():
        finals = [v for r in group if (v := measured_value(r, metric)) is not None]
        bests = [v for r in group if (v := number(r["summary"].get("best", {}).get(metric))) is not None]
        mean, std = _spread(finals)
        rows.append(
            {
                "metric": metric,
                "paper": paper,
                "paper_std": paper_std,
                "mean": mean,
                "std": std,
                "best_mean": _spread(bests)[0],
                "n": len(finals),
                "delta": (mean - paper) if (mean is not None and paper is not None) else None,
            }
        )
    comm = [json_object(r["summary"].get("comm")) for r in group]
    return {
        "rows": rows,
        "reference": reference,
        "seeds": [r["summary"].get("seed") for r in group],
        "best_rounds": [r["summary"].get("best_round") for r in group],  # by each run's monitor
        "complete": all(r["summary"].get("complete", True) is True for r in group),
        "uplink_mb": _mib([number(c.get("uplink_bytes")) for c in comm]),
        "downlink_mb": _mib([number(c.get("downlink_bytes")) for c in comm]),
        "provenance": [_provenance(r, rows[0]["metric"]) for r in group]
        + [{**_provenance(r, rows[0]["metric"]), "counted": False} for r in duplicates or []],
    }


def _mib(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return float(np.mean(known)) / 2**20 if known else None


def _provenance(run: dict, metric: str) -> dict[str, Any]:
    summary = run["summary"]
    versions = json_object(summary.get("versions"))
    return {
        "seed": summary.get("seed"),
        "counted": True,
        "final": number(summary.get("final", {}).get(metric)),
        "best": number(summary.get("best", {}).get(metric)),
        "best_round": summary.get("best_round"),
        "dir": str(run["root"]),
        "config_sha256": str(summary.get("config_sha256") or "")[:12],
        "git_commit": str(versions.get("git_commit") or "n/a")[:12],
        "versions": {k: v for k, v in versions.items() if k != "git_commit"},
        "hardware": _hardware_text(summary.get("hardware")),
    }


def _hardware_text(hardware: Any) -> str:
    """``NVIDIA H200 (cuda:0), 1 rank`` or ``<CPU model>, 1 thread, 1 rank``: where a run's wall time was spent
    (``n/a`` for runs written before summaries recorded it)."""
    if not isinstance(hardware, dict):
        return "n/a"
    where = f"{hardware['gpu']} ({hardware.get('device')})" if hardware.get("gpu") else str(hardware.get("cpu"))
    if not hardware.get("gpu") and hardware.get("threads") is not None:
        where += f", {plural(hardware['threads'], 'thread')}"
    return f"{where}, {plural(hardware.get('ranks', 1), 'rank')}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def fmt(value, digits: int = 4) -> str:
    value = number(value)
    return "n/a" if value is None else f"{value:.{digits}f}"
