"""Checkpoint files that cannot run code, are known to be intact and survive a kill at any moment.

- A checkpoint holds tensors and plain containers only (dict, list, tuple, str, int, float, bool, None),
  so it is loaded with ``torch.load(weights_only=True)``: a crafted file cannot run code while it loads.
  Saving anything else is a programming error and raises before the file is written.
- A SHA-256 of the content is stored in the file and checked on load: a damaged file is refused, naming
  the previous good checkpoint.
- The file is written to ``last.ckpt.tmp``, fsynced and renamed over ``last.ckpt``
  (:func:`fl_lightning.federation.files.replacing`: SIGTERM or Ctrl-C during the write take effect once it is
  done, and a failed write names ``last.ckpt``); the checkpoint it replaces is kept as ``previous.ckpt`` (a hard
  link, so ``last.ckpt`` exists at every moment), provided it is known to be intact: written or verified by this
  process, or verified before it is kept.
- Per-client state is not inside the file: it holds a manifest of the client-state files next to it
  (``client_store.py``), each named once, written and fsynced before the checkpoint that names it.
"""

from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..federation.errors import ConfigError
from ..federation.files import replacing

FORMAT = 2  # 1: pickled with weights_only=False and no checksum (before this module checked both)
PREVIOUS = "previous.ckpt"
_PLAIN = (str, bytes, int, float, bool, type(None), torch.dtype, torch.device)
_known_good: set[tuple[int, ...]] = set()  # identities of the checkpoint files written or verified here


