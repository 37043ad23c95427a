"""The report's figures (matplotlib, without a display): every seed's learning curve against the paper's
value, and the histogram of personalized per-client accuracies."""

from __future__ import annotations

import io

import numpy as np

from .runs import number


def png(fig) -> bytes | None:
    """The figure as PNG bytes (None for no figure); closes it."""
    if fig is None:
        return None
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")  # two figures side by side in the page
    pyplot().close(fig)
    return buffer.getvalue()


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def learning_curve_figure(group: list[dict], metric: str, paper: float | None):
    """Every seed's ``metric`` over rounds with the paper's value as a line; None without points."""
    from matplotlib.ticker import MaxNLocator

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    drawn = False
    for run in group:
        points = [(row["round"], row[metric]) for row in run["curve"] if metric in row]
        if points:
            ax.plot(*zip(*points), marker=".", label=f"seed {run['summary'].get('seed')}")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    if paper is not None:
        ax.axhline(paper, color="black", linestyle="--", label="paper")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # rounds are whole numbers
    ax.set_xlim(left=0)
    ax.set_xlabel("round")
    ax.set_ylabel(metric)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def client_histogram_figure(group: list[dict]):
    """Personalized per-client test accuracies of all seeds on the [0, 1] accuracy axis (matplotlib's
    automatic range spread equal values over [v - 0.5, v + 0.5]); None without per-client accuracies."""
    from matplotlib.ticker import MaxNLocator

    accs = []
    for run in group:
        per_client = run["summary"].get("per_client_acc")
        if isinstance(per_client, dict):
            accs += [v for v in map(number, per_client.values()) if v is not None and 0.0 <= v <= 1.0]
    if not accs:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3))
    ax.hist(accs, bins=np.linspace(0.0, 1.0, 21), color="tab:green", alpha=0.8, edgecolor="white")
    ax.set_xlim(0.0, 1.0)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    ax.set_xlabel("personalized test accuracy")
    ax.set_ylabel(f"clients ({len(accs)}, all seeds)")
    return fig
