"""FEMNIST (LEAF): 62-class handwritten characters, naturally partitioned by writer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..errors import ConfigError
from .federated import DataArrays, FederatedData
from .partition import NaturalIdPartitioner


class FemnistData(FederatedData):
    """FEMNIST from LEAF's JSON files (``<data_dir>/femnist/all_data/*.json``) or the Hub.

    Each writer's examples are split 90 / 10 (seeded by ``split_seed``) as LEAF does: the 90% form the
    federated pool (one client per writer with the default natural-id partitioner, which samples
    ``num_clients`` writers when there are more), the 10% of all writers form the global test set. Use
    ``unlabeled_fraction`` for the papers' labeled / unlabeled local data.

    Args:
        data_dir: folder holding ``femnist/all_data``.
        hub_id: a Hugging Face dataset id (``flwrlabs/femnist``: image, writer_id, character) used when
            no LEAF files are found; ``None`` requires the LEAF files.
        test_fraction: each writer's share held out for the global test set.
    """

    default_partitioner = NaturalIdPartitioner

    def __init__(
        self,
        data_dir: str = "data",
        hub_id: str | None = "flwrlabs/femnist",
        test_fraction: float = 0.1,
        split_seed: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.data_dir, self.hub_id = Path(data_dir), hub_id
        self.test_fraction, self.split_seed = test_fraction, split_seed

    def load(self) -> DataArrays:
        files = sorted((self.data_dir / "femnist" / "all_data").glob("*.json"))
        if files:
            images, labels, writers = self._read_leaf(files)
        elif self.hub_id is not None:
            images, labels, writers = self._read_hub()
        else:
            raise ConfigError(
                f"FEMNIST not found: expected LEAF's JSON files in {self.data_dir / 'femnist/all_data'} "
                "(run LEAF's preprocess.sh) or set hub_id."
            )
        rng = np.random.default_rng(self.split_seed)
        test = np.zeros(len(labels), dtype=bool)
        for writer in np.unique(writers):
            idx = rng.permutation(np.flatnonzero(writers == writer))
            test[idx[: int(round(len(idx) * self.test_fraction))]] = True
        x = torch.from_numpy(images).float().view(-1, 1, 28, 28)
        y = torch.from_numpy(labels).long()
        return DataArrays(x[~test], y[~test], x[test], y[test], groups=writers[~test], num_classes=62)

    @staticmethod
    def _read_leaf(files: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        images, labels, writers = [], [], []
        for path in files:
            blob = json.loads(path.read_text())
            for user in blob["users"]:
                data = blob["user_data"][user]
                images.append(np.asarray(data["x"], dtype=np.float32))
                labels.append(np.asarray(data["y"], dtype=np.int64))
                writers += [user] * len(data["y"])
        return np.concatenate(images), np.concatenate(labels), np.asarray(writers)

    def _read_hub(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        import datasets

        try:
            table = datasets.load_dataset(self.hub_id, split="train", cache_dir=str(self.data_dir / "hf"))
        except Exception as err:
            raise ConfigError(
                f"FEMNIST: no LEAF files in {self.data_dir / 'femnist/all_data'} and the Hub dataset "
                f"{self.hub_id!r} could not be loaded ({type(err).__name__}); put LEAF's JSON files "
                "there or run once online."
            ) from None
        images = np.stack([np.asarray(img.convert("L"), dtype=np.float32) / 255.0 for img in table["image"]])
        return (
            images.reshape(len(images), -1),
            np.asarray(table["character"], dtype=np.int64),
            np.asarray(table["writer_id"]),
        )
