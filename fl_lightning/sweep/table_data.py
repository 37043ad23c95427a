"""The data sets a table's runs read, checked before any run starts: ``flrun table`` refuses in one sentence
when runs to do lack theirs (each would fail on its own, one after another), or with ``--skip_missing`` runs
only those whose data are there. A data set that the recipes download (``download: true``) is fetched here
once, before the runs, rather than by every run at the same time; one that cannot be fetched is missing.
``flrun table --dry_run`` lists the same data sets without fetching anything."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple, TextIO

import yaml

from ..data import catalog, sources
from ..data.download import NetworkError
from ..federation.errors import ConfigError
from ..report.runs import json_object
from .table import TableRun


class Lacking(NamedTuple):
    """A data set a recipe reads that is not under its ``data_dir``."""

    title: str
    name: str  # what `flrun data fetch` calls it
    data_dir: str
    download: bool  # the recipe fetches it itself (download: true)


def missing_data(run: TableRun, fit_args: list[str]) -> list[Lacking]:
    """The data sets ``run``'s recipe reads that are not under their ``data_dir`` (its server set's too)."""
    found = []
    data = _data_spec(run, fit_args)
    while isinstance(data, dict):  # the data set, then the one its server set comes from (out-of-domain)
        class_name = str(data.get("class_path", "")).rsplit(".", 1)[-1]
        init = {**_defaults(class_name), **json_object(data.get("init_args"))}
        source = catalog.NAMES.get(class_name.lower())
        data_dir = str(init.get("data_dir") or "data")
        if source is not None and not sources.present(source, Path(data_dir)):
            found.append(Lacking(source.title, source.name, data_dir, bool(init.get("download"))))
        data = init.get("server_dataset")
    return found


def _data_spec(run: TableRun, fit_args: list[str]) -> dict | None:
    """The recipe's ``data`` (class_path, init_args): from the recipe file and its bases, or, when the arguments
    after ``--`` touch the data, from the parser (a second or more per recipe, which a table of many recipes
    feels)."""
    if any(arg.startswith("--data") for arg in fit_args):
        from ..run.arguments import parse_fit

        return (yaml.safe_load(parse_fit(run.fit_argv(fit_args))[2]) or {}).get("data")
    from ..run.recipes import load_recipe

    data = load_recipe(run.recipe).get("data")
    return {"class_path": data} if isinstance(data, str) else data


def _defaults(class_name: str) -> dict:
    """The data set class's own ``data_dir`` and ``download`` defaults (FEMNIST and IMDB download by default)."""
    import inspect

    from .. import data

    cls = getattr(data, class_name, None)
    if not isinstance(cls, type):
        return {}
    parameters = inspect.signature(cls).parameters
    return {k: parameters[k].default for k in ("data_dir", "download") if k in parameters}


def lacking_by_recipe(runs: list[TableRun], fit_args: list[str]) -> dict[Path, list[Lacking]]:
    """Each recipe's missing data sets (one parse per recipe: the seed changes no data set)."""
    return {recipe: missing_data(run, fit_args) for recipe, run in {r.recipe: r for r in runs}.items()}


def check_data(
    pending: list[TableRun], fit_args: list[str], skip_missing: bool, out: TextIO
) -> tuple[list[TableRun], list[TableRun]]:
    """The runs to do whose data are there, and those skipped for lack of them (``skip_missing``); refuses
    (ConfigError) when runs lack their data and ``skip_missing`` is off. Downloads what recipes may download."""
    lacking = lacking_by_recipe(pending, fit_args)
    failures = _download(lacking, out)
    lacking = {recipe: [item for item in items if not _present(item)] for recipe, items in lacking.items()}
    ready = [run for run in pending if not lacking[run.recipe]]
    skipped = [run for run in pending if lacking[run.recipe]]
    if skipped and not skip_missing:
        others = len(ready)
        rest = f", or run the other {others} with --skip_missing" if others else ""
        raise ConfigError(
            f"no run was started: {len(skipped)} of the {len(pending)} runs to do lack their data: "
            f"{_data_sets(skipped, lacking, failures)}{rest}; --dry_run lists the runs."
        )
    if skipped:
        out.write(
            f"skipping {len(skipped)} of the {len(pending)} runs to do, whose data are missing: "
            f"{_data_sets(skipped, lacking, failures)}.\n"
        )
    return ready, skipped


def _present(item: Lacking) -> bool:
    return sources.present(catalog.source(item.name), Path(item.data_dir))


def _download(lacking: dict[Path, list[Lacking]], out: TextIO) -> dict[tuple[str, str], str]:
    """Fetches, once each, the missing data sets that a recipe sets ``download: true`` for; returns why each
    fetch that failed did (by name and data_dir)."""
    wanted = {(item.name, item.data_dir): item for items in lacking.values() for item in items if item.download}
    failures = {}
    for (name, data_dir), item in wanted.items():
        out.write(f"{item.title}: not in {data_dir}; downloading it before the runs start\n")
        out.flush()
        try:
            sources.fetch(name, data_dir)
        except NetworkError as err:
            failures[name, data_dir] = err.reason
    return failures


def _data_sets(runs: list[TableRun], lacking: dict[Path, list[Lacking]], failures: dict) -> str:
    """``CIFAR-10 (21 runs) and FEMNIST (21 runs) are not in data; get them with `flrun data fetch cifar10
    --data_dir data`, ... on a machine with internet, then copy the data folder here``."""
    counts: dict[tuple[str, str], int] = {}
    for run in runs:
        for item in lacking[run.recipe]:
            counts[item.name, item.data_dir] = counts.get((item.name, item.data_dir), 0) + 1
    where: dict[tuple[str, str | None], list[str]] = {}  # data sets by folder and by why a download failed
    for (name, data_dir), count in counts.items():
        shown = f"{catalog.source(name).title} ({count} run{'s' * (count != 1)})"
        where.setdefault((data_dir, failures.get((name, data_dir))), []).append(shown)
    groups = [
        f"{_and(shown)} {'is' if len(shown) == 1 else 'are'} not in {data_dir}"
        + (f" and could not be downloaded ({failed})" if failed else "")
        for (data_dir, failed), shown in where.items()
    ]
    commands = [sources.fetch_command(name, data_dir) for name, data_dir in counts]
    return (
        f"{'; '.join(groups)}; get {'it' if len(counts) == 1 else 'them'} with {', '.join(commands)} on a machine "
        "with internet, then copy the data folder here"
    )


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"
