"""fl-lightning: heterogeneous-model federated learning with knowledge distillation.

The package is laid out by concern, each folder's ``__init__`` saying what it owns and may import (from the
top layer down): ``cli``; ``sweep``; ``report``; ``run``; ``strategies``; ``client``; ``data``,
``knowledge``, ``tracking`` and ``distributed``; ``models``; ``federation``. The import-linter contracts
in ``pyproject.toml`` keep it so.

From Python, :func:`fit` runs a recipe as ``flrun fit`` does and returns its summary. Importing the package
stays light (no torch): what a run needs is imported when :func:`fit` is called.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

from .federation.errors import ConfigError

__version__ = "0.1.0"
__all__ = ["ConfigError", "fit"]

# Modules that moved when the package was laid out by concern: their old dotted paths (in users' code and in
# recipes written before, e.g. ``class_path: fl_lightning.sampling.UniformSampler``) still import, as the
# module at its new path.
MOVED = {
    "asynchrony": "run.asynchrony",
    "checkpoint": "run.checkpoint",
    "cli_messages": "run.messages",
    "client_store": "run.client_store",
    "data_inspect": "data.inspect",
    "errors": "federation.errors",
    "evaluation": "client.evaluation",
    "fabric_loader": "distributed.fabric",
    "fit_args": "run.arguments",
    "gpu_share": "distributed.gpu_share",
    "ledger": "federation.ledger",
    "orchestrator": "run.orchestrator",
    "population": "federation.population",
    "ranks": "distributed.ranks",
    "recipes": "run.recipes",
    "report_groups": "report.groups",
    "report_render": "report.render",
    "report_sweep": "report.sweeps",
    "report_table": "report.tables",
    "robustness": "run.robustness",
    "run_state": "run.state",
    "sampling": "federation.sampling",
    "schedules": "federation.schedules",
    "seeding": "federation.seeding",
    "sharding": "run.sharding",
    "stacked_eval": "client.stacked_eval",
    "sweep_results": "sweep.results",
    "sweep_study": "sweep.study",
    "sweep_trial": "sweep.trial",
    "sweep_workers": "sweep.workers",
    "table_runs": "sweep.table",
    "types": "federation.types",
}
# ``fl_lightning.fit`` is the function below; the module of that name moved to ``fl_lightning.run.fit``
GONE = {"fit": "run.fit"}
# classes that moved to another module (an old recipe's class_path names them there)
MOVED_CLASSES = {"knowledge.codistill.Codistillation": "strategies.codistillation.Codistillation"}


def current_path(dotted: str) -> str:
    """``dotted`` (a module or a ``module.Name``) with a moved module's old path replaced by its new one."""
    if not dotted.startswith("fl_lightning."):
        return dotted
    if dotted[len("fl_lightning.") :] in MOVED_CLASSES:
        return "fl_lightning." + MOVED_CLASSES[dotted[len("fl_lightning.") :]]
    parts = dotted.split(".")
    for end in range(len(parts), 1, -1):
        new = MOVED.get(".".join(parts[1:end]))
        if new is not None:
            return ".".join(["fl_lightning", new, *parts[end:]])
    return dotted


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``fl_lightning.<old path>`` as the module at its new path (one module object, two names)."""

    def find_spec(self, name, path=None, target=None):
        if name.startswith("fl_lightning.") and name[len("fl_lightning.") :] in MOVED:
            return importlib.util.spec_from_loader(name, self)
        if name.startswith("fl_lightning.") and name[len("fl_lightning.") :] in GONE:
            old, new = name, "fl_lightning." + GONE[name[len("fl_lightning.") :]]
            raise ModuleNotFoundError(
                f"{old} is now the function {old}(config=...); the module moved to {new}: import from there "
                f"(from {new} import ...).",
                name=old,
            )
        return None

    def create_module(self, spec):
        return None  # the default empty module, replaced in exec_module

    def exec_module(self, module):
        # the import system returns what sys.modules holds under the name once this returns
        sys.modules[module.__name__] = importlib.import_module(current_path(module.__name__))


if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
    sys.meta_path.append(_MovedModules())


def fit(config=None, **options):
    """Runs a federated experiment as ``flrun fit`` does and returns its summary (what ``summary.json`` holds).

    Args:
        config: a recipe file (``"recipes/quickstart.yaml"``), a list of them (later ones on top, as several
            ``--config``), or a mapping of recipe keys.
        **options: the ``flrun fit`` options (``flrun fit --help``), on top of the recipe: ``rounds=5``,
            ``seed=1``, ``output_dir="runs/try"``; nested ones as dotted keys (``**{"training.batch_size": 32}``)
            or as a mapping that merges into the recipe's (``training={"batch_size": 32}``). ``logger`` may
            also hold :class:`~fl_lightning.tracking.RunLogger` objects, which receive every round's metrics.

    Returns:
        The summary: ``final`` and ``best`` metrics, ``best_round``, ``output_dir``, communication, versions.

    Raises:
        ConfigError: a mistake in the recipe or the options, in the one sentence ``flrun fit`` prints, naming
            keyword arguments (``rounds=1``, ``resume="auto"``) where the command line names options; also when
            another ``fit`` runs in this process (another thread): one run at a time per process, since runs
            share its random state, torch threads and precision settings (run several in separate processes).
    """
    from .run.api import fit_recipe

    return fit_recipe(config, **options)
