"""Getting a benchmark's files (listed in :mod:`fl_lightning.data.catalog`): whether they are present, the
one-sentence message when they are missing or damaged, and fetching them. ``flrun data fetch <name>``, the
loaders' ``download: true`` and pretrained builders' ``fetch_weights`` all go through :func:`fetch`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import pickle
import shutil
import stat
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..federation.errors import ConfigError
from ..federation.files import atomic_write, lock_file
from .catalog import HubFiles, Source, source
from .download import NetworkError, download, hub_commit, hub_download, hub_files, safe_extract

log = logging.getLogger(__name__)


def present(src: Source, data_dir: Path) -> bool:
    """Whether every expected file (or at least one match of each pattern) is under ``data_dir``."""
    # a link to nothing counts (glob skips it), so that its reader names it instead of calling the file missing
    return all(
        any(Path(data_dir).glob(pattern)) or os.path.lexists(Path(data_dir) / pattern) for pattern in src.expected
    )


def fetch_command(name: str, data_dir: Path | str) -> str:
    return f"`flrun data fetch {source(name).name} --data_dir {data_dir}`"


def missing(name: str, data_dir: Path | str, failure: BaseException | None = None, hint: str = "") -> ConfigError:
    """The one sentence for absent files: what is expected where, where it comes from, the fetch command.

    Args:
        failure: the download error when a download was tried (``download: true``).
        hint: a data-set-specific addition, e.g. "or set download: true".
    """
    src, data_dir = source(name), Path(data_dir)
    why = " and could not be downloaded" if failure is not None else ""
    if isinstance(failure, NetworkError):
        why += f" ({failure.reason})"
    elif failure is not None:
        why += f" ({failure})"
    return ConfigError(
        f"{src.title} not found{why}: expected {data_dir / src.layout} (from {src.origin}); run "
        f"{fetch_command(name, data_dir)} on a machine with internet to download and verify them and copy "
        f"{data_dir} to this machine{hint}."
    )


# What a damaged, cut-short or foreign file raises in the readers: pickle, json, gzip (BadGzipFile is an OSError),
# PIL (UnidentifiedImageError), h5py (OSError "file signature not found", KeyError for a missing group), soundfile
# (LibsndfileError, a RuntimeError), pyarrow (ArrowInvalid, a ValueError) and numpy's reshapes (ValueError).
MALFORMED = (pickle.UnpicklingError, EOFError, ValueError, KeyError, IndexError, TypeError, OSError, RuntimeError)


def _fix(name: str | None, data_dir: Path | str) -> str:
    if name is None:
        return "check the file or give another one"
    return (
        f"replace it with the published archive's file, e.g. by deleting it and running {fetch_command(name, data_dir)}"
    )


def damaged(path: Path | str, what: str, err: BaseException, name: str | None, data_dir: Path | str) -> ConfigError:
    """The one sentence for a file that is there but cannot be read as ``what`` (with its article: "a CIFAR
    batch file"): the file, why, the fix.

    Args:
        name: the data set whose ``flrun data fetch`` restores the file; ``None`` for a file the user gave.
    """
    if isinstance(err, PermissionError):
        return ConfigError(f"{path} cannot be read ({err.strerror}); check its permissions.")
    key = err.args[0] if isinstance(err, KeyError) and err.args else None
    if isinstance(err, KeyError) and not (isinstance(key, str) and " " in key):  # a dict's missing key
        reason = f"it has no {key!r}" if key is not None else "an entry is missing"
    elif isinstance(err, EOFError):  # pickle's "Ran out of input", gzip's "Compressed file ended before ..."
        reason = "it is empty or cut short"
    else:  # h5py's KeyError carries a sentence, as the other errors do: its first line
        lines = (key if isinstance(key, str) else str(err)).strip().splitlines()
        reason = (lines[0] if lines else type(err).__name__).rstrip(".")[:200]
    return ConfigError(f"{path} is not {what} ({reason}); {_fix(name, data_dir)}.")


KINDS = {  # what stat says a path is, when it is not a regular file
    stat.S_ISDIR: "a directory",
    stat.S_ISCHR: "a character device",
    stat.S_ISBLK: "a block device",
    stat.S_ISFIFO: "a named pipe (FIFO)",
    stat.S_ISSOCK: "a socket",
}


def require_regular_file(path: Path | str, what: str, name: str | None, data_dir: Path | str) -> None:
    """Refuses, before a byte is read, a data file that is a directory, a device (a link to ``/dev/zero`` would
    be read forever), a pipe or a link to nothing, in one sentence naming it; a missing file is left to the
    reader (and its message)."""
    path = Path(path)
    link = f", a symbolic link to {os.readlink(path)}" if path.is_symlink() else ""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        if link:
            raise ConfigError(
                f"{path} is not {what} ({link[2:]}, which does not exist); {_fix(name, data_dir)}."
            ) from None
        return
    except OSError as err:  # a loop of links, a name too long: the reader would fail the same way
        raise ConfigError(f"{path} cannot be read ({err.strerror}); {_fix(name, data_dir)}.") from None
    if stat.S_ISREG(mode):
        return
    kind = next((kind for test, kind in KINDS.items() if test(mode)), "neither a file nor a folder")
    raise ConfigError(f"{path} is {link[2:] + ', ' if link else ''}{kind}, not {what}; {_fix(name, data_dir)}.")


@contextmanager
def reading(path: Path | str, what: str, name: str | None, data_dir: Path | str) -> Iterator[None]:
    """Turns any error a malformed ``path`` raises while it is read into :func:`damaged`'s sentence; a path
    that is not a regular file is refused before it is opened (:func:`require_regular_file`)."""
    require_regular_file(path, what, name, data_dir)
    try:
        yield
    except ConfigError:
        raise
    except MALFORMED as err:
        raise damaged(path, what, err, name, data_dir) from None
    except Exception as err:
        image = sys.modules.get("PIL.Image")  # imported by the readers of images; not here, to start fast
        if image is not None and isinstance(err, image.DecompressionBombError):  # a PNG claiming 40000x40000
            raise damaged(path, what, err, name, data_dir) from None
        raise


def ensure(name: str, data_dir: Path | str, download: bool, revision: str | None = None) -> None:
    """A loader's check: files present (at ``revision`` for Hub sets, when given), else fetched with
    ``download``, else one sentence naming them and ``flrun data fetch``."""
    src, data_dir = source(name), Path(data_dir)
    if present(src, data_dir):
        _check_revision(src, data_dir, revision)
        return
    if not download:
        raise missing(name, data_dir, hint=", or set download: true")
    try:
        fetch(name, data_dir, revision)
    except NetworkError as err:
        raise missing(name, data_dir, failure=err) from None


def _check_revision(src: Source, data_dir: Path, revision: str | None) -> None:
    record = data_dir / src.hub.folder / "REVISION" if src.hub else None
    if revision is None or record is None or not record.is_file():
        return
    names = record.read_text().split()[1:]  # the branch or tag fetched, if one was, then its commit
    fetched = names[-1] if names else ""
    if revision not in names:
        raise ConfigError(
            f"{src.title} in {record.parent} is commit {fetched}, not the requested {revision}; delete the folder "
            f"and run `flrun data fetch {src.name} --data_dir {data_dir} --revision {revision}`."
        )


def fetch_pretrained(name: str, data_dir: Path | str) -> None:
    """Downloads and verifies the pretrained weights ``name`` (a model builder's ``fetch_weights``), or raises
    the one sentence saying where they go (offline, or with ``HF_HUB_OFFLINE=1`` set: no download is tried)."""
    if os.environ.get("HF_HUB_OFFLINE") == "1":
        raise missing(name, data_dir)
    try:
        fetch(name, data_dir)
    except NetworkError as err:
        raise missing(name, data_dir, failure=err) from None


def fetch(name: str, data_dir: Path | str = "data", revision: str | None = None, force: bool = False) -> list[Path]:
    """Downloads, verifies and unpacks a data set into ``data_dir``; returns the expected paths found.

    Files already present are kept (``force`` downloads again). Archives are deleted once unpacked.

    Raises:
        NetworkError: no connection; ConfigError: a checksum mismatch or an unsafe archive.
    """
    src, data_dir = source(name), Path(data_dir)
    if force or not present(src, data_dir):
        new = _new_folders(_folders_written(src, data_dir))
        data_dir.mkdir(parents=True, exist_ok=True)
        try:
            # runs started together (flrun table / sweep --n_jobs) fetch a data set once: the others wait for it
            with lock_file(data_dir / f".{src.name}.fetch.lock"):
                if force or not present(src, data_dir):
                    _fetch_files(src, data_dir, revision)
        except BaseException:  # a failed fetch leaves no folder of its own making that holds nothing
            for folder in new:
                with contextlib.suppress(OSError):
                    folder.rmdir()
            raise
    if not present(src, data_dir):
        raise ConfigError(
            f"{src.title}: the download finished but {data_dir / src.layout} is still incomplete; delete the "
            f"partial files and run {fetch_command(name, data_dir)} again."
        )
    return sorted(p for pattern in src.expected for p in data_dir.glob(pattern))


def _folders_written(src: Source, data_dir: Path) -> list[Path]:
    """The folders a fetch of ``src`` writes into (``data_dir``, downloads' and archives' folders, the Hub's)."""
    folders = [data_dir] + [(data_dir / remote.name).parent for remote in src.remotes]
    folders += [data_dir / remote.extract_to for remote in src.remotes if remote.extract_to is not None]
    if src.hub is not None:
        folders += [data_dir / ".fetch" / src.hub.folder, data_dir / src.hub.folder]
    return folders


def _new_folders(folders: list[Path]) -> list[Path]:
    """Of ``folders`` and their parents, those that do not exist yet, deepest first."""
    new: set[Path] = set()
    for folder in folders:
        for path in [folder, *folder.parents]:
            if path.exists():
                break
            new.add(path)
    return sorted(new, key=lambda path: len(path.parts), reverse=True)


def _fetch_files(src: Source, data_dir: Path, revision: str | None) -> None:
    for remote in src.remotes:
        target = data_dir / remote.name
        download(remote.url, target, sha256=remote.sha256, md5=remote.md5, git_sha1=remote.git_sha1)
        if remote.extract_to is not None:
            log.info("unpacking %s into %s", target.name, data_dir / remote.extract_to)
            safe_extract(target, data_dir / remote.extract_to)
            target.unlink()
    if src.hub is not None:
        _fetch_hub(src.hub, data_dir, revision)


def _fetch_hub(hub: HubFiles, data_dir: Path, revision: str | None) -> None:
    folder = data_dir / hub.folder
    asked = revision or hub.revision
    commit = hub_commit(hub.repo_id, asked or "main")  # every file is then fetched at this one commit
    if asked is None:
        log.warning(
            "%s has no pinned commit here (none could be found in public code); fetching its current commit %s, "
            "recorded in %s.",
            hub.repo_id,
            commit,
            folder / "REVISION",
        )
    entries = [
        e for e in hub_files(hub.repo_id, commit, hub.listing) if any(fnmatch.fnmatch(e.path, p) for p in hub.patterns)
    ]
    if not entries:
        raise ConfigError(f"{hub.repo_id} at {commit} has no files matching {', '.join(hub.patterns)}.")
    staging = data_dir / ".fetch" / hub.folder
    for entry in entries:
        hub_download(hub.repo_id, commit, entry, staging / Path(entry.path).name)
    folder.mkdir(parents=True, exist_ok=True)
    for entry in entries:  # only the verified files reach the folder the loader reads (not download's locks)
        name = Path(entry.path).name
        shutil.move(str(staging / name), folder / name)
    shutil.rmtree(data_dir / ".fetch", ignore_errors=True)
    # the commit last (what _check_revision reads), after the branch or tag asked for, if one was
    named = [asked] if asked is not None and asked != commit else []
    atomic_write(folder / "REVISION", " ".join([hub.repo_id, *named, commit]) + "\n")
