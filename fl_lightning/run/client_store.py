"""Per-client persistent state whose checkpoint cost is the clients that changed, not all clients ever trained.

Personalized methods keep state per client (its own weights, optimizer moments). Written into every
checkpoint whole, that state grows with the clients that have ever trained (0.22 MB each for FedHe on
digits). :class:`ClientStateStore` keeps it instead as one file per client and change:

- ``checkpoints/clients/<client>-<writer>-<n>.pt`` holds one client's state (tensors and plain containers,
  ``torch.save``, read back with ``weights_only=True`` after its SHA-256 is checked). A checkpoint writes
  the files of the clients that changed since the previous one and holds a manifest (client, file,
  SHA-256: 56 bytes per client with state), so its cost is the round's clients.
- States stay in memory up to a budget; beyond it the least recently used are written (when changed)
  and dropped, and read back from their file when needed.
- A file name is never reused (``writer`` is random per process, ``n`` counts its writes), and a
  client's files are fsynced with their directory before the checkpoint that names them is renamed into
  place, so no checkpoint names a half-written file or one a later round overwrote. A superseded file is
  deleted once neither ``last.ckpt`` nor ``previous.ckpt`` names it; files a killed run left behind are
  deleted when the run starts or resumes.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.serialization import default_restore_location

from ..federation.errors import ConfigError
from ..federation.files import fsync_directory, write_synced
from .checkpoint import PREVIOUS, check_plain, load_checkpoint

CLIENTS_DIR = "clients"  # next to last.ckpt
MANIFEST = 1  # the manifest's own format
_FILE = re.compile(r"^(\d+)-([0-9a-f]{16})-(\d+)\.pt$")


@dataclass(frozen=True)
class _Version:
    """One file of one client's state."""

    writer: int
    number: int
    sha256: bytes
    saves: int  # checkpoints this store had saved when the file was written; -1: named by the restored one

    def name(self, client_id: int) -> str:
        return f"{client_id}-{self.writer:016x}-{self.number}.pt"


