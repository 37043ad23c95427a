"""``--storage`` checked before the study opens: a URL SQLAlchemy cannot read, a database whose Python driver is
not installed, a file that is not an SQLite database, or an SQLite database that holds tables other than Optuna's
(a user's own data, to which Optuna would add its tables) is one sentence, and nothing is written.

Only SQLite files are looked into (read-only); a server database (PostgreSQL, MySQL) is reached when the study
opens, and may hold other tables of its own.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from ..federation.errors import ConfigError
from ..run.safe_yaml import clip

SQLITE_HEADER = b"SQLite format 3\x00"
# Optuna's RDB storage (optuna/storages/_rdb/models.py) and its schema migrations
OPTUNA_TABLES = {
    "studies",
    "study_directions",
    "study_system_attributes",
    "study_user_attributes",
    "trial_heartbeats",
    "trial_intermediate_values",
    "trial_params",
    "trial_system_attributes",
    "trial_user_attributes",
    "trial_values",
    "trials",
    "version_info",
    "alembic_version",
}
EXAMPLE = "e.g. --storage sqlite:///runs/sweeps/study.db or postgresql://user@host/db"


def check_storage(url: str) -> None:
    """Raises ConfigError unless ``url`` names a database the sweep can keep its study in."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    shown = clip(repr(url), 100)
    if not isinstance(url, str):
        raise ConfigError(f"storage must be a database URL, got {shown}; give one, {EXAMPLE}.")
    try:
        parsed = make_url(url)
        dialect = parsed.get_dialect()
    except NoSuchModuleError:  # before ArgumentError, its base class
        raise ConfigError(
            f"--storage {shown} names a database kind SQLAlchemy does not know ({parsed.drivername}); give one, "
            f"{EXAMPLE}."
        ) from None
    except ArgumentError:
        raise ConfigError(f"--storage {shown} is not a database URL; give one, {EXAMPLE}.") from None
    try:
        dialect.import_dbapi()
    except ImportError as err:
        raise ConfigError(
            f"--storage {clip(parsed.render_as_string(hide_password=True), 100)} needs the Python driver "
            f"{getattr(err, 'name', None) or parsed.drivername}, which is not installed; install it (pip) or use "
            "SQLite, e.g. --storage sqlite:///runs/sweeps/study.db."
        ) from None
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        _check_sqlite_file(Path(parsed.database), shown)


def _check_sqlite_file(path: Path, shown: str) -> None:
    existing = next(folder for folder in path.parents if folder.exists())
    if not existing.is_dir():
        raise ConfigError(
            f"--storage {shown}: {existing} is a file, so the folder {path.parent} cannot be made; give another path."
        )
    if existing != path.parent:
        return  # the sweep makes the missing folders when it opens the study, as it makes its own output folder
    if not path.exists():
        return  # a new database: Optuna creates it
    if not path.is_file():
        raise ConfigError(f"--storage {shown}: {path} is not a regular file; give an SQLite file's path.")
    try:
        with path.open("rb") as f:
            header = f.read(len(SQLITE_HEADER))
    except OSError as err:
        raise ConfigError(f"--storage {shown}: {path} cannot be read ({err.strerror}).") from None
    if path.stat().st_size and header != SQLITE_HEADER:
        raise ConfigError(
            f"--storage {shown}: {path} is not an SQLite database, and the study would be written over it; give "
            "a new file or a study database."
        )
    others = sorted(_tables(path, shown) - OPTUNA_TABLES)
    if others:
        listed = clip(", ".join(others), 120)
        raise ConfigError(
            f"--storage {shown}: {path} holds tables that are not an Optuna study's ({listed}); the sweep would add "
            "its own tables to that database, so give a new file or a study database."
        )


def _tables(path: Path, shown: str) -> set[str]:
    try:
        connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
        try:
            rows = connection.execute("SELECT name FROM sqlite_master WHERE type IN ('table', 'view')").fetchall()
        finally:
            connection.close()
    except sqlite3.DatabaseError as err:
        raise ConfigError(f"--storage {shown}: {path} cannot be read as an SQLite database ({err}).") from None
    return {row[0] for row in rows if not row[0].startswith("sqlite_")}


def in_memory(url: str | None) -> bool:
    """Whether ``url`` is an SQLite database that lives in one process's memory (``sqlite://``,
    ``sqlite:///:memory:``, ``mode=memory``): no other process sees it, and it is gone when the command ends."""
    if not isinstance(url, str) or not url.startswith("sqlite"):
        return False
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    database = parsed.database or ""
    return database in ("", ":memory:") or "mode=memory" in url or database.startswith("file::memory:")
