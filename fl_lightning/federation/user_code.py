"""Where control passes to the user's own code (a model builder, a LightningModule's hooks, a Strategy subclass's
hooks, a trusted module's import), and what the user sees when that code raises: one sentence naming their
object and hook ("your model builder mymod.build raised ValueError: width must be even"), then their own frames
(their file and line, none of the framework's or of the libraries'), and exit status 3 from ``flrun``.

An exception is the user's when it was raised in a frame of the user's, or in a library the user's code called,
with no frame of this package in between: an error our code raises, even below a user's call, is still ours and
keeps its traceback.
"""

from __future__ import annotations

import contextlib
import sys
import sysconfig
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from .errors import ConfigError, is_allocation_failure

USER_CODE_STATUS = 3  # flrun's exit status when the user's own code raised (2: a mistake in the input)

_PACKAGE = str(Path(__file__).resolve().parents[1])  # this package's folder: frames in it are ours
_LIBRARIES = tuple(
    {str(Path(p).resolve()) for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_path(key))}
)


class UserCodeError(Exception):
    """The user's own code raised where the framework called it.

    Attributes:
        sentence: what raised and what it raised ("your model builder mymod.build raised ValueError: ...").
        frames: the user's own frames of the traceback, outermost first (file, line, function, source line).
    """

    def __init__(self, sentence: str, frames: list[traceback.FrameSummary] | None = None):
        super().__init__(sentence)
        self.sentence = sentence
        self.frames = list(frames or [])

    def __reduce__(self):  # a sweep's worker process hands it back to its parent
        return (type(self), (self.sentence, self.frames))

    def formatted_frames(self) -> str:
        """The user's frames as Python prints a traceback's, or "" when none is left (a C extension raised)."""
        if not self.frames:
            return ""
        lines = traceback.format_list(self.frames)
        return "Traceback of your code (most recent call last):\n" + "".join(lines)


def _frame_files(tb: TracebackType | None) -> Iterator[str]:
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename
        tb = tb.tb_next


def is_ours(filename: str) -> bool:
    """Whether a frame's file is this package's."""
    try:
        return str(Path(filename).resolve()).startswith(_PACKAGE + "/") or filename.startswith(_PACKAGE + "/")
    except (OSError, ValueError):
        return False


def is_users(filename: str) -> bool:
    """Whether a frame's file is the user's own: neither this package's, nor Python's, nor an installed
    library's, nor the import machinery's (``<frozen importlib._bootstrap>``)."""
    if filename.startswith("<frozen") or is_ours(filename):
        return False
    try:
        resolved = str(Path(filename).resolve())
    except (OSError, ValueError):
        return True
    return not any(resolved.startswith(lib + "/") for lib in _LIBRARIES)


def raised_in_user_code(tb: TracebackType | None) -> bool:
    """Whether the traceback ``tb`` (starting at the boundary's frame) was raised in the user's code: below the
    last frame of ours lies a frame of the user's (the raise is there, or in a library the user's code called)."""
    if tb is None:
        return False
    below = list(_frame_files(tb.tb_next))
    last_ours = max((i for i, name in enumerate(below) if is_ours(name)), default=-1)
    return any(is_users(name) for name in below[last_ours + 1 :])


def user_frames(tb: TracebackType | None) -> list[traceback.FrameSummary]:
    """The user's own frames of a traceback, outermost first."""
    return [frame for frame in traceback.extract_tb(tb) if is_users(frame.filename)]


def described(err: BaseException) -> str:
    """``ValueError: width must be even``: the exception's type and first line of its message (clipped)."""
    text = str(err).strip().splitlines()
    message = text[0] if text else ""
    if len(message) > 300:
        message = message[:297] + "..."
    return f"{type(err).__name__}: {message}" if message else type(err).__name__


def converted(err: BaseException, what: str) -> BaseException:
    """What to raise for ``err``, raised under the boundary ``what`` ("model builder mymod.build"): a
    :class:`UserCodeError` when the user's code raised it, else ``err`` itself (ours: a ConfigError, a bug)."""
    if isinstance(err, (ConfigError, UserCodeError)) or is_allocation_failure(err) or not isinstance(err, Exception):
        return err
    if not raised_in_user_code(err.__traceback__):
        return err
    sentence = f"your {what} raised {described(err)}"
    if isinstance(err, SyntaxError):
        sentence = f"your {what} raised {_syntax(err)}"
    return UserCodeError(sentence, user_frames(err.__traceback__))


