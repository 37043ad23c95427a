"""``flrun data inspect``: per-client statistics of a recipe's partition and paper 001's Fig. 1 chart."""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
from pathlib import Path
from typing import TextIO

import numpy as np

from ..federation.files import replacing
from .federated import FederatedData


def client_table(data: FederatedData) -> list[dict]:
    counts = data.client_class_counts()
    rows = []
    for i, (client, row) in enumerate(zip(data.clients, counts)):
        total = int(row.sum())
        rows.append(
            {
                "client": i,
                "train": len(client.train),
                "unlabeled": len(client.unlabeled),
                "val": len(client.val),
                "test": len(client.test),
                "classes": int((row > 0).sum()),
                "top_class_share": float(row.max() / total) if total else 0.0,
            }
        )
    return rows


def bubble_chart(
    data: FederatedData, path: Path, replace: bool = False, max_clients: int = 100, max_classes: int = 100
) -> Path:
    """Client-by-class bubble chart (paper 001 Fig. 1): a bubble's area is the client's count of that class.

    Written atomically (a temporary file in the same folder, then renamed): a reader never sees half a chart.
    With ``replace`` the file at ``path`` is replaced; without it a file already there is kept and the chart
    takes the first free name ``<stem>_2``, ``<stem>_3``, ... Returns the path written.
    """
    fig = chart_figure(data.client_class_counts()[:max_clients, :max_classes])
    try:
        return save_figure(fig, path, replace)
    finally:
        from matplotlib import pyplot as plt

        plt.close(fig)


def chart_figure(counts: np.ndarray):
    """The bubble chart of ``counts`` ``[clients, classes]``; its ticks name existing clients and classes only."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clients, classes = np.nonzero(counts)
    sizes = counts[clients, classes]
    fig, ax = plt.subplots(figsize=(max(6, counts.shape[0] * 0.12), max(3, counts.shape[1] * 0.3)))
    area = 300 * sizes / max(sizes.max(initial=0), 1)
    ax.scatter(clients, classes, s=area, alpha=0.6, color="tab:blue", edgecolors="none")
    ax.set_xlabel("client")
    ax.set_ylabel("class")
    ax.set_title(f"labeled examples per client and class ({counts.shape[0]} clients)")
    # fixed ticks: a locator on the padded limits would also label -1 and C, a client or class that does not exist
    ax.set_xticks(index_ticks(counts.shape[0]))
    ax.set_yticks(index_ticks(counts.shape[1]))
    ax.set_xlim(-1, counts.shape[0])
    ax.set_ylim(-1, counts.shape[1])
    fig.tight_layout()
    return fig


def index_ticks(n: int, most: int = 25) -> list[int]:
    """Ticks for the indices ``0 .. n-1``: each one, or every 2nd, 5th, 10th, 20th, ... to show at most ``most``."""
    step, factors = 1, itertools.cycle((2, 2.5, 2))
    while n > most * step:
        step = int(step * next(factors))
    return list(range(0, n, step))


def save_figure(fig, path: Path, replace: bool) -> Path:
    """Saves ``fig`` at ``path`` (its suffix is the format), replaced atomically
    (:func:`fl_lightning.federation.files.replacing`: a full disk leaves the old chart whole and names the file).

    ``replace``: an existing ``path`` is replaced by the rename. Otherwise the first free name of ``path``,
    ``<stem>_2``, ``<stem>_3``, ... is reserved (created exclusively, so two processes never pick the same)
    and the rename fills it. Returns the path written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    target = path if replace else _reserve_free_name(path)
    try:
        with replacing(target) as f:
            fig.savefig(f, format=path.suffix.lstrip(".").lower(), dpi=120)
    except BaseException:
        if not replace:  # the reserved name, still empty
            with contextlib.suppress(OSError):
                os.unlink(target)
        raise
    return target


def _reserve_free_name(path: Path) -> Path:
    k = 1
    while True:
        candidate = path if k == 1 else path.with_name(f"{path.stem}_{k}{path.suffix}")
        try:
            with open(candidate, "x"):
                return candidate
        except FileExistsError:
            k += 1


def print_summary(data: FederatedData, rows: list[dict], out: TextIO | None = None) -> None:
    """Writes the partition's totals and one line per client to ``out`` (stdout when not given)."""
    out = out or sys.stdout
    out.write("\n".join(summary_lines(data, rows)) + "\n")


def summary_lines(data: FederatedData, rows: list[dict]) -> list[str]:
    """The partition's totals, then a table with one line per client."""
    sizes = np.array([r["train"] for r in rows])
    lines = [
        f"{len(rows)} clients, {data.num_classes} classes; pool {len(data.x)}, server {len(data.server_idx)}, "
        f"global test {len(data.test_y)}",
        f"labeled examples per client: min {sizes.min()}, median {int(np.median(sizes))}, max {sizes.max()}; "
        f"classes per client: mean {np.mean([r['classes'] for r in rows]):.1f}",
        f"{'client':>6} {'train':>7} {'unlab.':>7} {'val':>5} {'test':>5} {'classes':>7} {'top share':>9}",
    ]
    for r in rows:
        lines.append(
            f"{r['client']:>6} {r['train']:>7} {r['unlabeled']:>7} {r['val']:>5} {r['test']:>5} {r['classes']:>7} "
            f"{r['top_class_share']:>9.2f}"
        )
    return lines