class ClientStateStore:
    """Every client's persistent state (``ctx.state``), in memory up to a budget and in versioned files.

    Args:
        directory: where the client files go (``<run>/checkpoints/clients``); created on the first write.
        memory_budget_mb: megabytes of tensors kept in memory; ``None`` keeps every state in memory
            (files are still written at each checkpoint, for the clients that changed).
        device: the Fabric device: on CPU every state read back is on CPU; elsewhere a tensor saved from CPU
            returns to CPU and one saved from an accelerator returns to ``device`` (another rank's GPU included).
    """

    def __init__(self, directory: Path, memory_budget_mb: float | None = None, device: Any = "cpu"):
        if memory_budget_mb is not None and memory_budget_mb < 0:
            raise ConfigError(
                f"runtime.client_state_memory_mb must be 0 or more (or null: no limit), got {memory_budget_mb}."
            )
        self.directory = Path(directory)
        self.budget = None if memory_budget_mb is None else int(memory_budget_mb * 2**20)
        # on CPU for a CPU run; else a tensor saved from CPU (an Adam step count) comes back on CPU and one saved
        # from an accelerator on this process's device: under several ranks rank 0 writes every client's file from
        # its cuda:0, and rank 1 reading one (a resume, a spilled state) must get it on its own cuda:1
        self.device = torch.device(device)
        self.map_location = "cpu" if self.device.type == "cpu" else self._to_this_device
        self._writer = int.from_bytes(os.urandom(8), "little") >> 1  # fits int64; never seeds anything
        self._written = 0
        self._checkpoint_names: dict[str, set[str]] | None = None  # read once, when the run starts or resumes
        self.bytes_written = 0  # client-file bytes written by this process (benchmarks/population.py)
        self._reset()

    def _to_this_device(self, storage, location: str):
        return storage if location == "cpu" else default_restore_location(storage, str(self.device))

    def _reset(self) -> None:
        self._memory: OrderedDict[int, dict] = OrderedDict()  # least recently trained first
        self._sizes: dict[int, int] = {}
        self._memory_bytes = 0
        self._unsaved: set[int] = set()  # in memory and newer than their file (or without one)
        self._files: dict[int, _Version] = {}  # each client's latest file
        self._retired: list[tuple[int, int, _Version]] = []  # (deletable after this many saves, client, file)
        self._saves = 0
        self._unsynced = False  # a file was written since the directory was last fsynced

    # ------------------------------------------------------------------ reading
    def __contains__(self, client_id: int) -> bool:
        """Whether the client has state (it has trained, for the methods that keep state)."""
        return client_id in self._memory or client_id in self._files

    def __len__(self) -> int:
        return len(self._memory.keys() | self._files.keys())

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(self._memory.keys() | self._files.keys()))

    def get(self, client_id: int, default: Any = None) -> Any:
        """The client's state for reading (evaluation); a state read from its file is not kept in memory."""
        if client_id in self._memory:
            return self._memory[client_id]
        if client_id in self._files:
            return self._read(client_id, self._files[client_id])
        return default

    # ------------------------------------------------------------------ a client's update
    def open(self, client_id: int) -> dict:
        """The client's state for its update (a new empty dict for a client without state)."""
        if client_id in self._memory:
            return self._memory[client_id]
        if client_id in self._files:
            state = self._read(client_id, self._files[client_id])
            self._keep(client_id, state)
            return state
        return {}

    def close(self, client_id: int, state: dict) -> None:
        """Records the state after the client's update (an empty one removes the client's state)."""
        if not state:
            self._discard(client_id)
            return
        check_plain(state, f"client {client_id}'s state")  # refused now, not when a file would fail to load
        self._keep(client_id, state)
        self._unsaved.add(client_id)
        self._spill()

    def _keep(self, client_id: int, state: dict) -> None:
        self._memory_bytes -= self._sizes.get(client_id, 0)
        self._memory[client_id] = state
        self._memory.move_to_end(client_id)
        self._sizes[client_id] = _tensor_bytes(state)
        self._memory_bytes += self._sizes[client_id]

    def _drop(self, client_id: int) -> None:
        del self._memory[client_id]
        self._memory_bytes -= self._sizes.pop(client_id)
        self._unsaved.discard(client_id)

    def _discard(self, client_id: int) -> None:
        if client_id in self._memory:
            self._drop(client_id)
        if client_id in self._files:
            self._retire(client_id, self._files.pop(client_id))

    def _spill(self) -> None:
        """Writes (when changed) and drops the least recently trained states until memory fits the budget."""
        if self.budget is None:
            return
        while self._memory_bytes > self.budget and self._memory:
            client_id = next(iter(self._memory))
            if client_id in self._unsaved:
                self._write(client_id)
            self._drop(client_id)

    # ------------------------------------------------------------------ files
    def _path(self, client_id: int, version: _Version) -> Path:
        return self.directory / version.name(client_id)

    def _write(self, client_id: int) -> None:
        buffer = io.BytesIO()
        torch.save(self._memory[client_id], buffer)
        data = buffer.getvalue()
        version = _Version(self._writer, self._written, hashlib.sha256(data).digest(), self._saves)
        self._written += 1
        self.directory.mkdir(parents=True, exist_ok=True)
        write_synced(self._path(client_id, version), lambda f: f.write(data))
        self.bytes_written += len(data)
        self._unsynced = True
        if client_id in self._files:
            self._retire(client_id, self._files[client_id])
        self._files[client_id] = version
        self._unsaved.discard(client_id)

    def _retire(self, client_id: int, version: _Version) -> None:
        """A superseded file: deleted now if no checkpoint names it, else once the checkpoints that do are gone."""
        if version.saves < self._saves:  # named by the last checkpoint (S): kept while S is last or previous
            self._retired.append((self._saves + 2, client_id, version))
        else:  # written after the last checkpoint: nothing names it
            self._path(client_id, version).unlink(missing_ok=True)

    def _read(self, client_id: int, version: _Version) -> dict:
        data = _verified_bytes(self._path(client_id, version), version.sha256)
        return torch.load(io.BytesIO(data), map_location=self.map_location, weights_only=True)

    # ------------------------------------------------------------------ checkpoints
    def manifest(self) -> dict[str, Any]:
        """Writes every changed state and returns the checkpoint's manifest (the files, durable on disk).

        Call :meth:`saved` once the checkpoint holding it is written.
        """
        for client_id in sorted(self._unsaved):
            self._write(client_id)
        if self._unsynced:
            fsync_directory(self.directory)
            self._unsynced = False
        ids = sorted(self._files)
        versions = [self._files[i] for i in ids]
        digests = np.frombuffer(b"".join(v.sha256 for v in versions), dtype=np.uint8).reshape(-1, 32)
        return {
            "manifest": MANIFEST,
            "ids": torch.tensor(ids, dtype=torch.int64),
            "writers": torch.tensor([v.writer for v in versions], dtype=torch.int64),
            "numbers": torch.tensor([v.number for v in versions], dtype=torch.int64),
            "sha256": torch.from_numpy(digests.copy()),
        }

    def saved(self) -> None:
        """The checkpoint holding the last manifest is durable: deletes the files no kept checkpoint names."""
        self._saves += 1
        due = [item for item in self._retired if item[0] <= self._saves]
        self._retired = [item for item in self._retired if item[0] > self._saves]
        for _, client_id, version in due:
            self._path(client_id, version).unlink(missing_ok=True)

    def start(self) -> None:
        """A fresh run: deletes client files a killed run left behind (no kept checkpoint names them)."""
        self.free_leftovers(None)

    def free_leftovers(self, manifest: Any) -> None:
        """Deletes the client files that neither ``manifest`` (the checkpoint resumed, or None) nor the run's last /
        previous checkpoint names: a killed or failed save's. Done once, before the run writes anything, so that a
        disk that filled up gets that space back first."""
        if self._checkpoint_names is None:
            self._checkpoint_names = self._named_by_checkpoints()
        if self._checkpoint_names is None:  # cannot tell what a checkpoint names: delete nothing
            return
        keep = set().union(*self._checkpoint_names.values(), _names(manifest))
        if self.directory.is_dir():
            for entry in os.scandir(self.directory):
                if (_FILE.match(entry.name) or entry.name.endswith(".tmp")) and entry.name not in keep:
                    os.unlink(entry.path)

    def restore(self, manifest: Any, loaded_from: str | None = None) -> None:
        """Takes the states a checkpoint names (read lazily); ``loaded_from`` is the checkpoint's path.

        A checkpoint from another directory (``--resume PATH``) has its client files linked or copied here.
        A checkpoint written before this store (every state inside it) is taken into memory.
        """
        self._reset()
        if not (isinstance(manifest, dict) and manifest.get("manifest") == MANIFEST):
            for client_id, state in manifest.items():  # the older format: {client id: state}
                self._keep(client_id, state)
                self._unsaved.add(client_id)
            self._spill()
            return
        source = Path(loaded_from).parent / CLIENTS_DIR if loaded_from else self.directory
        self._files = _versions(manifest)
        for client_id, version in self._files.items():
            name = version.name(client_id)
            # every file checked now, before the resumed run writes a checkpoint: a damaged file found later
            # (when its client is next sampled) would be named by every newer checkpoint, previous.ckpt too
            _verified_bytes(source / name, version.sha256)
            if source.resolve() != self.directory.resolve():
                self._import(source / name)
        self.free_leftovers(manifest)
        self._retire_named_elsewhere()

    def _retire_named_elsewhere(self) -> None:
        """Files the run's last / previous checkpoint names but the resumed one does not: deleted once the saves of
        this run have replaced those checkpoints (the previous one after one save, the last one after two)."""
        named = self._checkpoint_names or {}
        restored = {v.name(c) for c, v in self._files.items()}
        last, previous = named.get("last", set()) - restored, named.get("previous", set()) - restored
        for due, names in ((2, last), (1, previous - last)):
            for name in sorted(names):
                client, writer, number = _FILE.match(name).groups()
                self._retired.append((due, int(client), _Version(int(writer, 16), int(number), b"", -1)))

    def _import(self, path: Path) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        target = self.directory / path.name
        if target.exists():
            return
        try:
            os.link(path, target)
        except OSError:  # another file system, or none with hard links
            shutil.copyfile(path, target)
        self._unsynced = True

    def _named_by_checkpoints(self) -> dict[str, set[str]] | None:
        """The client files the run's last and previous checkpoints name; None when one cannot be read."""
        named: dict[str, set[str]] = {}
        for key, checkpoint in (
            ("last", self.directory.parent / "last.ckpt"),
            ("previous", self.directory.parent / PREVIOUS),
        ):
            if not checkpoint.is_file():
                continue
            try:
                named[key] = _names(load_checkpoint(checkpoint).get("client_states"))
            except ConfigError:
                return None
        return named


