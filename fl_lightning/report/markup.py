"""HTML and Markdown pieces of the reports: every value from a file escaped, tables, figures and counts."""

from __future__ import annotations

import base64
import html
from pathlib import Path

STYLE = (
    "body{font-family:system-ui,-apple-system,'Segoe UI',sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;"
    "color:#222;line-height:1.4}h1{font-size:1.6em}h2{margin-top:2em;border-bottom:1px solid #ddd;padding-bottom:.2em}"
    "table{border-collapse:collapse;margin:.6em 0}th,td{border:1px solid #ccc;padding:3px 8px;font-size:13px}"
    "th{background:#f3f3f3;text-align:left}td.num{text-align:right;font-variant-numeric:tabular-nums}"
    ".note{color:#555;font-size:13px}figure{display:inline-block;margin:.5em 1.5em .5em 0;vertical-align:top}"
    "figcaption{font-size:12px;color:#555;text-align:center}tr.best td{background:#eaf5ea}"
    "td.PRUNED{color:#a65e00}td.FAIL{color:#b00020}code{background:#f3f3f3;padding:0 3px}p.warn{color:#b00020}"
)


def e(value) -> str:
    """HTML-escaped text of any value read from a file."""
    return html.escape(str(value), quote=True)


def html_table(header: list[str], rows: list[list[tuple[str, str]]], row_classes: list[str] | None = None) -> str:
    """A table; each cell is (already escaped html, css class)."""
    parts = ["<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>"]
    for i, row in enumerate(rows):
        css = f" class='{row_classes[i]}'" if row_classes and row_classes[i] else ""
        cells = "".join(f"<td class='{c}'>{text}</td>" if c else f"<td>{text}</td>" for text, c in row)
        parts.append(f"<tr{css}>{cells}</tr>")
    return "".join(parts) + "</table>"


def html_figure(image: bytes | None, caption: str) -> str:
    if not image:
        return ""
    data = base64.b64encode(image).decode()
    return f"<figure><img alt='{e(caption)}' src='data:image/png;base64,{data}'><figcaption>{e(caption)}</figcaption></figure>"


def md(value) -> str:
    """A value read from a file as Markdown table text: no HTML, no column breaks, one line."""
    return html.escape(str(value), quote=False).replace("|", "\\|").replace("\n", " ")


def md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(md(h) for h in header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def save_figure(directory: Path, name: str, kind: str, image: bytes) -> str:
    """Writes a figure under ``directory`` with a file name made only of safe characters."""
    safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in str(name)).strip("._") or "figure"
    directory.mkdir(parents=True, exist_ok=True)
    file = directory / f"{safe}_{kind}.png"
    file.write_bytes(image)
    return file.name
