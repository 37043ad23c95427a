"""Files written for a user: replaced whole or not at all, and every failure naming the file.

Every file the project writes for a user (a run's files and checkpoints, reports, charts, tables, a sweep's
results) goes through :func:`atomic_write` or :func:`replacing`: the content goes to ``<name>.tmp`` in the same
folder, is flushed to disk (fsync) and renamed over the old file, and the folder is fsynced. So the old file stays
whole until the new one is, at every moment: a full disk, a kill or a power cut leaves the old file or the new
one, never a part of one. A write that fails (a full disk, a quota, a read-only folder) removes its ``.tmp`` file
and raises an OSError naming the file the user knows (not its ``.tmp``). SIGINT (Ctrl-C) and SIGTERM that arrive
during a write take effect as soon as it is done, so they end a command as they would between two writes.

Example::

    atomic_write(Path("report.html"), page)
    with replacing(Path("chart.png")) as f:  # writers that want a file object
        fig.savefig(f, format="png")

:func:`lock_file` makes processes take turns at one thing (a download, the tables of a new SQLite database) and
leaves no lock file behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import signal
import stat
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

from .errors import ConfigError

TMP_SUFFIX = ".tmp"


def check_folder_name(name: object, option: str, becomes: str, example: str) -> None:
    """Refuses a name that becomes one folder (``--name`` in ``runs/<name>/seed0``, a sweep's ``--study_name`` in
    ``runs/sweeps/<name>``) unless it is a single folder name: not empty, not ``.`` or ``..``, without ``/``,
    ``\\`` or a NUL byte, so that the folder stays where it belongs.

    Example: ``check_folder_name("../x", "--name", "runs/<name>/seed0", "--name my_run")`` raises ConfigError.
    """
    text = str(name)
    if not text.strip():
        why = "is empty"
    elif text in (".", ".."):
        why = "names the current or the parent folder"
    elif "/" in text:
        why = "holds a '/'"
    elif "\\" in text or "\0" in text:
        why = "holds a backslash or a NUL byte"
    else:
        return
    raise ConfigError(
        f"{option} {text[:80]!r} {why}, but it becomes the folder {becomes}, so it must be a single folder name "
        f"(no '/', not '..' or empty); give e.g. {example}, or choose the folder itself with --output_dir."
    )


def path_problem(path: str | os.PathLike) -> str | None:
    """Why the file ``path`` cannot be read as a file, in words that follow its name (``does not exist``, ``is a
    directory``, ``is not a regular file (a named pipe, FIFO)``, ``is a symbolic link that leads back to itself``,
    ``is a symbolic link to nothing``, ``cannot be read (Permission denied)``); None for a readable regular file.
    Nothing is opened: a FIFO would block the reader.

    Example: ``f"{name} {path_problem(p)}; give a recipe"`` when ``path_problem(p)`` is not None.
    """
    try:
        info = os.stat(path)  # follows links: a loop or a dangling link ends here
    except ValueError:  # a NUL byte in the name
        return "is not a valid file name"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return "is a symbolic link that leads back to itself"
        if err.errno in (errno.ENOENT, errno.ENOTDIR):
            return "is a symbolic link to nothing" if os.path.islink(path) else "does not exist"
        return f"cannot be read ({err.strerror})"
    if stat.S_ISDIR(info.st_mode):
        return "is a directory"
    if not stat.S_ISREG(info.st_mode):  # a FIFO or a device would block or never end
        kind = (
            "a named pipe, FIFO"
            if stat.S_ISFIFO(info.st_mode)
            else "a socket"
            if stat.S_ISSOCK(info.st_mode)
            else "a device"
        )
        return f"is not a regular file ({kind})"
    if not os.access(path, os.R_OK):
        return "cannot be read (Permission denied)"
    return None


def not_utf8(data: bytes) -> str | None:
    """Why ``data`` is not text, in words that follow the file's name (``is not a text file: byte 0xff at offset 12
    is not UTF-8``), or None for UTF-8 text (a byte-order mark allowed) without NUL bytes."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        return f"is not a text file: byte 0x{data[err.start]:02x} at offset {err.start} is not UTF-8"
    if "\x00" in text:
        return f"is not a text file: it holds a NUL byte (at offset {data.index(0)})"
    return None


