"""Where a run may write, and which checkpoint it may resume there: nothing a user saved is overwritten.

A run writes only into a new or empty directory, or one that holds its own run: ``run.json``, the marker the run
writes first, names the run's id, and every checkpoint carries that id. So:

- a fresh start refuses a folder that holds anything else (a user's folder, ``$HOME``, a Lightning log folder);
- ``--resume PATH`` into a directory holding a run takes only a checkpoint of that run (the same id): another
  run's checkpoint would replace its ``last.ckpt``, metrics and summary; into a new or empty directory it
  continues a copy of the run there;
- a directory written before markers existed (``checkpoints/last.ckpt`` and no marker) counts as a run whose
  own checkpoints are those inside it;
- a file the run writes that is a directory (or a FIFO) is refused before anything is loaded.

Everything here reads; nothing is created, so a refused start leaves the file system as it was.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

from ..federation.errors import ConfigError
from ..federation.files import check_folder_name
from ..tracking.run_files import LOCK, MARKER, RunFiles, marker_id
from .checkpoint import load_checkpoint

# the files a run writes (each must be a regular file where it exists) and its folders
RUN_FILES = (MARKER, LOCK, "config.yaml", "metrics.csv", "summary.json", "partition.json", "partition.png")
CHECKPOINT_FILES = ("last.ckpt", "previous.ckpt")


def run_root(output_dir: str | Path | None, name: str | None, seed: int) -> Path:
    """The run's folder: ``output_dir``, else ``runs/<name>/seed<seed>``, where the name must be one folder's (a
    name such as ``../../x`` would put the run outside ``runs/``)."""
    if output_dir:
        return Path(output_dir)
    if name is not None:
        check_folder_name(name, "--name", f"runs/<name>/seed{seed}", "--name my_run")
    return Path("runs") / (name or "run") / f"seed{seed}"


def check_output_dir(root: Path) -> None:
    """Refuses a run directory that could never be written, or that is not this run's to write, before anything
    is loaded or trained."""
    where = f"--output_dir {_short(root)}"
    longest = max((len(part.encode()) for part in root.parts), default=0)
    if longest > 255 or len(str(root).encode()) > 3800:  # NAME_MAX and (under) PATH_MAX of common file systems
        raise ConfigError(f"{where}: the path or one of its names is too long; choose a shorter output_dir.")
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"{where}: {existing} is a file, not a directory; choose another output_dir or move the file away."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {existing} is not writable; choose an output_dir you can write to.")
    if (root / "sweep.json").is_file():  # a run's files would be mixed into the sweep's results
        raise ConfigError(f"{where} holds a sweep (sweep.json); give the run a directory of its own.")
    if root.is_dir():
        _check_owned(root, where)
        _check_kinds(root, where)


def _short(root: Path) -> str:
    return f"{str(root)[:80]}{'...' if len(str(root)) > 80 else ''}"


def holds_unmarked_run(root: Path) -> bool:
    """Whether ``root`` holds checkpoints of a run written before run directories had a marker (flrun's own: a
    Lightning folder's ``checkpoints/last.ckpt`` is not one)."""
    if marker_id(root) is not None:
        return False
    for name in CHECKPOINT_FILES:
        path = root / "checkpoints" / name
        if path.is_file():
            try:
                load_checkpoint(path)
                return True
            except ConfigError:  # damaged, or not flrun's: the other one may still be
                continue
    return False


def _check_owned(root: Path, where: str) -> None:
    if marker_id(root) is not None or holds_unmarked_run(root):
        return
    others = sorted(entry.name for entry in os.scandir(root) if entry.name != LOCK)  # run.lock: a refused start's
    if others:
        shown = ", ".join(others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
        raise ConfigError(
            f"{where} is a folder that holds no flrun run ({shown}); a run writes only into a new or empty folder "
            f"or its own run's ({MARKER}), so choose another --output_dir, e.g. {_short(root / 'run')}."
        )


def _check_kinds(root: Path, where: str) -> None:
    expected = [(root / name, False) for name in RUN_FILES] + [(root / "checkpoints", True)]
    expected += [(root / "checkpoints" / name, False) for name in CHECKPOINT_FILES]
    expected.append((root / "checkpoints" / "clients", True))
    for path, folder in expected:
        if not os.path.lexists(path) or (path.is_dir() if folder else path.is_file()):
            continue
        found = "a directory" if path.is_dir() else "not a regular file" if path.exists() else "a broken link"
        wanted = "a folder" if folder else "a file"
        raise ConfigError(
            f"{where}: {path.relative_to(root)} is {found} where the run keeps {wanted}; move it away or choose "
            "another --output_dir."
        )


def run_id(files: RunFiles, checkpoint: dict[str, Any] | None) -> str:
    """The id of the run in ``files.root``: its marker's; for a directory that lost its marker, that of the
    checkpoint it resumes from inside it; else a new one (a new run, or a copy resumed elsewhere)."""
    saved = (checkpoint or {}).get("run_info", {}).get("run_id")
    return (
        files.run_id()
        or (saved if saved and checkpoint and _written_in(checkpoint, files) else None)
        or uuid.uuid4().hex
    )


def _written_in(checkpoint: dict[str, Any], files: RunFiles) -> bool:
    return Path(checkpoint["loaded_from"]).resolve().parent.parent == files.root.resolve()


RESULTS = ("metrics.csv", "summary.json")  # what a fresh start would replace


def check_no_results(files: RunFiles, resume: str | None) -> None:
    """Refuses a fresh start (``--resume auto`` without a checkpoint to continue included) into a run directory
    that holds a run's results but no checkpoint (deleted to save space, or never written): the new run would
    replace its metrics.csv and summary.json."""
    found = [name for name in RESULTS if (files.root / name).is_file()]
    if not found:
        return
    started = "--resume auto finds no checkpoint there, so it would start a new run" if resume else "a new run"
    raise ConfigError(
        f"--output_dir {_short(files.root)} holds a run's results ({', '.join(found)}) but no checkpoints/last.ckpt "
        f"to continue from; {started} that replaces them. Choose another --output_dir, resume it from a copy of "
        "its checkpoint with --resume PATH, or move those files away to start over there."
    )


def check_resume_target(checkpoint: dict[str, Any], resume: str | None, files: RunFiles) -> None:
    """Refuses a checkpoint of another run: ``--resume auto`` whose ``last.ckpt`` was replaced by another run's,
    and ``--resume PATH`` into a directory that holds another run (its files would be replaced)."""
    own = files.run_id()
    if resume is None:
        return
    if resume == "auto":  # the directory's own last.ckpt, unless another run's was copied over it
        saved = checkpoint.get("run_info", {}).get("run_id")
        if own is not None and saved is not None and saved != own:
            raise ConfigError(
                f"--resume auto: {_short(files.last_checkpoint)} is another run's checkpoint (run id {saved[:12]}), "
                f"not that of the run in {_short(files.root)} (run id {own[:12]}, in {MARKER}); put this run's "
                "own last.ckpt back, or resume the other run in a folder of its own with --resume PATH "
                "--output_dir NEW."
            )
        return
    if own is None and not holds_unmarked_run(files.root):
        return  # a new or empty directory: a copy of the run continues there
    saved = checkpoint.get("run_info", {}).get("run_id")
    if own is not None and saved == own:
        return
    if own is None and _written_in(checkpoint, files):  # a run that lost its marker, or predates markers
        return
    if saved is None and _written_in(checkpoint, files):  # written here before the directory had a marker
        return
    raise ConfigError(
        f"--output_dir {_short(files.root)} holds another run than the one --resume {resume} continues; resuming "
        "there would replace that run's checkpoints, metrics and summary, so give the resumed copy a new "
        "--output_dir (or resume that run with --resume auto)."
    )


def check_still_ours(files: RunFiles, run_id_: str, fresh: bool) -> None:
    """At the first write: refuses a directory that another process made a run of while this one set up."""
    other = files.run_id() not in (None, run_id_)
    if other or (fresh and (files.last_checkpoint.exists() or files.previous_checkpoint.exists())):
        raise ConfigError(
            f"{files.root} received another process's run while this one started; pass --resume auto to "
            "continue it or choose another --output_dir."
        )


def free_leftovers(files: RunFiles) -> None:
    """Deletes the ``.tmp`` files a killed write of this run left (never named by anything), before the run writes
    again: on a disk that is still full, the space comes back first. Client-state files are the store's."""
    names = [files.root / f"{name}.tmp" for name in RUN_FILES]
    names += [files.checkpoints / f"{name}.tmp" for name in CHECKPOINT_FILES]
    for path in names:
        if path.is_file() and not path.is_symlink():
            path.unlink()
