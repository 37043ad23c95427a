"""How ``flrun`` ends when something outside the input stops it: the file system saying no (a full disk, a read-only
folder, a directory where a file goes) and SIGTERM, each as one line and an exit status, never a traceback."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading

# what a command that the file system stopped leaves
AFTER_OS_ERROR = {
    "fit": ", then run the same command with --resume auto: it continues from the last checkpoint written, "
    "which is intact.",
    "sweep": ", then run the same command again to finish the study.",
    "table": ", then run the same command again to resume the runs.",
    "report": ".",
    "data": ".",
}


def error_status(command: str, err: Exception) -> int:
    """Prints the one line of an error the user can fix (their input, the file system) and returns the exit
    status: 2, or 3 when the user's own code raised (the line, then that code's frames); re-raises any other
    error (a bug shows its traceback)."""
    from ..federation.errors import ConfigError, RankLost
    from ..federation.user_code import USER_CODE_STATUS, UserCodeError, user_code_report
    from ..run.arguments import UserError

    if isinstance(err, RankLost):
        from ..distributed.launch import LAUNCHED_ENV, LOST_STATUS

        if os.environ.get(LAUNCHED_ENV):
            return LOST_STATUS  # the launcher names the rank that ended, and how
    if isinstance(err, UserCodeError):
        print(user_code_report(f"flrun {command}: error: ", err), end="", file=sys.stderr)
        return USER_CODE_STATUS
    if isinstance(err, (UserError, ConfigError)):
        print(f"flrun {command}: error: {clipped(str(err))}", file=sys.stderr)
        return 2
    if isinstance(err, BrokenPipeError):  # the reader of the output went away (`flrun models | head -1`)
        return _quietly_closed_pipe()
    if isinstance(err, OutputFailed):  # `> /dev/full`: not the run's files, which stand as they were
        return output_failed_status(command, err)
    sentence = file_system_cause(err)
    if sentence is None:
        raise err
    print(f"flrun {command}: error: {sentence}{AFTER_OS_ERROR.get(command, '')}", file=sys.stderr)
    return 2


class OutputFailed(OSError):
    """A write to the command's own output (stdout or stderr) that the system refused (``> /dev/full``, a full disk
    under a redirect): the command's work is done or stands as it was, so no advice to resume comes with it."""


class _GuardedStream:
    """The command's stdout or stderr: characters its encoding cannot show are written escaped (``\\xe9``) instead
    of ending the command, and a refused write raises :class:`OutputFailed` naming the stream."""

    def __init__(self, stream, name: str):
        self._stream, self._name = stream, name
        with contextlib.suppress(AttributeError, ValueError, OSError):
            stream.reconfigure(errors="backslashreplace")

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except UnicodeEncodeError:  # a stream that cannot be reconfigured (a test's capture)
            encoding = getattr(self._stream, "encoding", None) or "ascii"
            return self._stream.write(text.encode(encoding, "backslashreplace").decode(encoding))
        except BrokenPipeError:
            raise
        except OSError as err:
            raise OutputFailed(err.errno, err.strerror, self._name) from None

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            raise
        except OSError as err:
            raise OutputFailed(err.errno, err.strerror, self._name) from None

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


@contextlib.contextmanager
def guarded_output():
    """stdout and stderr guarded (:class:`_GuardedStream`) while a command runs; as they were afterwards."""
    saved = sys.stdout, sys.stderr
    if not isinstance(sys.stdout, _GuardedStream):
        sys.stdout = _GuardedStream(sys.stdout, "stdout")
    if not isinstance(sys.stderr, _GuardedStream):
        sys.stderr = _GuardedStream(sys.stderr, "stderr")
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved


def output_failed_status(command: str, err: OutputFailed) -> int:
    """One line for an output that could not be written (on stderr, or nowhere when stderr failed), and what the
    output still buffered does at exit: nothing (it goes to /dev/null, as for a closed pipe)."""
    fix = {errno.ENOSPC: "free space on its disk", errno.EDQUOT: "free space within your quota"}.get(
        err.errno or 0, "write it elsewhere"
    )
    failed = 1 if err.filename == "stdout" else 2
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, failed)
    if failed == 1:  # else there is nowhere to say it: the exit status does
        with contextlib.suppress(OSError, ValueError):
            print(
                f"flrun {command}: error: its output could not be written to stdout ({err.strerror}); {fix}, or "
                "send the output elsewhere.",
                file=sys.stderr,
            )
    return 2


class Terminated(BaseException):
    """SIGTERM (a job scheduler's stop, ``kill``) while ``flrun fit`` runs: ends it like an interrupt, with a line."""


@contextlib.contextmanager
def stopped_by_sigterm(enabled: bool):
    """SIGTERM raises :class:`Terminated` in the main thread while the command runs (Python's default would end
    the process without a word); the previous handler comes back afterwards."""
    if not enabled or threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def os_error_sentence(err: OSError) -> str:
    """``<path>: <cause>; <fix>`` for an error of the file system."""
    fixes: dict[int | None, str] = {
        errno.ENOSPC: "free space on its disk",
        errno.EDQUOT: "free space within your quota",
        errno.EACCES: "give a place you may write to",
        errno.EPERM: "give a place you may write to",
        errno.EROFS: "give a place on a writable disk",
        errno.EISDIR: "a directory stands where a file goes: move it away",
        errno.ENOTDIR: "a file stands where a folder goes: move it away",
        errno.EEXIST: "a file stands where a folder goes: move it away",
    }
    if err.filename is None:  # every file flrun writes names itself; this came from elsewhere (a library)
        return f"the file system refused an operation ({err.strerror or err}); {fixes.get(err.errno, 'check it')}"
    return f"{clipped(str(err.filename))}: {err.strerror or err}; {fixes.get(err.errno, 'check that path')}"


def _quietly_closed_pipe() -> int:
    """The status of a command whose output nobody reads any more, as a shell shows a process SIGPIPE ended; the
    output still buffered goes nowhere, so the interpreter's exit says nothing either."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    return 128 + signal.SIGPIPE


def file_system_cause(err: BaseException) -> str | None:
    """The sentence for an error caused, somewhere down its chain, by the file system: an OSError, or a database
    (a sweep's SQLite storage) that reports a full disk; None for any other error. Libraries may hide the cause
    (Optuna raises ``AssertionError: Should not reach.`` when it cannot record a failed trial on a full disk)."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno is not None:
            return os_error_sentence(seen)
        text = str(seen)
        if "database or disk is full" in text or "disk I/O error" in text:
            return f"the sweep's study database: {text.splitlines()[0][:200]}; free space on its disk"
        seen = seen.__cause__ or seen.__context__
    return None


def clipped(message: str, limit: int = 600) -> str:
    """A message that quotes input stays a readable line (each quote is clipped where it is made; a last guard)."""
    return message if len(message) <= limit else f"{message[: limit - 3]}..."
