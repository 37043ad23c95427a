"""Markdown pieces of the reports (every value from a file escaped, tables) and figure files; the HTML pages
come from templates (``html``)."""

from __future__ import annotations

import html
from pathlib import Path

from ..federation.files import atomic_write


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
    atomic_write(file, image)
    return file.name
