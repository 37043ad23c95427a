"""``flrun data inspect`` (a recipe's partition: per-client statistics and the client-by-class chart) and
``flrun data fetch`` (a data set's files, downloaded and verified)."""

from __future__ import annotations

from pathlib import Path

from ..run.arguments import UserError, parse_fit, recipe_name
from .parsers import CommandParser


def run_data(argv: list[str]) -> int:
    """``flrun data inspect --config RECIPE [--output PNG] [overrides]`` or
    ``flrun data fetch DATASET [--data_dir data] [--revision COMMIT] [--force]``."""
    if argv and argv[0] == "fetch":
        from ..data import catalog, sources

        names = ", ".join(s.name for s in catalog.SOURCES)
        parser = CommandParser(
            prog="flrun data fetch",
            description="Download a data set (or the ViT weights) into data_dir and verify its checksums, e.g. on "
            "a login node with internet, so that runs on an offline machine find the files.",
        )
        parser.add_argument("dataset", help=f"one of {names} (or the data set's class name)")
        parser.add_argument("--data_dir", default="data", help="the recipes' data_dir (default: data)")
        parser.add_argument("--revision", help="Hub commit for Hub data sets (FEMNIST and C4 have none pinned)")
        parser.add_argument("--force", action="store_true", help="download again even if the files are present")
        args = parser.parse_args(argv[1:])
        source = catalog.source(args.dataset)
        if sources.present(source, Path(args.data_dir)) and not args.force:
            sources.ensure(source.name, args.data_dir, download=False, revision=args.revision)
            print(f"{source.title}: already in {Path(args.data_dir) / source.layout} (--force downloads it again)")
            return 0
        paths = sources.fetch(source.name, args.data_dir, args.revision, force=args.force)
        print(f"{source.title}: downloaded and verified, {len(paths)} files in {Path(args.data_dir) / source.layout}")
        return 0
    if not argv or argv[0] != "inspect":
        raise UserError(
            "usage: flrun data inspect --config RECIPE [--output chart.png] [--key value ...], or "
            "flrun data fetch DATASET [--data_dir data]."
        )
    return _inspect(argv[1:])


def _inspect(argv: list[str]) -> int:
    """``flrun data inspect``: the partition's table on stdout, the chart in a file."""
    from ..data.inspect import bubble_chart, client_table, print_summary

    output, argv = _take_output(argv)
    cfg, init, _ = parse_fit(argv, prog="flrun data inspect")
    name = cfg.get("name") or recipe_name(argv)
    chart = _chart_path(output, name, cfg.seed)  # refused before the data are loaded
    data, clients = init.data, init.population.build(cfg.seed)
    data.setup(len(clients), cfg.seed)
    rows = client_table(data)
    print_summary(data, rows)
    written = bubble_chart(data, chart, replace=output is not None)
    kept = f" ({chart} is kept; --output names the file to write)" if written != chart else ""
    print(f"client-by-class chart: {written}{kept}")
    return 0


# the default folder of inspect's charts: a folder of its own, so no run folder ever holds one (a later flrun fit
# there would be refused) and `flrun report runs` finds nothing in it
CHARTS = Path("runs") / "inspect"
# what makes a folder a run's (flrun fit writes them): inspect's chart never goes into one
RUN_FILES = ("config.yaml", "summary.json", "metrics.csv", "partition.json", "checkpoints", "run.json")
FORMATS = (".png", ".pdf", ".svg")


def _take_output(argv: list[str]) -> tuple[str | None, list[str]]:
    """``--output PATH`` (or ``--output=PATH``) taken out of ``argv``; the rest are the recipe's options."""
    for i, arg in enumerate(argv):
        if arg.startswith("--output="):
            return arg.split("=", 1)[1], argv[:i] + argv[i + 1 :]
        if arg == "--output":
            if i + 1 == len(argv) or argv[i + 1].startswith("--"):
                raise UserError("--output needs the chart's file name, e.g. --output partition.png.")
            return argv[i + 1], argv[:i] + argv[i + 2 :]
    return None, argv


def _chart_path(output: str | None, name: str, seed: int) -> Path:
    """``--output``, or ``runs/inspect/<name>_seed<k>.png``: never a file in a run's folder."""
    if output is None:
        return CHARTS / f"{name}_seed{seed}.png"
    path = Path(output)
    if path.suffix.lower() not in FORMATS:
        raise UserError(f"--output {path} is not a chart file; give it the suffix .png, .pdf or .svg.")
    if path.is_dir():
        raise UserError(f"--output {path} is a folder; give a file name, e.g. --output {path / 'partition.png'}.")
    if any((path.parent / file).exists() for file in RUN_FILES):
        raise UserError(
            f"--output {path} lies in the run folder {path.parent}, which holds a run's files; give a path outside "
            f"it, e.g. --output {CHARTS / path.name}."
        )
    return path