@contextlib.contextmanager
def calling(what: str) -> Iterator[None]:
    """Runs the user's code of the block: what it raises ends as ``UserCodeError("your {what} raised ...")``
    (ConfigError, UserCodeError, a failed allocation and errors of our own code pass through unchanged)."""
    try:
        yield
    except Exception as err:  # noqa: BLE001 - whatever the user's code raises
        new = converted(err, what)
        if new is err:
            raise
        raise new from None


def user_hook(obj: object, kind: str, hook: str) -> contextlib.AbstractContextManager[None]:
    """The boundary around ``obj.hook(...)`` for an object of a user's class (``calling("Strategy mymod.MyAvg.
    aggregate")``); nothing around the framework's own classes."""
    cls = type(obj)
    if cls.__module__ == "fl_lightning" or cls.__module__.startswith("fl_lightning."):
        return contextlib.nullcontext()
    return calling(f"{kind} {cls.__module__}.{cls.__qualname__}.{hook}")


def user_method(method: Callable[..., Any]) -> contextlib.AbstractContextManager[None]:
    """:func:`user_hook` for a bound method of a Strategy (a phase's ``configure``, ``client_update`` or
    ``aggregate``), named by the method's own name."""
    owner = getattr(method, "__self__", None)
    if owner is None:  # a plain function given as a phase's hook: its module decides
        module = getattr(method, "__module__", "") or ""
        if module == "fl_lightning" or module.startswith("fl_lightning."):
            return contextlib.nullcontext()
        return calling(f"Strategy hook {module}.{getattr(method, '__qualname__', method)!s}")
    return user_hook(owner, "Strategy", getattr(method, "__name__", "hook"))


def import_failure(module: str, err: BaseException) -> UserCodeError:
    """The error for a trusted module whose import raised ``err`` (not the module being absent): names the
    module, the error and the user's line (for a SyntaxError, the file and line the parser stopped at)."""
    frames = user_frames(err.__traceback__)
    if isinstance(err, SyntaxError):
        return UserCodeError(f"your module {module} could not be imported: {_syntax(err)}", frames)
    where = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return UserCodeError(f"your module {module} could not be imported: it raised {described(err)}{where}", frames)


def failed_import(err: BaseException) -> UserCodeError | None:
    """The error for a user's module whose import raised ``err`` (or an error ``err`` was raised from) while a
    library imported it (jsonargparse, for a recipe's ``class_path``); None when no user's module failed so."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, (UserCodeError, ConfigError)):
            return None
        module = _importing_module(seen)
        if module is not None:
            return import_failure(module, seen)
        seen = seen.__cause__ or seen.__context__
    return None


def _importing_module(err: BaseException) -> str | None:
    """The name of the user's module whose top level raised ``err``, or that a SyntaxError is in."""
    if isinstance(err, SyntaxError) and err.filename and is_users(err.filename):
        path = Path(err.filename).resolve().with_suffix("")
        for entry in sys.path:
            with contextlib.suppress(ValueError, OSError):
                parts = path.relative_to(Path(entry or ".").resolve()).parts
                if parts and all(part.isidentifier() for part in parts):
                    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        return path.name
    tb = err.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "<module>" and is_users(code.co_filename):
            return tb.tb_frame.f_globals.get("__name__")
        tb = tb.tb_next
    return None


def missing_module(module: str, err: BaseException) -> bool:
    """Whether ``err`` says that ``module`` itself (or a package above it) does not exist, rather than that its
    code failed (an import inside it included)."""
    name = getattr(err, "name", None)
    return isinstance(err, ModuleNotFoundError) and name is not None and (module + ".").startswith(name + ".")


def _syntax(err: SyntaxError) -> str:
    where = f" at {err.filename}:{err.lineno}" if err.filename else ""
    return f"{type(err).__name__}{where}: {err.msg}"


def user_code_report(prefix: str, err: UserCodeError) -> str:
    """The sentence, then the user's own frames: what ``flrun`` shows on stderr (exit :data:`USER_CODE_STATUS`)."""
    return f"{prefix}{err.sentence}\n{err.formatted_frames()}"
