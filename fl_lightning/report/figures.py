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


# a method's colour and marker: 10 colours against 7 markers (coprime), so 70 methods before a pair repeats
MARKERS = ("o", "s", "^", "D", "v", "P", "X")
LEGEND_COLUMNS = 5
TRADEOFF_AXES = (
    ("mib", "MiB sent and received per client (cumulative)"),
    ("gflops", "local training GFLOPs per client (cumulative)"),
)


def x_scale(values: list[float]) -> tuple[str, dict]:
    """How an axis of ``values`` is drawn: linear, unless its positive values span two decades or more; then
    logarithmic, or symmetric-logarithmic when a value is 0 (a method that sends nothing): linear below the
    smallest positive value's decade, where 0 sits, logarithmic above."""
    positive = [v for v in values if v > 0]
    if not positive or max(positive) < 100 * min(positive):
        return "linear", {}
    if len(positive) == len(values):
        return "log", {}
    return "symlog", {"linthresh": 10 ** np.floor(np.log10(min(positive))), "linscale": 0.5}


def tradeoff_figure(setting):
    """A setting's trade-off (``report.tradeoff``): its metric against the traffic per client and, where runs
    recorded it, against the local training compute per client, side by side; per method a colour and marker,
    per seed a thin line through the evaluated rounds ending in a large marker, the paper's points as stars
    (on the traffic panel); one legend row of methods below. None with nothing to draw."""
    from matplotlib.lines import Line2D

    methods = [m for m in setting.methods if m.curves or m.paper]  # the others: the setting's notes say why
    curves = [c for m in methods for c in m.curves]
    if not methods:
        return None
    axes_shown = [a for a in TRADEOFF_AXES if a[0] == "mib" or any(c.gflops for c in curves)]
    plt = pyplot()
    rows = -(-(len(methods) + 1) // LEGEND_COLUMNS)
    fig, axes = plt.subplots(
        1, len(axes_shown), figsize=(WIDTH_IN, 3.6 + 0.22 * rows), squeeze=False, sharey=True, layout="constrained"
    )
    colors = plt.get_cmap("tab10").colors
    handles = []
    for i, method in enumerate(methods):
        style = {"color": colors[i % len(colors)], "marker": MARKERS[i % len(MARKERS)]}
        for ax, (field, _) in zip(axes[0], axes_shown):
            for curve in method.curves:
                xs = getattr(curve, field)
                if xs:
                    ax.plot(xs, curve.acc, linewidth=1, alpha=0.55, markersize=3, **style)
                    ax.plot(xs[-1:], curve.acc[-1:], linestyle="none", markersize=8, mec="black", mew=0.6, **style)
            if field == "mib" and method.paper:
                points = [(p.mib, p.acc) for p in method.paper]
                ax.plot(*zip(*points), linestyle="none", marker="*", markersize=14, color=style["color"], mec="black")
        handles.append(Line2D([], [], linewidth=1, markersize=7, label=_short(method.label), **style))
    if any(m.paper for m in methods):
        handles.append(Line2D([], [], linestyle="none", marker="*", markersize=12, color="white", mec="black",
                              label="paper's point"))  # fmt: skip
    for ax, (field, label) in zip(axes[0], axes_shown):
        values = [x for c in curves for x in (getattr(c, field) or [])]
        values += [p.mib for m in methods for p in m.paper] if field == "mib" else []
        scale, options = x_scale(values)
        ax.set_xscale(scale, **options)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3, which="both" if scale != "linear" else "major")
    metrics = {m.metric for m in methods}
    axes[0][0].set_ylabel(metrics.pop() if len(metrics) == 1 else "each method's reported metric")
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), LEGEND_COLUMNS), fontsize=9)
    return fig


def _short(label: str, chars: int = 40) -> str:
    return label if len(label) <= chars else label[: chars - 1] + "…"