def temporary_path(path: Path) -> Path:
    """Where the new content of ``path`` is written before it replaces ``path``."""
    return path.with_name(path.name + TMP_SUFFIX)


def atomic_write(path: str | os.PathLike, content: bytes | str) -> None:
    """Replaces ``path`` atomically and durably with ``content`` (text is written as UTF-8)."""
    data = content.encode() if isinstance(content, str) else content
    with replacing(path) as f:
        f.write(data)


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[IO[bytes]]:
    """A binary file whose content replaces ``path`` when the block ends without an error.

    The folder is created when missing. An error inside the block (or while writing) leaves ``path`` as it was
    and no ``.tmp`` file behind; an OSError is raised again naming ``path``.
    """
    path = Path(path)
    tmp = temporary_path(path)
    with signals_held():
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException as err:
            _remove(tmp, err)
            renamed = named(err, path)
            if renamed is err:
                raise
            raise renamed from None
        fsync_directory(path.parent)


def write_synced(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    """Writes a new file ``path`` with ``write(file)`` and fsyncs it (no rename: for files named once, such as a
    client's state file). A write that fails removes what it wrote and raises an OSError naming ``path``."""
    with signals_held():
        try:
            with open(path, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException as err:
            _remove(path, err)
            renamed = named(err, path)
            if renamed is err:
                raise
            raise renamed from None


def _remove(partial: Path, err: BaseException) -> None:
    """Removes what a failed write left, unless the failure was that ``partial`` is a file this process may not
    open (someone else's)."""
    if not isinstance(err, PermissionError):
        with contextlib.suppress(OSError):
            os.unlink(partial)


def named(err: BaseException, path: Path) -> BaseException:
    """``err`` as an OSError naming ``path`` when the file system caused it, also when a writer (torch.save)
    wrapped the failed write in a RuntimeError; any other error unchanged."""
    cause: BaseException | None = err
    while cause is not None and not isinstance(cause, OSError):
        if not isinstance(cause, RuntimeError):
            return err
        cause = cause.__cause__ or cause.__context__
    if cause is None or cause.errno is None:
        return err
    return OSError(cause.errno, cause.strerror, str(path))


def fsync_directory(path: Path) -> None:
    """Makes the renames inside ``path`` durable (POSIX; other systems cannot open a directory)."""
    if os.name != "posix":
        return
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """SIGINT and SIGTERM that arrive inside the block are handled when it ends, by the handlers that were in
    place: a stop never cuts a file in two (torch.save interrupted mid-file raises ``RuntimeError: ...
    unexpected pos`` instead of the stop). Only the main thread runs Python's signal handlers, so elsewhere this
    changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []
    previous: dict[int, Any] = {}
    for number in _HELD:
        handler = signal.getsignal(number)
        if handler is None:  # installed outside Python: left alone
            continue
        previous[number] = signal.signal(number, lambda signum, frame: arrived.append(signum))
    try:
        yield
    finally:
        for held, handler in previous.items():
            signal.signal(held, handler)
        for signum in dict.fromkeys(arrived):
            _deliver(signum, previous[signum])


def _deliver(number: int, handler: Any) -> None:
    """What the signal would have done had it not been held."""
    if handler == signal.SIG_IGN:
        return
    if handler == signal.SIG_DFL:
        signal.raise_signal(number)  # the default action: the process ends by the signal
        return
    handler(number, None)


@contextlib.contextmanager
def lock_file(path: Path):
    """Holds an exclusive lock on ``path`` and removes the file when done (succeeded or failed), so that no
    ``.lock`` file stays behind. A process that waited on a file its holder removed locks a file nobody else
    sees: it notices (the path no longer names what it holds) and locks the current one instead."""
    while True:
        lock = path.open("ab")
        flock_if_supported(lock)
        try:
            if os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        lock.close()
    try:
        yield lock
    finally:
        path.unlink(missing_ok=True)  # while still held: the next process then opens a new file
        lock.close()


def flock_if_supported(lock) -> None:
    """Waits for the exclusive lock on ``lock``; on a file system without flock, goes on without it."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
    except OSError as err:
        if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise
