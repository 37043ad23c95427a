"""The sweep section of ``flrun report``: a sweep directory's trials (pruned and failed ones included),
its optimisation history, the parameter importances and every trial's learning curve.

It reads only the sweep directory's files (``sweep.json``, ``trials.csv``, ``trial_NNNN/metrics.csv``),
never the study's database, so a copied sweep directory reports the same; ``optuna-dashboard`` on the
study's storage shows the live study.
"""

from __future__ import annotations

import contextlib
import csv
from pathlib import Path
from typing import Any

from .figures import png, pyplot
from .markup import md, md_table, save_figure
from .runs import fmt, number, plural, read_curve, read_json

STATE_COLOURS = {"COMPLETE": "tab:blue", "PRUNED": "tab:orange", "FAIL": "tab:red"}


def _int(text) -> int | None:
    try:
        return int(text)
    except (TypeError, ValueError):
        return None


def _float(text) -> float | None:
    try:
        return number(float(text))
    except (TypeError, ValueError):
        return None


def load_sweep_dir(root: Path) -> dict[str, Any]:
    info = read_json(root / "sweep.json")
    trials: list[dict[str, Any]] = []
    if (root / "trials.csv").is_file():
        with (root / "trials.csv").open(newline="") as f:
            for row in csv.DictReader(f):
                n = _int(row.get("trial"))
                if n is None:
                    continue
                trials.append(
                    {
                        "number": n,
                        "state": str(row.get("state", "")),
                        "value": _float(row.get("value")),
                        "params": {k[len("param/") :]: v for k, v in row.items() if k and k.startswith("param/")},
                        "last_round": _int(row.get("last_round")),
                        "seconds": _float(row.get("seconds")),
                        "retried_as": _int(row.get("retried_as")),
                        "error": str(row.get("error") or ""),
                        # the standard layout, not a path from the file: a report never follows paths it is handed
                        "curve": read_curve(root / f"trial_{n:04d}" / "metrics.csv"),
                    }
                )
    trials.sort(key=lambda t: t["number"])
    sweep = {
        "root": root,
        "study": str(info.get("study") or root.name),
        "info": info,
        "metric": str(info.get("metric") or "value"),
        "trials": trials,
    }
    sweep["history"] = history_figure(sweep)
    sweep["importance"] = importance_figure(sweep)
    sweep["curves"] = curves_figure(sweep)
    return sweep


def _best(sweep: dict) -> dict | None:
    complete = [t for t in sweep["trials"] if t["state"] == "COMPLETE" and t["value"] is not None]
    if not complete:
        return None
    minimize = sweep["info"].get("direction") == "minimize"
    return (min if minimize else max)(complete, key=lambda t: t["value"])


def history_figure(sweep: dict) -> bytes | None:
    """Each trial's value (pruned: its last reported value), failed trials marked, and the best so far."""
    from matplotlib.ticker import MaxNLocator

    trials = sweep["trials"]
    if not trials:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    for state, marker in (("COMPLETE", "o"), ("PRUNED", "x")):
        points = [(t["number"], t["value"]) for t in trials if t["state"] == state and t["value"] is not None]
        if points:
            ax.scatter(*zip(*points), marker=marker, color=STATE_COLOURS[state], label=state.lower(), zorder=3)
    failed = [t["number"] for t in trials if t["state"] == "FAIL"]
    if failed:
        ax.scatter(failed, [0.0] * len(failed), marker="|", s=80, color=STATE_COLOURS["FAIL"], label="failed")
    minimize = sweep["info"].get("direction") == "minimize"
    best, steps = None, []
    for t in trials:
        if t["state"] == "COMPLETE" and t["value"] is not None:
            best = t["value"] if best is None else (min if minimize else max)(best, t["value"])
        if best is not None:
            steps.append((t["number"], best))
    if steps:
        ax.step(*zip(*steps), where="post", color="black", linewidth=1, label="best so far")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel("trial")
    ax.set_ylabel(f"{sweep['metric']} ({sweep['info'].get('use', 'best')})")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return png(fig)


def importance_figure(sweep: dict) -> bytes | None:
    """fANOVA importances computed by ``flrun sweep`` over the completed trials."""
    raw = sweep["info"].get("importances")
    if not isinstance(raw, dict):
        return None
    values = {str(k): v for k, v in raw.items() if number(v) is not None}
    if not values:
        return None
    plt = pyplot()
    names = sorted(values, key=lambda name: values[name])
    fig, ax = plt.subplots(figsize=(5, 0.8 + 0.4 * len(names)))
    ax.barh([n.rsplit(".", 1)[-1] for n in names], [values[n] for n in names], color="tab:blue")
    ax.set_xlim(0.0, 1.0)
    ax.set_xlabel("importance (fANOVA, share of the variance)")
    return png(fig)


def curves_figure(sweep: dict) -> bytes | None:
    """The sweep metric over rounds for every trial, coloured by how it ended (pruned ones stop early)."""
    from matplotlib.ticker import MaxNLocator

    metric = sweep["metric"]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    labelled: set[str] = set()
    for t in sweep["trials"]:
        points = [(row["round"], row[metric]) for row in t["curve"] if metric in row]
        if not points:
            continue
        colour = STATE_COLOURS.get(t["state"], "tab:gray")
        label = t["state"].lower() if t["state"] not in labelled else None
        labelled.add(t["state"])
        ax.plot(*zip(*points), marker=".", color=colour, alpha=0.7, label=label)
    if not labelled:
        plt.close(fig)
        return None
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlim(left=0)
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return png(fig)


