"""Lightning Fabric without the rest of Lightning: what a run needs from it, imported in a fraction of the time.

``import lightning`` imports ``lightning.pytorch`` (the Trainer, callbacks, ``LightningModule``), which imports
torchmetrics, whose package imports torchvision, transformers and ``scipy.signal``: about 2 s of a digits
run's 5 s of imports (``python -X importtime``; upstream: Lightning-AI/pytorch-lightning#19261). A run uses
Fabric alone (device, precision, ``autocast``, ``backward``, the strategy's optimizer step), and the
``lightning_fabric`` package that ``lightning`` installs is that same Fabric without ``lightning.pytorch``.
Even it imports torchmetrics once, to compare its version (``lightning_fabric.utilities.imports``); the
version is read from the installed package's metadata instead while it loads.

Every Fabric a run makes comes from :func:`fabric_class`, so a run mixes no objects of ``lightning.fabric``
and ``lightning_fabric`` (distinct classes with the same names): pass strategies and plugins by name.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

_fabric: type | None = None


def _version_from_metadata(compare_version: Callable[..., bool]) -> Callable[..., bool]:
    """``compare_version`` that answers for torchmetrics from its metadata instead of importing it."""

    def compare(package: str, op: Callable[[Any, Any], bool], version: str, use_base_version: bool = False) -> bool:
        if package != "torchmetrics":
            return compare_version(package, op, version, use_base_version)
        from packaging.version import Version

        try:
            installed = Version(importlib.metadata.version(package))
        except importlib.metadata.PackageNotFoundError:
            return False
        return op(Version(installed.base_version) if use_base_version else installed, Version(version))

    return compare


def fabric_class() -> type:
    """The ``Fabric`` class, imported on first use (about 1 s: torch._dynamo, which Fabric imports, is most).

    ``lightning_fabric.Fabric`` where installed (``lightning`` 2.x installs it with ``pytorch-lightning``),
    else ``lightning.Fabric`` (the same class, at the cost of importing all of Lightning).
    """
    global _fabric
    if _fabric is None:
        try:
            import lightning_utilities.core.imports as requirement_checks

            compare_version = requirement_checks.compare_version
            requirement_checks.compare_version = _version_from_metadata(compare_version)
            try:
                from lightning_fabric import Fabric
            finally:
                requirement_checks.compare_version = compare_version
        except ImportError:
            from lightning import Fabric  # type: ignore[assignment]  # lightning_fabric's Fabric, bundled
        _fabric = Fabric
    return _fabric


def lightning_version() -> str:
    """The installed Lightning version, for a run's record, without importing it."""
    for distribution in ("lightning", "pytorch-lightning", "lightning-fabric"):  # the ones that ship Fabric
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "unknown"


def single_process_environment() -> Any:
    """A cluster environment that makes Fabric see one process, whatever launched it.

    Ranks are this framework's own (:mod:`fl_lightning.distributed.ranks`); Fabric only picks a device and a
    precision. Left to detect its environment, Fabric reads Slurm's variables and refuses a batch script's
    ``--ntasks`` ("use
    ``--ntasks-per-node``"), which is a valid way to get ``srun flrun fit`` ranks.
    """
    root = fabric_class().__module__.split(".")[0]
    package = "lightning.fabric" if root == "lightning" else root
    return importlib.import_module(f"{package}.plugins.environments").LightningEnvironment()
