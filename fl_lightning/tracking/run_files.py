"""The run directory: run.json, config.yaml, metrics.csv, summary.json, partition.json and checkpoints/.

``run.json`` marks the directory as a run's, with the run's id: a run writes only into a new or empty directory
or one its own marker names (``run/run_dir.py``), never into a folder of the user's.

Every file is replaced atomically (:mod:`fl_lightning.federation.files`: written to ``<name>.tmp``, fsynced,
renamed over the old one, and the directory fsynced): a run killed at any moment, or a machine that loses power,
leaves the old file or the new one, never a part of one. A write that fails (a full disk) removes its ``.tmp``
file and raises an OSError that names the file; SIGTERM or Ctrl-C during a write take effect once it is done.
metrics.csv, which the CSV logger writes (``loggers.CsvLogger``), too is rewritten whole from the run's
history at each evaluation, never appended to, so a cut write cannot leave half a row.
"""

from __future__ import annotations

import fcntl
import json
import logging
import math
from pathlib import Path
from typing import IO, Any

from ..federation.errors import ConfigError
from ..federation.files import atomic_write

log = logging.getLogger(__name__)

MARKER = "run.json"  # what makes a directory a run's
MARKER_KIND = "flrun fit run directory"
LOCK = "run.lock"


class RunFiles:
    """Paths and writers of one run's output directory.

    The directory is created by the first write, so a start that is refused leaves nothing behind.
    """

    def __init__(self, output_dir: str | Path):
        self.root = Path(output_dir)
        self.marker = self.root / MARKER
        self.config = self.root / "config.yaml"
        self.metrics = self.root / "metrics.csv"
        self.summary = self.root / "summary.json"
        self.partition = self.root / "partition.json"
        self.checkpoints = self.root / "checkpoints"
        self.last_checkpoint = self.checkpoints / "last.ckpt"
        self.previous_checkpoint = self.checkpoints / "previous.ckpt"

    def run_id(self) -> str | None:
        """The id in this directory's marker; None when the directory holds no marker of a run."""
        return marker_id(self.root)

    def mark(self, run_id: str) -> None:
        """Marks the directory as the run ``run_id``'s (its first write; a directory marked already keeps its id)."""
        if self.run_id() is None:
            self.write_json(self.marker, {"kind": MARKER_KIND, "run_id": run_id})

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        self.write_text(path, json.dumps(_finite(data), indent=2, sort_keys=False) + "\n")

    def write_text(self, path: Path, text: str) -> None:
        atomic_write(path, text)


class RunLock:
    """An exclusive lock on ``<run>/run.lock``, held by the one process that writes the run (rank 0) until it
    ends: a second ``flrun fit`` on the same directory (a duplicate job, a resume while it runs) would delete
    client files the first still needs and interleave checkpoints. ``flock``: released when the process dies.
    """

    def __init__(self, root: Path, enabled: bool = True):
        self.root, self.enabled = Path(root), enabled
        self._file: IO[bytes] | None = None

    def acquire(self) -> None:
        """Takes the lock (creating the directory) unless held; refuses a directory another process holds."""
        if not self.enabled or self._file is not None:
            return
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            lock = open(self.root / LOCK, "ab")  # noqa: SIM115 - held open until release
        except OSError as err:
            raise ConfigError(
                f"{err.filename or self.root} cannot be created ({err.strerror}); choose an --output_dir you can "
                "write to."
            ) from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ConfigError(
                f"{self.root} is in use by another flrun process (it holds run.lock there); wait for it to end "
                "or choose another --output_dir."
            ) from None
        except OSError as err:  # a file system without flock (Lustre without flock, some NFS): run unguarded
            log.warning(
                "warning: %s cannot be locked (%s); make sure no other flrun process writes it.",
                self.root,
                err.strerror,
            )
        self._file = lock

    def release(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RunLock:  # noqa: PYI034 - typing.Self needs Python 3.11
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def marker_id(root: Path) -> str | None:
    """The run id in ``root/run.json`` when flrun wrote it; None for no marker, or a file of someone else's."""
    path = Path(root) / MARKER
    try:
        if not path.is_file() or path.stat().st_size > 4096:
            return None
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # unreadable or not JSON: not a marker this program wrote
        return None
    if not isinstance(data, dict) or data.get("kind") != MARKER_KIND or not isinstance(data.get("run_id"), str):
        return None
    return data["run_id"]


def _finite(value: Any) -> Any:
    """JSON has no NaN / inf: write them as null rather than as invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
