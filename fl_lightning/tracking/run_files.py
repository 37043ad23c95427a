"""The run directory: config.yaml, metrics.csv, summary.json, partition.json and checkpoints/.

Every file is replaced atomically (written to ``<name>.tmp``, fsynced, renamed over the old one, and the
directory fsynced): a run killed at any moment, or a machine that loses power, leaves the old file or the
new one, never a part of one.
"""

from __future__ import annotations

import csv
import fcntl
import io
import json
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from ..federation.errors import ConfigError


class RunFiles:
    """Paths and writers of one run's output directory.

    The directory is created by the first write, so a start that is refused leaves nothing behind.
    """

    def __init__(self, output_dir: str | Path):
        self.root = Path(output_dir)
        self.config = self.root / "config.yaml"
        self.metrics = self.root / "metrics.csv"
        self.summary = self.root / "summary.json"
        self.partition = self.root / "partition.json"
        self.checkpoints = self.root / "checkpoints"
        self.last_checkpoint = self.checkpoints / "last.ckpt"
        self.previous_checkpoint = self.checkpoints / "previous.ckpt"

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        """Rewrites metrics.csv from the history (one row per evaluation round); columns are the union."""
        columns: dict[str, None] = {"round": None}
        for row in rows:
            columns.update(dict.fromkeys(row))
        text = io.StringIO(newline="")
        writer = csv.DictWriter(text, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)
        self.write_text(self.metrics, text.getvalue())

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        self.write_text(path, json.dumps(_finite(data), indent=2, sort_keys=False) + "\n")

    def write_text(self, path: Path, text: str) -> None:
        replace_file(path, lambda f: f.write(text.encode()))


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
        self.root.mkdir(parents=True, exist_ok=True)
        lock = open(self.root / "run.lock", "ab")  # noqa: SIM115 - held open until release
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ConfigError(
                f"{self.root} is in use by another flrun process (it holds run.lock there); wait for it to end "
                "or choose another --output_dir."
            ) from None
        except OSError as err:  # a file system without flock (Lustre without flock, some NFS): run unguarded
            print(
                f"warning: {self.root} cannot be locked ({err.strerror}); make sure no other flrun process writes it.",
                file=sys.stderr,
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


def write_synced(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Writes ``path`` with ``write(file)`` and fsyncs it, so its bytes are on disk when this returns."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def fsync_directory(path: Path) -> None:
    """Makes the renames inside ``path`` durable (POSIX; other systems cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Replaces ``path`` atomically and durably with what ``write(file)`` writes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    write_synced(tmp, write)
    os.replace(tmp, path)
    fsync_directory(path.parent)


def _finite(value: Any) -> Any:
    """JSON has no NaN / inf: write them as null rather than as invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
