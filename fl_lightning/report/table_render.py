"""A paper table as a page: HTML from ``templates/table.html.j2`` (autoescaped) or Markdown (``markup.md``),
the paper's layout with paper vs measured per cell, a ranking line per method, the trade-off of each setting,
and the runs behind it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..federation.files import atomic_write
from ..run.recipes import natural_key
from .markup import md, md_table
from .runs import json_object
from .tradeoff import TRADEOFF_NOTE, tradeoff_markdown, tradeoff_view

TABLE_NOTE = (
    "Paper = the recipe's reference block (its std after ±; – where the paper prints no number). Ours = the "
    "value after the last round (summary.json final), the mean over seeds ± the sample standard deviation, one run "
    "per seed; n = runs. Accuracies in %; comm/kib_per_client_round = KiB down and up per participating client and "
    "round; rounds_to/M@X = the first evaluated round whose M reaches X, comm/kib_to/M@X = the KiB sent until "
    "then (paper 004's Rounds (X) and CO); best/M = the highest M over the evaluated rounds (HtFLlib's papers "
    "report the best round). A cell also shows the runs of a recipe that is the same experiment "
    "(a base recipe plus a reference)."
)
RANKING_LABEL = "ranking in our runs"
RANKING_NOTE = (
    "Ranking, on each cell's first metric: where the paper has a method above every other, is it above every "
    "other measured method in our runs too; and of the pairs of methods in one setting with a paper number and a "
    "measurement on both sides, in how many our runs order them as the paper does."
)
PROVENANCE_HEADER = ["cell", "recipe", "seed", "run", "git commit"]


def _number_text(value: float | None, metric: str, std: float | None = None) -> str:
    if value is None:
        return "–"
    scale = 100.0 if "acc" in metric and not metric.startswith(("comm/", "rounds_to/")) else 1.0
    text = f"{value * scale:.2f}"
    return text + (f" ± {std * scale:.2f}" if std is not None else "")


def cell_lines(cell: dict | None) -> list[tuple[str, str]]:
    """(kind, text) lines of a cell: a metric's name when it is not the headline, the paper's value, ours."""
    if cell is None:
        return [("empty", "no recipe")]
    lines = []
    for i, value in enumerate(cell["values"]):
        if i:
            lines.append(("metric", value["metric"]))
        lines.append(("paper", "paper " + _number_text(value["paper"], value["metric"], value["paper_std"])))
        if value["n"]:
            ours = _number_text(value["mean"], value["metric"], value["std"])
            lines.append(("ours", f"ours {ours} (n={value['n']})"))
        else:
            lines.append(("notrun", "not run"))
            if cell["recipe"] and i == 0:
                lines.append(("recipe", cell["recipe"]))
    return lines


def _grid(table: dict) -> tuple[list[str], list[list[Any]]]:
    """Header and rows of the paper's layout plus the ranking (a last column, or a last row, per method)."""
    rows, columns, cells = table["rows"], table["columns"], table["cells"]
    by_rows = table["method_axis"] == "row"
    header = ["", *columns] + ([RANKING_LABEL] if by_rows else [])
    grid = []
    for row in rows:
        line: list[Any] = [row, *(cells.get((row, column)) for column in columns)]
        grid.append(line + ([table["ranking"].get(row, "")] if by_rows else []))
    if not by_rows:
        grid.append([RANKING_LABEL, *(table["ranking"].get(column, "") for column in columns)])
    return header, grid


def _title(table: dict) -> str:
    cells = list(table["cells"].values())
    measured = sum(1 for c in cells if c["runs"])
    return f"{table['id']}: {len(cells)} cells, {measured} with runs, {table['runs']} runs"


def _provenance(table: dict) -> list[list[str]]:
    rows = []
    for (row, column), cell in sorted(table["cells"].items(), key=lambda kv: (natural_key(kv[0][0]), kv[0][1])):
        for run, counted in [(r, True) for r in cell["runs"]] + [(r, False) for r in cell["duplicates"]]:
            versions = json_object(run["summary"].get("versions"))
            rows.append(
                [
                    ", ".join(x for x in (row, column) if x),
                    str(run["summary"].get("name") or ""),
                    str(run["summary"].get("seed")) + ("" if counted else " (same seed again, not counted)"),
                    str(run["root"]),
                    str(versions.get("git_commit") or "n/a")[:12],
                ]
            )
    return rows


def write_table_html(table: dict, path: Path) -> None:
    from .html import write_page

    header, grid = _grid(table)
    rows = [
        {
            "label": line[0],
            "ranking": line[0] == RANKING_LABEL,
            "cells": [
                {"text": item, "lines": None} if isinstance(item, str) else {"text": "", "lines": cell_lines(item)}
                for item in line[1:]
            ],
        }
        for line in grid
    ]
    write_page(
        "table.html.j2",
        path,
        id=table["id"],
        paper=table["paper"],
        table_name=table["table"],
        title=_title(table),
        header=header,
        grid=rows,
        warnings=table.get("warnings", []),
        table_note=TABLE_NOTE,
        ranking_note=RANKING_NOTE,
        provenance_header=PROVENANCE_HEADER,
        provenance_rows=[[(value, "") for value in row] for row in _provenance(table)],
        tradeoffs=[tradeoff_view(t) for t in table["tradeoffs"]],
        tradeoff_note=TRADEOFF_NOTE,
    )


def write_table_markdown(table: dict, path: Path) -> None:
    header, grid = _grid(table)
    rows = []
    for line in grid:
        cells_md = [f"**{md(line[0])}**" if line[0] else ""]
        for item in line[1:]:
            cells_md.append(md(item) if isinstance(item, str) else "<br>".join(md(v) for _, v in cell_lines(item)))
        rows.append(cells_md)
    lines = [f"# {md(table['paper'])}, {md(table['table'])}", "", f"{md(_title(table))}.", ""]
    lines += md_table(header, rows) + [""] + [f"**Warning:** {md(w)}\n" for w in table.get("warnings", [])]
    lines += [md(TABLE_NOTE), "", md(RANKING_NOTE)]
    for tradeoff in table["tradeoffs"]:
        lines += tradeoff_markdown(tradeoff_view(tradeoff), path.parent / f"{path.stem}_figures")
    lines += ["", "## Runs", ""]
    lines += md_table(PROVENANCE_HEADER, [[md(v) for v in r] for r in _provenance(table)])
    atomic_write(path, "\n".join(lines) + "\n")