def _names(manifest: Any) -> set[str]:
    """The file names a checkpoint's manifest names (none for None or the older format)."""
    if isinstance(manifest, dict) and manifest.get("manifest") == MANIFEST:
        return {v.name(c) for c, v in _versions(manifest).items()}
    return set()


def _verified_bytes(path: Path, sha256: bytes) -> bytes:
    """The content of a client state file a checkpoint names, refused when missing or not the checkpointed one."""
    fallback = f"resume from {path.parent.parent / PREVIOUS} or start a new --output_dir"
    try:
        data = path.read_bytes()
    except OSError:
        raise ConfigError(f"client state file {path}, named by the checkpoint, is missing; {fallback}.") from None
    if hashlib.sha256(data).digest() != sha256:
        raise ConfigError(
            f"client state file {path} is damaged (its content does not match the SHA-256 in the checkpoint); "
            f"{fallback}."
        )
    return data


def _versions(manifest: dict[str, Any]) -> dict[int, _Version]:
    ids, writers, numbers = (manifest[k].tolist() for k in ("ids", "writers", "numbers"))
    digests = manifest["sha256"].numpy()
    return {c: _Version(w, n, digests[i].tobytes(), -1) for i, (c, w, n) in enumerate(zip(ids, writers, numbers))}


def _tensor_bytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def load_client_states(checkpoint: dict[str, Any]) -> dict[int, dict]:
    """Every client's state named by a checkpoint loaded with ``load_checkpoint`` (files verified)."""
    manifest = checkpoint["client_states"]
    if not (isinstance(manifest, dict) and manifest.get("manifest") == MANIFEST):
        return manifest
    store = ClientStateStore(Path(checkpoint["loaded_from"]).parent / CLIENTS_DIR)
    store._files = _versions(manifest)
    return {client_id: store.get(client_id) for client_id in store}