def tensors_by_path(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a loaded checkpoint (or part of one) by its path, ``/strategy/global_weights/...``,
    less the ids of the processes that wrote client states (new in every run): two runs that computed
    the same numbers give equal dictionaries."""
    if prefix.endswith("/writers"):
        return {}
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    if isinstance(tree, dict):
        return {k: v for key, value in tree.items() for k, v in tensors_by_path(value, f"{prefix}/{key}").items()}
    if isinstance(tree, (list, tuple)):
        return {k: v for i, value in enumerate(tree) for k, v in tensors_by_path(value, f"{prefix}/{i}").items()}
    return {}


def check_shapes(checkpoint: dict[str, Any], key: str, current: Any) -> None:
    """Refuses a checkpoint whose tensors under ``checkpoint[key]`` have another shape than the ones this run set up
    (``current``, the same tree): a checkpoint of other models, or one edited and sealed again. A set-up tensor
    that is empty is a placeholder that the checkpoint fills, whatever its shape."""
    saved = tensors_by_path(checkpoint.get(key), f"/{key}")
    for path, tensor in tensors_by_path(current, f"/{key}").items():
        other = saved.get(path)
        if other is None or tensor.numel() == 0 or other.shape == tensor.shape:
            continue
        raise ConfigError(
            f"checkpoint {checkpoint.get('loaded_from', '')} holds {path.lstrip('/')} of shape {list(other.shape)}, "
            f"but this run sets it up with shape {list(tensor.shape)}: it was written for other models or options; "
            "resume with the recipe it was written with, or start a new --output_dir."
        )


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Writes ``state`` (tensors and plain containers) with its checksum; keeps the old file as previous.ckpt."""
    content = {**state, "format": FORMAT}
    digest = content_sha256(content)
    with replacing(path) as f:  # a full disk, SIGTERM or Ctrl-C meanwhile: last.ckpt stays the previous one
        torch.save({**content, "sha256": digest}, f)
        if path.exists():
            _keep_previous(path)
    _known_good.add(_identity(path))


def _identity(path: Path) -> tuple[int, ...]:
    """Device, inode, size and modification time: a file changed on disk since is verified again."""
    stat = path.stat()
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


def _keep_previous(path: Path) -> None:
    """Keeps ``path`` as previous.ckpt, unless it is damaged (then the older previous.ckpt stays)."""
    if _identity(path) not in _known_good:
        try:
            load_checkpoint(path)
        except ConfigError:
            return
    previous, tmp = path.with_name(PREVIOUS), path.with_name(PREVIOUS + ".tmp")
    tmp.unlink(missing_ok=True)  # left by a run killed here
    try:
        os.link(path, tmp)
    except OSError:  # a file system without hard links
        shutil.copyfile(path, tmp)
    os.replace(tmp, previous)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Loads a checkpoint written by :func:`save_checkpoint`, or raises ConfigError saying why not."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"checkpoint {path} does not exist; pass --resume auto to resume from the run's output_dir "
            "or the path of an existing .ckpt file."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 (pickle, zip and storage errors of any type all mean: not loadable)
        blocked = re.search(r"GLOBAL ([\w.]+)", str(err))
        if blocked:
            raise ConfigError(
                f"checkpoint {path} refers to {blocked.group(1)}, which is neither a tensor nor plain data and "
                "could run code when loaded, so it is not loaded; resume only from checkpoints written by flrun fit."
            ) from None
        raise ConfigError(
            f"checkpoint {path} cannot be read, it is damaged or not a checkpoint; {_fallback(path)}"
        ) from None
    if not isinstance(state, dict) or "sha256" not in state or state.get("format") != FORMAT:
        raise ConfigError(
            f"checkpoint {path} carries no checksum of format {FORMAT}: it was written by an older fl_lightning "
            "or by something else; start a new --output_dir."
        )
    saved = state.pop("sha256")
    if content_sha256(state) != saved:
        raise ConfigError(f"checkpoint {path} is damaged (its content does not match its SHA-256); {_fallback(path)}")
    _known_good.add(_identity(path))
    state["loaded_from"] = str(path)  # not saved: where its client-state files are (client_store.py)
    return state


def _fallback(path: Path) -> str:
    previous = path.with_name(PREVIOUS)
    if previous.is_file() and previous != path:
        return f"resume from the previous good checkpoint with --resume {previous}."
    return "resume from an earlier copy of the run or start a new --output_dir."


def content_sha256(state: Any) -> str:
    """SHA-256 of a nest of tensors and plain containers, the same before saving and after loading."""
    digest = hashlib.sha256()
    _feed(state, digest, "state")
    return digest.hexdigest()


def check_plain(state: Any, where: str = "state") -> None:
    """Raises TypeError, naming where, unless ``state`` is tensors and plain containers (what loads safely)."""
    _feed(state, None, where)


def _feed(obj: Any, digest: Any, where: str) -> None:
    # exact types: a numpy float is a float subclass, but weights_only loading refuses it; digest None: check only
    kind = type(obj)
    if kind in (dict, OrderedDict):
        if digest is not None:
            digest.update(b"{%d" % len(obj))
        for key, value in obj.items():
            _feed(key, digest, where)
            _feed(value, digest, f"{where}[{key!r}]")
    elif kind in (list, tuple, torch.Size):
        if digest is not None:
            digest.update(b"[%d" % len(obj) if kind is list else b"(%d" % len(obj))
        for i, value in enumerate(obj):
            _feed(value, digest, f"{where}[{i}]")
    elif isinstance(obj, torch.Tensor) and kind in (torch.Tensor, torch.nn.Parameter):
        if digest is not None:
            data = obj.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
            digest.update(f"T{data.dtype}{tuple(obj.shape)}".encode())
            digest.update(data.view(torch.uint8).numpy().tobytes())
    elif kind in _PLAIN:
        if digest is not None:
            digest.update(f"{kind.__name__}:{obj!r};".encode())
    else:
        raise TypeError(
            f"checkpoint state {where} is a {kind.__module__}.{kind.__qualname__}; checkpoints hold tensors and "
            "plain containers only (they load with weights_only=True), so convert it (e.g. to its state_dict)."
        )


def rng_state() -> dict[str, Any]:
    """The global generators' states as plain data (numpy's key array becomes a list of ints)."""
    numpy_state = np.random.get_state(legacy=False)
    return {
        "python": random.getstate(),
        "numpy": {
            "key": numpy_state["state"]["key"].tolist(),
            "pos": int(numpy_state["state"]["pos"]),
            "has_gauss": int(numpy_state["has_gauss"]),
            "gauss": float(numpy_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    numpy_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": np.array(numpy_state["key"], dtype=np.uint32), "pos": numpy_state["pos"]},
            "has_gauss": numpy_state["has_gauss"],
            "gauss": numpy_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch"])