def _param_names(sweep: dict) -> list[str]:
    names: dict[str, None] = {}
    for t in sweep["trials"]:
        names.update(dict.fromkeys(t["params"]))
    return list(names)


def _param(text: str) -> str:
    """A parameter value from trials.csv, floats to 4 significant digits (the exact ones are in the file)."""
    value = _float(text)
    if value is None or str(text).lstrip("-").isdigit():
        return str(text)
    return f"{value:.4g}"


def _note(t: dict) -> str:
    if t["retried_as"] is not None:
        return f"interrupted, run again as trial {t['retried_as']}"
    if t["state"] == "PRUNED" and t["last_round"] is not None:
        return f"pruned after round {t['last_round']}"
    return t["error"]


def _facts(sweep: dict) -> list[str]:
    """Plain-text sentences about the sweep (escaped by the caller)."""
    info = sweep["info"]
    counts = {s: sum(t["state"] == s for t in sweep["trials"]) for s in ("COMPLETE", "PRUNED", "FAIL")}
    retried = sum(t["retried_as"] is not None for t in sweep["trials"])
    facts = [
        f"Objective: {sweep['metric']} ({info.get('use', 'best')} value of each run), {info.get('direction', '')}; "
        f"{plural(len(sweep['trials']) - retried, 'trial')} of the {info.get('n_trials', '?')} asked for: "
        f"{counts['COMPLETE']} complete, {counts['PRUNED']} pruned, {counts['FAIL'] - retried} failed"
        + (f" (and {retried} interrupted and run again)." if retried else "."),
        f"Base recipe: {info.get('base', 'n/a')}; fixed overrides for every trial: {info.get('overrides', {})}.",
    ]
    best = _best(sweep)
    if best is not None:
        facts.append(
            f"Best: trial {best['number']} with {fmt(best['value'])}; recipe: {info.get('best_recipe', 'n/a')}."
        )
    test = info.get("best_test")
    if isinstance(test, dict) and number(test.get("value")) is not None:  # the tuned recipe on the test set
        facts.append(f"The best trial's {test.get('metric', 'test metric')}: {fmt(test['value'])}.")
    return facts


def dashboard_command(sweep: dict) -> str:
    """``optuna-dashboard`` on the study's storage. An SQLite file below the current folder is named relative to
    it, as the report names run folders: the command runs from where flrun ran, and shows no machine's paths."""
    storage = sweep["info"].get("storage", "sqlite:///" + str(sweep["root"] / "study.db"))
    if storage.startswith("sqlite:///") and Path(storage[len("sqlite:///") :]).is_absolute():
        with contextlib.suppress(ValueError):
            storage = "sqlite:///" + str(Path(storage[len("sqlite:///") :]).relative_to(Path.cwd()))
    return f"optuna-dashboard {storage}"


def notes(sweep: dict) -> list[str]:
    """What ``flrun sweep`` wrote into sweep.json for the reader (``notes`` and ``warnings``: a sentence or a
    list of them), e.g. that importances from a few trials are unreliable."""
    found = []
    if info_note := sweep["info"].get("importances_note"):
        found.append(f"parameter importances {info_note}")
    for key in ("notes", "warnings"):
        value = sweep["info"].get(key)
        found += [str(v) for v in (value if isinstance(value, list) else [value]) if v not in (None, "")]
    return found


def sweep_view(sweep: dict) -> dict:
    """The sweep section's texts, figures and trials table, as the templates' ``sweep_section`` shows them."""
    names = _param_names(sweep)
    best = _best(sweep)
    rows = [
        [(str(t["number"]), "num"), (t["state"], t["state"]), (fmt(t["value"]), "num")]
        + [(_param(t["params"].get(n, "")), "num") for n in names]
        + [(fmt(t["seconds"], 1), "num"), (_note(t), "")]
        for t in sweep["trials"]
    ]
    return {
        "study": sweep["study"],
        "facts": _facts(sweep),
        "notes": notes(sweep),
        "dashboard": dashboard_command(sweep),
        "metric": sweep["metric"],
        "history": sweep["history"],
        "importance": sweep["importance"],
        "curves": sweep["curves"],
        "header": ["trial", "state", sweep["metric"], *[n.rsplit(".", 1)[-1] for n in names], "seconds", "note"],
        "rows": rows,
        "row_classes": ["best" if t is best else "" for t in sweep["trials"]],
    }


def sweep_markdown(sweep: dict, figures: Path) -> list[str]:
    lines = ["", f"## Sweep {md(sweep['study'])}", ""]
    lines += [md(fact) for fact in _facts(sweep)]
    lines += [f"Note: {md(note)}" for note in notes(sweep)]
    lines += ["", f"The live study: `{md(dashboard_command(sweep))}` (`pip install optuna-dashboard`).", ""]
    for kind in ("history", "importance", "curves"):
        if sweep[kind]:
            lines.append(
                f"![{kind}]({figures.name}/{save_figure(figures, 'sweep_' + sweep['study'], kind, sweep[kind])})"
            )
    names = _param_names(sweep)
    lines.append("")
    lines += md_table(
        ["trial", "state", sweep["metric"], *[n.rsplit(".", 1)[-1] for n in names], "seconds", "note"],
        [
            [md(t["number"]), md(t["state"]), fmt(t["value"])]
            + [md(_param(t["params"].get(n, ""))) for n in names]
            + [fmt(t["seconds"], 1), md(_note(t))]
            for t in sweep["trials"]
        ],
    )
    return lines
