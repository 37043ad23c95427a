"""FEMNIST (LEAF): 62-class handwritten characters, naturally partitioned by writer."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch

from ..federation.errors import ConfigError
from . import sources
from .arrays import class_labels, unit_interval_problem
from .federated import DataArrays, FederatedData
from .partition import NaturalIdPartitioner

CLASSES = 62  # digits, upper- and lower-case letters


class FemnistData(FederatedData):
    """FEMNIST from LEAF's JSON files (``<data_dir>/femnist/all_data/*.json``) or the Hub's parquet files
    (``<data_dir>/femnist/hub/*.parquet``, fetched by ``flrun data fetch femnist`` or ``download``).

    Each writer's examples are split 90 / 10 (seeded by ``split_seed``) as LEAF does: the 90% form the
    federated pool (one client per writer with the default natural-id partitioner, which samples
    ``num_clients`` writers when there are more), the 10% of all writers form the global test set. Use
    ``unlabeled_fraction`` for the papers' labeled / unlabeled local data.

    Args:
        data_dir: folder holding ``femnist/all_data`` or ``femnist/hub``.
        hub_id: ``flwrlabs/femnist`` (image, writer_id, character) is used when no LEAF files are found;
            ``None`` requires the LEAF files.
        hub_revision: the Hub commit to fetch and require. None: no commit is pinned (none could be
            found in public code), the fetch takes the current one and records it in
            ``femnist/hub/REVISION``; pin that value here to make runs refuse other copies.
        download: fetch the Hub files (checked against the SHA-256 the Hub lists) when absent.
        test_fraction: each writer's share held out for the global test set.
    """

    default_partitioner = NaturalIdPartitioner

    def __init__(
        self,
        data_dir: str = "data",
        hub_id: str | None = "flwrlabs/femnist",
        hub_revision: str | None = None,
        download: bool = True,
        test_fraction: float = 0.1,
        split_seed: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if hub_id not in (None, "flwrlabs/femnist"):
            raise ConfigError(
                f"hub_id {hub_id!r} is not supported: FEMNIST is read from flwrlabs/femnist (hub_id: "
                "flwrlabs/femnist) or from LEAF's JSON files (hub_id: null)."
            )
        if not 0.0 < test_fraction < 1.0:
            raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}.")
        self.data_dir, self.hub_id, self.hub_revision, self.download = Path(data_dir), hub_id, hub_revision, download
        self.test_fraction, self.split_seed = test_fraction, split_seed

    def load(self) -> DataArrays:
        files = sorted((self.data_dir / "femnist" / "all_data").glob("*.json"))
        if files:
            images, labels, writers = self._read_leaf(files)
        elif self.hub_id is not None:
            sources.ensure("femnist", self.data_dir, self.download, self.hub_revision)
            images, labels, writers = self._read_hub()
        else:
            raise ConfigError(
                f"FEMNIST not found: expected LEAF's JSON files in {self.data_dir / 'femnist/all_data'} "
                "(run LEAF's preprocess.sh), or set hub_id: flwrlabs/femnist and run "
                f"`flrun data fetch femnist --data_dir {self.data_dir}`."
            )
        rng = np.random.default_rng(self.split_seed)
        test = np.zeros(len(labels), dtype=bool)
        for writer in np.unique(writers):
            idx = rng.permutation(np.flatnonzero(writers == writer))
            test[idx[: round(len(idx) * self.test_fraction)]] = True
        if not test.any():  # every writer's share rounds to zero
            raise ConfigError(
                f"test_fraction {self.test_fraction} leaves no test examples of the {len(labels):,}; raise it, "
                "e.g. 0.1."
            )
        x = torch.from_numpy(images).float().view(-1, 1, 28, 28)
        y = torch.from_numpy(labels).long()
        return DataArrays(x[~test], y[~test], x[test], y[test], groups=writers[~test], num_classes=CLASSES)

    def _read_leaf(self, files: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        images, labels, writers = [], [], []
        for path in files:  # LEAF's files are made by its preprocess.sh, not fetched: no fetch command (None)
            with sources.reading(path, "a LEAF FEMNIST JSON file", None, self.data_dir):
                blob = json.loads(path.read_text())
                for user in blob["users"]:
                    x, y = _leaf_writer(blob["user_data"][user], user)
                    images.append(x)
                    labels.append(y)
                    writers += [user] * len(y)
        return np.concatenate(images), np.concatenate(labels), np.asarray(writers)

    def _read_hub(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The Hub's parquet files: ``image`` is stored as ``{bytes, path}`` (PNG), as ``datasets`` writes it."""
        import pandas as pd

        parts = []
        for path in sorted((self.data_dir / "femnist" / "hub").glob("*.parquet")):
            with sources.reading(path, "a FEMNIST parquet file", "femnist", self.data_dir):
                table = pd.read_parquet(path, columns=["image", "writer_id", "character"])
                images = np.stack([_pixels(cell) for cell in table["image"]]).reshape(len(table), 784)
                characters = class_labels(table["character"].to_numpy(), CLASSES)
                parts.append((images, characters, table["writer_id"].astype(str)))
        images, characters, writers = (np.concatenate([np.asarray(part[i]) for part in parts]) for i in range(3))
        return images, characters, writers


def _leaf_writer(data: dict, writer: str) -> tuple[np.ndarray, np.ndarray]:
    """One writer's images ``[n, 784]`` (LEAF's values in [0, 1]) and labels ``[n]`` (0..61); a ValueError names
    the writer and the first image or label that breaks the format."""
    x = np.asarray(data["x"], dtype=np.float32).reshape(-1, 784)
    try:
        y = class_labels(data["y"], CLASSES)
    except ValueError as err:
        raise ValueError(f"writer {writer}: {err}") from None
    if len(x) != len(y):
        raise ValueError(f"writer {writer} has {len(x)} images but {len(y)} labels")
    problem = unit_interval_problem(x)
    if problem is not None:
        raise ValueError(f"writer {writer}: {problem}")
    return x, y


def _pixels(cell) -> np.ndarray:
    """A 28x28 image in [0, 1] from the Hub's ``{bytes, path}`` PNG cell."""
    from PIL import Image

    data = cell["bytes"] if isinstance(cell, dict) else cell
    with Image.open(io.BytesIO(data)) as image:
        if image.size != (28, 28):  # read from the header: a huge image is never decoded
            raise ValueError(f"a {image.size[0]}x{image.size[1]} image, not 28x28")
        return np.asarray(image.convert("L"), dtype=np.float32) / 255.0
