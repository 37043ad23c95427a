"""The report's figures (matplotlib, without a display): every seed's learning curves (the reported metric
against the paper's value, the other model roles' curves and the training loss, side by side at the page's
width), and the histogram of personalized per-client accuracies."""

from __future__ import annotations

import io

import numpy as np

from .runs import number


def png(fig) -> bytes | None:
    """The figure as PNG bytes (None for no figure); closes it."""
    if fig is None:
        return None
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    pyplot().close(fig)
    return buffer.getvalue()


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# metrics.csv prefixes that are not a model role (a role's metrics are "<role>/<metric>")
NOT_ROLES = ("train", "server", "comm", "time", "faults", "clients", "round")
MAX_PANELS = 4
WIDTH_IN, HEIGHT_IN = 10.0, 3.2  # 1000 px at the report's 100 dpi: the page's width


def curve_panels(group: list[dict], metric: str) -> list[str]:
    """The metrics a recipe's learning curves show side by side: ``metric`` first, the same metric of each other
    model role (``aux/test_acc`` beside ``target/test_acc``), then the training loss; those some run logged."""
    logged = {key for run in group for row in run["curve"] for key in row}
    role, _, name = metric.partition("/")
    others = sorted(
        key
        for key in logged
        if "/" in key and key.partition("/")[2] == name and key.split("/")[0] not in (role, *NOT_ROLES)
    )
    panels = [metric, *others][: MAX_PANELS - 1]
    return panels + ["train/loss"] if "train/loss" in logged else panels


def learning_curve_figure(group: list[dict], metric: str, paper: float | None):
    """Every seed's curves (:func:`curve_panels`) from the first evaluated round, the paper's value on
    ``metric``'s panel; one legend for all panels; None without points."""
    from matplotlib.ticker import MaxNLocator

    panels = curve_panels(group, metric)
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(WIDTH_IN, HEIGHT_IN), squeeze=False, layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles: dict[str, object] = {}
    rounds: list[float] = []
    for ax, name in zip(axes[0], panels):
        for i, run in enumerate(group):
            points = [(row["round"], row[name]) for row in run["curve"] if name in row]
            if points:
                label = f"seed {run['summary'].get('seed')}"
                (line,) = ax.plot(*zip(*points), marker=".", color=colors[i % len(colors)], label=label)
                handles.setdefault(label, line)
                rounds += [r for r, _ in points] if name == metric else []
        if name == metric and paper is not None:
            handles["paper"] = ax.axhline(paper, color="black", linestyle="--", label="paper")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))  # rounds are whole numbers
        ax.grid(alpha=0.3)
    if not rounds:
        plt.close(fig)
        return None
    first, last = min(rounds), max(rounds)
    pad = 0.03 * (last - first) or 0.5  # the end points' markers whole
    for ax in axes[0]:  # the reported metric's rounds: from the first evaluation, nothing is measured before it
        ax.set_xlim(first - pad, last + pad)
    fig.legend(handles.values(), handles.keys(), loc="outside upper center", ncols=min(len(handles), 8), fontsize=10)
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
