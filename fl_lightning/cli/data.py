"""``flrun data inspect`` (a recipe's partition: per-client statistics and the client-by-class chart) and
``flrun data fetch`` (a data set's files, downloaded and verified)."""

from __future__ import annotations

from pathlib import Path

from ..run.arguments import UserError, parse_fit, recipe_name


def run_data(argv: list[str]) -> int:
    """``flrun data inspect --config RECIPE [--output PNG] [overrides]`` or
    ``flrun data fetch DATASET [--data_dir data] [--revision COMMIT] [--force]``."""
    if argv and argv[0] == "fetch":
        import argparse

        from ..data import catalog, sources

        names = ", ".join(s.name for s in catalog.SOURCES)
        parser = argparse.ArgumentParser(
            prog="flrun data fetch",
            description="Download a data set (or the ViT weights) into data_dir and verify its checksums, e.g. on "
            "a login node with internet, so that runs on an offline machine find the files.",
            allow_abbrev=False,
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
    from ..data.inspect import bubble_chart, client_table, print_summary

    if not argv or argv[0] != "inspect":
        raise UserError(
            "usage: flrun data inspect --config RECIPE [--output chart.png] [--key value ...], or "
            "flrun data fetch DATASET [--data_dir data]."
        )
    argv = argv[1:]
    output = None
    if "--output" in argv:
        i = argv.index("--output")
        output = argv[i + 1] if i + 1 < len(argv) else None
        argv = argv[:i] + argv[i + 2 :]
    cfg, init, _ = parse_fit(argv, prog="flrun data inspect")
    data, clients = init.data, init.population.build(cfg.seed)
    data.setup(len(clients), cfg.seed)
    rows = client_table(data)
    print_summary(data, rows)
    name = cfg.get("name") or recipe_name(argv)
    print(f"client-by-class chart: {bubble_chart(data, _chart_path(output, cfg.output_dir, name, cfg.seed))}")
    return 0


# what makes a folder a run's (flrun fit writes them): inspect's chart never goes into one
RUN_FILES = ("config.yaml", "summary.json", "metrics.csv", "partition.json", "checkpoints")


def _chart_path(output: str | None, output_dir: str | None, name: str, seed: int) -> Path:
    """``--output``, or beside the recipe's run folder (``runs/<name>/seed<k>.partition.png``): a run's folder holds
    only what its run wrote, so a later run there is not refused and a run's own files are not replaced."""
    run = Path(output_dir or Path("runs") / name / f"seed{seed}")
    path = Path(output) if output else run.with_name(f"{run.name}.partition.png")
    if any((path.parent / file).exists() for file in RUN_FILES):
        raise UserError(
            f"--output {path} lies in the run folder {path.parent}, which holds a run's files; give a path outside "
            f"it, e.g. --output {path.parent.with_name(path.parent.name + '.partition.png')}."
        )
    return path
