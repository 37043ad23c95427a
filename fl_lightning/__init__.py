"""fl-lightning: heterogeneous-model federated learning with knowledge distillation.

The package is laid out by concern, each folder's ``__init__`` saying what it owns and may import (from the
top layer down): ``cli``; ``sweep``; ``report``; ``run``; ``strategies``; ``client``; ``data``,
``knowledge``, ``tracking`` and ``distributed``; ``models``; ``federation``. The import-linter contracts
in ``pyproject.toml`` keep it so.

From Python, :func:`fit` runs a recipe as ``flrun fit`` does and returns its summary. Importing the package
stays light (no torch): what a run needs is imported when :func:`fit` is called.
"""

from __future__ import annotations

from .federation.errors import ConfigError
from .federation.release import VERSION, install_moved_modules

__version__ = VERSION
__all__ = ["ConfigError", "fit"]

# old module paths (before the layout by concern) still import, each with a FutureWarning naming its new path
install_moved_modules()


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
