"""``flrun report --table paper-001/table-5``: one paper table rebuilt from run directories.

A table is the set of cells that recipes' (and runs') ``reference`` blocks name: ``paper``, ``table``,
``row`` and ``column``, laid out as in the paper. Its id is the paper's first word and the table's label,
lowercased, without what is in parentheses, other characters turned into hyphens: ``paper-001 (Lim et
al., ...)`` and ``Table 5`` give ``paper-001/table-5``; ``Sec. V-C (text; Fig. 3-4)`` gives ``sec-v-c``.

A run fills the cell its summary's reference names. A recipe made of a ``base:`` recipe and a
``reference`` only is the same experiment as its base named as another cell (the paper prints the same
number twice), so the runs of either fill both. Per cell: the paper's number and std, the measured mean
and sample std over seeds (one run per seed), or "not run"; a run measures the cell's metrics with those
its own reference block names, position by position.

Per setting (a label of the axis that is not the methods'), the trade-off of its methods: accuracy against the
traffic and the local training compute per client, with the paper's points (``report.tradeoff``). Each
method (the axis along which the recipes' strategy changes; the other axis holds data sets or settings)
gets a ranking line: in how many settings the paper has it first and whether it is first in
our runs too, and how many of the paper's pairwise orders against the other methods hold in our runs.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..federation.errors import ConfigError
from ..run.recipes import BASE_KEY, RECIPES_DIR, _read, load_recipe, natural_key, paper_recipes
from .figures import png, tradeoff_figure
from .groups import differing_keys, experiment_digest, one_per_seed
from .runs import find_runs, load_run, measured_value, number, read_config, run_metric
from .table_render import write_table_html, write_table_markdown  # noqa: F401 (where the command line found them)
from .tradeoff import cell_config, table_settings

Key = tuple[str, str, str, str]  # (paper id, table id, row, column)


def slug(text: str) -> str:
    """``Sec. V-C (text; Fig. 3-4)`` -> ``sec-v-c``: lowercase, parentheses dropped, hyphens between words."""
    return re.sub(r"[^a-z0-9]+", "-", re.sub(r"\([^)]*\)", "", text).lower()).strip("-")


def table_id(reference: dict) -> str | None:
    """``paper-001/table-5`` for a reference block, or None when it names no paper and table."""
    paper, table = reference.get("paper"), reference.get("table")
    if not isinstance(paper, str) or not isinstance(table, str) or not paper.split():
        return None
    return f"{slug(paper.split()[0])}/{slug(table)}"


def cell_key(reference: dict) -> Key | None:
    tid = table_id(reference)
    if tid is None:
        return None
    paper, table = tid.split("/", 1)
    return paper, table, str(reference.get("row") or ""), str(reference.get("column") or "")


def _strategy(recipe: dict) -> str | None:
    strategy = recipe.get("strategy")
    return strategy.get("class_path") if isinstance(strategy, dict) else None


def recipe_cells(folder: Path) -> list[dict[str, Any]]:
    """Every recipe's cell: its key, reference, file name, strategy class and the cell it is the same
    experiment as (its base's, for a recipe that adds only a reference to a base recipe)."""
    cells = []
    for path, reference in paper_recipes(folder):
        raw = _read(path)
        base = raw.get(BASE_KEY)
        same = None
        if set(raw) == {BASE_KEY, "reference"} and isinstance(base, str) and not base.startswith("_base"):
            base_reference = _read(path.parent / base).get("reference")
            same = cell_key(base_reference) if isinstance(base_reference, dict) else None
        cells.append(
            {
                "key": cell_key(reference),
                "reference": reference,
                "recipe": path.name,
                "strategy": _strategy(load_recipe(path)),
                "same_as": same,
            }
        )
    return [c for c in cells if c["key"] is not None]


def _experiments(cells: list[dict]) -> dict[Key, set[Key]]:
    """Each cell key with every key naming the same experiment (chains of base-only recipes joined)."""
    group: dict[Key, set[Key]] = {c["key"]: {c["key"]} for c in cells}
    for cell in cells:
        if cell["same_as"] is not None:
            merged = group[cell["key"]] | group.setdefault(cell["same_as"], {cell["same_as"]})
            for key in merged:
                group[key] = merged
    return group


def _run_strategy(root: Path) -> str | None:
    try:
        return _strategy(read_config(root) or {})
    except AttributeError:
        return None


def build_table(paths: list[str], wanted: str, recipes_dir: Path = RECIPES_DIR) -> dict[str, Any]:
    """The table ``wanted`` (``paper-001/table-5``) from the recipes in ``recipes_dir`` and the runs under
    ``paths``: its cells, axes, runs per cell and a ranking line per method."""
    run_dirs, _ = find_runs(paths, allow_empty=True)
    runs = [load_run(root) for root in run_dirs]
    cells = recipe_cells(recipes_dir)
    for run in runs:  # a run naming a cell no recipe has still shows (e.g. a run with --reference)
        reference = run["summary"].get("reference")
        key = cell_key(reference) if isinstance(reference, dict) else None
        if key is not None and key not in {c["key"] for c in cells}:
            cells.append({"key": key, "reference": reference, "recipe": None, "strategy": None, "same_as": None})
    known = sorted({f"{c['key'][0]}/{c['key'][1]}" for c in cells})
    if wanted not in known:
        raise ConfigError(f"no recipe or run names the table {wanted!r}; known tables: {', '.join(known)}.")
    experiments = _experiments(cells)
    table = [c for c in cells if f"{c['key'][0]}/{c['key'][1]}" == wanted]
    warnings = [warning for run in runs for warning in run["warnings"]]
    for cell in table:
        same = experiments[cell["key"]]
        matching = [r for r in runs if cell_key(r["summary"].get("reference") or {}) in same]
        matching, warning = _one_experiment(matching, ", ".join(x for x in cell["key"][2:] if x))
        warnings += [warning] if warning else []
        cell["runs"], cell["duplicates"] = one_per_seed(matching)
        if cell["strategy"] is None and cell["runs"]:
            cell["strategy"] = _run_strategy(cell["runs"][0]["root"])
        cell["values"] = _values(cell)
    first = table[0]["reference"]
    method_axis, compared = _method_axis(table)
    result = {
        "id": wanted,
        "paper": str(first.get("paper")),
        "table": str(first.get("table")),
        "cells": {(c["key"][2], c["key"][3]): c for c in table},
        "rows": _order(table, "row", method_axis, compared),
        "columns": _order(table, "column", method_axis, compared),
        "method_axis": method_axis,
        "ranking": ranking(table, method_axis),
        "runs": sum(len(c["runs"]) for c in table),
        "warnings": warnings,
    }
    configs = {key: cell_config(cell, recipes_dir) for key, cell in result["cells"].items()}
    result["tradeoffs"] = [{"setting": s, "figure": png(tradeoff_figure(s))} for s in table_settings(result, configs)]
    return result


def _one_experiment(runs: list[dict], cell: str) -> tuple[list[dict], str | None]:
    """The runs of one experiment among those naming a cell: all of them, or (when they ran different recipes,
    e.g. a 2-round smoke test next to the full run) those of the recipe with the most runs, then the most
    rounds, with a warning naming what differs and the runs left out; a cell never averages two experiments."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(experiment_digest(run), []).append(run)
    if len(groups) < 2:
        return runs, None
    ranked = sorted(
        groups.values(),
        key=lambda g: (len(g), max(float(r["summary"].get("rounds_planned") or 0) for r in g)),
        reverse=True,
    )
    left_out = [str(r["root"]) for group in ranked[1:] for r in group]
    keys = differing_keys([group[0] for group in ranked])
    return ranked[0], (
        f"cell {cell}: its runs ran {len(ranked)} different recipes "
        f"(they differ in {', '.join(keys[:4]) or 'config.yaml'}); "
        f"shown: the {len(ranked[0])} run(s) like {ranked[0][0]['root']}; left out: {', '.join(left_out[:4])}"
        f"{f' and {len(left_out) - 4} more' if len(left_out) > 4 else ''}."
    )


def _values(cell: dict) -> list[dict[str, Any]]:
    """Per metric of the reference (headline first): paper value and std, measured mean, std, n."""
    reference = cell["reference"]
    metrics = reference.get("metrics") if isinstance(reference.get("metrics"), dict) else {}
    stds = reference.get("stds") if isinstance(reference.get("stds"), dict) else {}
    values = []
    for position, (metric, paper) in enumerate(metrics.items()):
        measured = [
            v for r in cell["runs"] if (v := measured_value(r, run_metric(r, position, str(metric)))) is not None
        ]
        mean = sum(measured) / len(measured) if measured else None
        std = None
        if len(measured) > 1:
            std = (sum((v - mean) ** 2 for v in measured) / (len(measured) - 1)) ** 0.5
        values.append(
            {
                "metric": str(metric),
                "paper": number(paper),
                "paper_std": number(stds.get(metric)),
                "mean": mean,
                "std": std,
                "n": len(measured),
            }
        )
    return values


def _method_axis(cells: list[dict]) -> tuple[str, bool]:
    """``row`` or ``column``, and whether the methods differ in strategy: the axis whose every label keeps
    one strategy while the other's do not; otherwise (an ablation of one method) the axis with more labels,
    rows on a tie."""
    constant = {}
    for axis, index in (("row", 2), ("column", 3)):
        by_label: dict[str, set[str]] = {}
        for cell in cells:
            if cell["strategy"] is not None:
                by_label.setdefault(cell["key"][index], set()).add(cell["strategy"])
        constant[axis] = bool(by_label) and all(len(s) == 1 for s in by_label.values())
    if constant["row"] != constant["column"]:
        return ("row" if constant["row"] else "column"), True
    rows, columns = ({c["key"][i] for c in cells} for i in (2, 3))
    return ("column" if len(columns) > len(rows) else "row"), False


def _headline(cell: dict | None, field: str) -> float | None:
    return cell["values"][0][field] if cell and cell["values"] else None


def _order(cells: list[dict], axis: str, method_axis: str, by_paper: bool) -> list[str]:
    """Labels in natural order; compared methods by their mean rank in the paper (0 the lowest value,
    1 the highest, per setting), so the paper's best comes last as most papers list their own method;
    methods without a number first."""
    index = 2 if axis == "row" else 3
    labels = sorted({c["key"][index] for c in cells}, key=natural_key)
    if axis != method_axis or not by_paper:
        return labels
    other = 5 - index  # the settings' axis
    ranks: dict[str, list[float]] = {}
    for setting in {c["key"][other] for c in cells}:
        values = sorted(
            (v, c["key"][index])
            for c in cells
            if c["key"][other] == setting and (v := _headline(c, "paper")) is not None
        )
        for position, (_, label) in enumerate(values):
            ranks.setdefault(label, []).append(position / max(len(values) - 1, 1))
    return sorted(labels, key=lambda label: sum(ranks[label]) / len(ranks[label]) if label in ranks else -1.0)


def ranking(cells: list[dict], method_axis: str) -> dict[str, str]:
    """Per method: is it first where the paper has it first, and do the paper's pairwise orders hold?"""
    m_i, s_i = (2, 3) if method_axis == "row" else (3, 2)
    grid = {(c["key"][m_i], c["key"][s_i]): c for c in cells}
    methods = sorted({k[0] for k in grid})
    settings = sorted({k[1] for k in grid})
    noun = "columns" if method_axis == "row" else "rows"
    lines = {}
    for method in methods:
        best, best_held, best_open, pairs, pairs_held = 0, 0, 0, 0, 0
        for setting in settings:
            mine = grid.get((method, setting))
            paper, measured = _headline(mine, "paper"), _headline(mine, "mean")
            others = [grid.get((o, setting)) for o in methods if o != method]
            paper_others = [v for o in others if (v := _headline(o, "paper")) is not None]
            measured_others = [v for o in others if (v := _headline(o, "mean")) is not None]
            if paper is not None and paper_others and paper > max(paper_others):
                best += 1
                if measured is None or not measured_others:
                    best_open += 1
                else:
                    best_held += measured > max(measured_others)
            for other in others:
                p_other, m_other = _headline(other, "paper"), _headline(other, "mean")
                if None not in (paper, measured, p_other, m_other) and paper != p_other:
                    pairs += 1
                    pairs_held += (measured - m_other) * (paper - p_other) > 0
        parts = []
        if best:
            checked = best - best_open
            text = f"best in the paper in {best} of {len(settings)} {noun}, "
            text += f"in our runs in {best_held} of {checked} measured" if checked else "not run yet"
            parts.append(text + (f" ({best_open} not run yet)" if best_open and checked else ""))
        if pairs:
            parts.append(f"pairwise order as in the paper: {pairs_held} of {pairs}")
        lines[method] = "; ".join(parts) if parts else "nothing to compare yet"
    return lines
