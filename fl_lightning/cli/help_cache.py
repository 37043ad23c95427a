"""``flrun fit --help`` without the parser's imports: the help text is kept in the user's cache directory,
under a key made of everything it is rendered from (this package's source files, the torch and jsonargparse
installations, the Python version and the terminal's width). The first ``--help`` renders it with the parser
(importing torch, a second or more) and stores it; later ones print the stored text, unless the key changed.

Nothing here imports torch: the key reads files and stat()s packages without importing them.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1]
# the installed packages the help text depends on: torch (the signature's types, its optimizers' docs) and
# jsonargparse with the docstring parser it reads descriptions with
RENDERED_WITH = ("torch", "jsonargparse", "docstring_parser")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fl-lightning"


def source_digest(root: Path = PACKAGE) -> str:
    """SHA-256 of every ``.py`` file under ``root`` (paths and contents): any change of the code changes it."""
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def installed(name: str) -> str:
    """Where package ``name`` is installed and when its ``__init__`` was written (an upgrade rewrites it)."""
    spec = importlib.util.find_spec(name)
    if spec is None or spec.origin is None:
        return f"{name}: absent"
    stat = os.stat(spec.origin)
    return f"{name}: {spec.origin} {stat.st_mtime_ns} {stat.st_size}"


def help_key(root: Path = PACKAGE) -> str:
    parts = [source_digest(root), sys.version, f"columns {shutil.get_terminal_size().columns}"]
    parts += [installed(name) for name in RENDERED_WITH]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def cached_help() -> str | None:
    """The stored help text for the current key, or None."""
    try:
        return (cache_dir() / f"fit-help-{help_key()}.txt").read_text()
    except OSError:
        return None


def store_help(text: str) -> None:
    """Stores ``text`` under the current key (atomically) and removes help texts of other keys; a cache
    directory that cannot be written is left alone: the help is then rendered each time."""
    folder, name = cache_dir(), f"fit-help-{help_key()}.txt"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=folder, prefix=".fit-help-", delete=False) as out:
            out.write(text)
        os.replace(out.name, folder / name)
        for old in folder.glob("fit-help-*.txt"):
            if old.name != name:
                old.unlink(missing_ok=True)
    except OSError:
        pass
