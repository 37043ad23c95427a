"""A data set from a table: a CSV or Parquet file with one row per example, a label column and feature columns."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import torch

from ..federation.errors import ConfigError
from . import sources
from .federated import DataArrays
from .own import Normalize, OwnData, held_out, label_ids

PARQUET = (".parquet", ".pq")
MISSING = {"", "na", "nan", "null", "none"}  # what a CSV cell holds where a value is missing (pandas' usual)


class TableData(OwnData):
    """Examples from the rows of a CSV or Parquet file (by its suffix: ``.csv``, ``.parquet`` / ``.pq``).

    The ``label`` column holds the class: integer indices, or names (text), which become indices in sorted
    order (``classes`` keeps the names). The features are the ``features`` columns, or every other column;
    each must hold numbers in every row (a missing value is refused: fill or drop it first). Parquet is read
    through pyarrow.

    Args:
        path: the table of training examples.
        label: the label column's name.
        features: the feature columns, in order; by default every column but the label.
        test_path: a second table of the same columns for the global test set; without it ``test_fraction``
            of each class is held out from ``path`` with ``test_seed`` (the same rows for every run seed).
        test_fraction: the share of each class held out when there is no ``test_path``.
        test_seed: the seed of that hold-out.
        (normalize, num_classes: see OwnData; partitioner, server_fraction, local_split, ...: see FederatedData)
    """

    def __init__(
        self,
        path: str = "data/my_table.csv",
        label: str = "label",
        features: list[str] | None = None,
        test_path: str | None = None,
        test_fraction: float = 0.2,
        test_seed: int = 0,
        normalize: Normalize = "feature",
        num_classes: int | None = None,
        **kwargs,
    ):
        super().__init__(normalize=normalize, num_classes=num_classes, **kwargs)
        if features is not None and (not features or len(set(features)) != len(features) or label in features):
            raise ConfigError(
                f"features must name distinct columns other than the label {label!r}, got {features}; leave it out "
                "to use every other column."
            )
        self.path, self.test_path = Path(path), Path(test_path) if test_path else None
        self.label, self.features = label, features
        self.test_fraction, self.test_seed = test_fraction, test_seed
        self.classes: list[str] | None = None

    def load(self) -> DataArrays:
        train = read_table(self.path)
        features = self._feature_columns(train, self.path)
        x = feature_matrix(train, features, self.path)
        y, self.classes = label_ids(train[self.label], f"{self.path}'s column {self.label!r}", text=True)
        if self.test_path is None:
            keep, test = held_out(y, self.test_fraction, self.test_seed, str(self.path))
            x, y, tx, ty = x[keep], y[keep], x[test], y[test]
        else:
            table = read_table(self.test_path)
            absent = [c for c in [self.label, *features] if c not in table]
            if absent:
                raise ConfigError(
                    f"{self.test_path} has no column {absent[0]!r} that {self.path} has; both tables need the label "
                    "and the same feature columns."
                )
            tx = feature_matrix(table, features, self.test_path)
            where = f"{self.test_path}'s column {self.label!r}"
            ty, _ = label_ids(table[self.label], where, text=True, names=self.classes)
        return DataArrays(
            torch.from_numpy(x),
            torch.from_numpy(y),
            torch.from_numpy(tx),
            torch.from_numpy(ty),
            num_classes=len(self.classes) if self.classes and self.given_classes is None else self.class_count(y, ty),
        )

    def _feature_columns(self, table: dict[str, np.ndarray], path: Path) -> list[str]:
        if self.label not in table:
            raise ConfigError(
                f"{path} has no label column {self.label!r} (its columns: {', '.join(list(table)[:20])}); name it "
                "with label: <column>."
            )
        if self.features is None:
            features = [c for c in table if c != self.label]
            if not features:
                raise ConfigError(f"{path} has only the label column {self.label!r}; it needs feature columns too.")
            return features
        absent = [c for c in self.features if c not in table]
        if absent:
            raise ConfigError(
                f"{path} has no feature column {absent[0]!r} (its columns: {', '.join(list(table)[:20])})."
            )
        return list(self.features)


def read_table(path: Path) -> dict[str, np.ndarray]:
    """Every column of a CSV (text cells) or Parquet file (typed, missing values as None) by name, in order."""
    if not path.exists() and not path.is_symlink():
        raise ConfigError(
            f"{path} does not exist; put your table there (a CSV with a header row, or a Parquet file) or give its "
            "path as data.init_args.path."
        )
    if path.suffix.lower() not in (".csv", *PARQUET):
        raise ConfigError(f"{path} is neither a .csv nor a .parquet file; TableData reads those two (by the suffix).")
    parquet = path.suffix.lower() in PARQUET
    if parquet:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ConfigError(
                f"reading {path} needs pyarrow, which is not installed; install it with "
                "pip install 'fl-lightning[parquet]' (or pip install pyarrow), or save the table as a CSV."
            ) from None
    what = "a Parquet file" if parquet else "a CSV file"
    with sources.reading(path, what, None, path.parent):
        if parquet:
            table = pq.read_table(path)
            names = list(table.column_names)
            values = [column.to_numpy(zero_copy_only=False) for column in table.columns]
        else:
            with path.open(newline="", encoding="utf-8") as f:
                rows = list(csv.reader(f))
            if not rows:
                raise ValueError("it is empty")
            header, body = rows[0], rows[1:]
            short = next((i for i, row in enumerate(body) if len(row) != len(header)), None)
            if short is not None:
                raise ValueError(f"row {short + 1} has {len(body[short])} cells but the header {len(header)}")
            cells = np.array(body, dtype=object).reshape(len(body), len(header))
            names, values = header, [cells[:, i] for i in range(len(header))]
    twice = next((name for i, name in enumerate(names) if name in names[:i]), None)
    if twice is not None:
        raise ConfigError(f"{path} has two columns named {twice!r}; rename one.")
    return {name: _as_numbers(column) for name, column in zip(names, values)}


def _as_numbers(values: np.ndarray) -> np.ndarray:
    """A column of text cells as float64 when every cell is a number, else as it is (text labels)."""
    if values.dtype != object:
        return values
    try:
        return np.array([float(v) if isinstance(v, str) else v for v in values], dtype=np.float64)
    except (TypeError, ValueError):
        return values


def feature_matrix(table: dict[str, np.ndarray], columns: list[str], path: Path) -> np.ndarray:
    """The ``columns`` as float32 ``[N, F]``; a column that is not numbers in every row is one sentence."""
    out = []
    for name in columns:
        values = table[name]
        if values.dtype == object or values.dtype.kind not in "biuf":
            cells = values.tolist()
            row = next(i for i, v in enumerate(cells) if not _number(v))
            shown = "no value" if cells[row] is None or str(cells[row]).strip().lower() in MISSING else repr(cells[row])
            raise ConfigError(
                f"{path}'s feature column {name!r} holds {shown} in row {row + 1}; every feature must be a number "
                "(fill or drop missing values, encode categories as numbers, or leave the column out of features)."
            )
        values = values.astype(np.float64)
        if not np.isfinite(values).all():
            row = int(np.argmax(~np.isfinite(values)))
            raise ConfigError(
                f"{path}'s feature column {name!r} holds {values[row]:g} in row {row + 1}; every feature must be a "
                "finite number (fill or drop missing values)."
            )
        out.append(values)
    return np.stack(out, axis=1).astype(np.float32)


def _number(value: object) -> bool:
    try:
        return value is not None and np.isfinite(float(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
