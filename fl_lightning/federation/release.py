"""The package's release: its version, and the module paths that moved when the package was laid out by
concern, which still import (with a ``FutureWarning`` naming the new path) until the release that drops them.

Here rather than in the package's ``__init__``: every layer may read this module, and no module imports the
package root (an import-linter contract).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import warnings

VERSION = "0.1.0"
# the first release without the old paths below
MOVED_PATHS_REMOVED_IN = "0.2.0"

# Modules that moved when the package was laid out by concern, or were renamed since: their old dotted paths
# (in users' code and in recipes written before, e.g. ``class_path: fl_lightning.sampling.UniformSampler``)
# still import, as the module at its new path.
MOVED = {
    "asynchrony": "run.asynchrony",
    "checkpoint": "run.checkpoint",
    "cli_messages": "run.input_errors",
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
    "run.messages": "run.input_errors",
    "run_state": "run.state",
    "sampling": "federation.sampling",
    "schedules": "federation.schedules",
    "seeding": "federation.seeding",
    "sharding": "run.sharding",
    "stacked_eval": "client.stacked_eval",
    "sweep_results": "sweep.results",
    "sweep_study": "sweep.study",
    "sweep_trial": "sweep.trial",
    "sweep.run": "sweep.driver",
    "sweep_workers": "sweep.workers",
    "table_runs": "sweep.table",
    "types": "federation.types",
}
# ``fl_lightning.fit`` is the package's function; the module of that name moved to ``fl_lightning.run.fit``
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


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports ``fl_lightning.<old path>`` as the module at its new path (one module object, two names), with a
    ``FutureWarning`` naming the new path; the first import of each old path warns (later ones find the module
    in ``sys.modules``)."""

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
        new = current_path(module.__name__)
        warnings.warn(
            f"{module.__name__} moved to {new}; import it (or name it in a recipe's class_path) from there: the old "
            f"path goes in fl-lightning {MOVED_PATHS_REMOVED_IN}.",
            FutureWarning,
            stacklevel=2,  # the importing line: the import system's own frames are skipped
        )
        # the import system returns what sys.modules holds under the name once this returns
        sys.modules[module.__name__] = importlib.import_module(new)


def install_moved_modules() -> None:
    """Lets the old module paths import (once per process, however often the package is imported)."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(MovedModules())
