"""``flrun data inspect``: per-client statistics of a recipe's partition and paper 001's Fig. 1 chart."""

from __future__ import annotations

from pathlib import Path

import numpy as np

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


def bubble_chart(data: FederatedData, path: Path, max_clients: int = 100, max_classes: int = 100) -> Path:
    """Client-by-class bubble chart (paper 001 Fig. 1): a bubble's area is the client's count of that class."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = data.client_class_counts()[:max_clients, :max_classes]
    clients, classes = np.nonzero(counts)
    sizes = counts[clients, classes]
    fig, ax = plt.subplots(figsize=(max(6, counts.shape[0] * 0.12), max(3, counts.shape[1] * 0.3)))
    ax.scatter(clients, classes, s=300 * sizes / max(sizes.max(), 1), alpha=0.6, color="tab:blue", edgecolors="none")
    ax.set_xlabel("client")
    ax.set_ylabel("class")
    ax.set_title(f"labeled examples per client and class ({counts.shape[0]} clients)")
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlim(-1, counts.shape[0])
    ax.set_ylim(-1, counts.shape[1])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_summary(data: FederatedData, rows: list[dict]) -> None:
    sizes = np.array([r["train"] for r in rows])
    print(
        f"{len(rows)} clients, {data.num_classes} classes; pool {len(data.x)}, server {len(data.server_idx)}, "
        f"global test {len(data.test_y)}"
    )
    print(
        f"labeled examples per client: min {sizes.min()}, median {int(np.median(sizes))}, max {sizes.max()}; "
        f"classes per client: mean {np.mean([r['classes'] for r in rows]):.1f}"
    )
    print(f"{'client':>6} {'train':>7} {'unlab.':>7} {'val':>5} {'test':>5} {'classes':>7} {'top share':>9}")
    for r in rows:
        print(
            f"{r['client']:>6} {r['train']:>7} {r['unlabeled']:>7} {r['val']:>5} {r['test']:>5} {r['classes']:>7} "
            f"{r['top_class_share']:>9.2f}"
        )
