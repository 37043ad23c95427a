"""The scikit-learn digits set: 1,797 real 8x8 handwritten digits, bundled, so it works offline."""

from __future__ import annotations

import gzip
import importlib.util
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from ..federation.errors import ConfigError
from .federated import DataArrays, FederatedData, _stratified_take


class DigitsData(FederatedData):
    """scikit-learn's ``load_digits`` as ``[N, 1, 8, 8]`` float images.

    It has no official test split, so ``test_fraction`` of each class is held out as the global test
    set with a fixed ``test_seed``: the test set stays the same across run seeds.

    Pixels (counts 0-16) are first divided by 16, then normalised as the image data sets name it.
    The statistics come from the examples the clients train on (their labeled and unlabeled local
    training data), never from the global test set, the server's set or the clients' local val / test
    splits; every split is then transformed with them.

    Args:
        normalize: ``pixel`` (default: per-pixel mean and std, the usual practice for this set; a
            pixel constant in the clients' data keeps std 1), ``channel`` (one mean and std over all
            pixels), ``mean_image`` (subtract the per-pixel mean) or ``none`` (values in [0, 1],
            this set's behaviour before; it trains much worse, docs/reference/datasets_and_models.md).
        test_fraction: share of each class held out for the global test set.
        test_seed: seed of that hold-out.
        (the rest as in :class:`FederatedData`)
    """

    def __init__(
        self,
        normalize: Literal["pixel", "channel", "mean_image", "none"] = "pixel",
        test_fraction: float = 0.2,
        test_seed: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not 0.0 < test_fraction < 1.0:
            raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}.")
        self.normalize = normalize
        self.test_fraction = test_fraction
        self.test_seed = test_seed

    def load(self) -> DataArrays:
        flat, target = read_digits()
        images = torch.tensor(flat.reshape(-1, 8, 8), dtype=torch.float32).unsqueeze(1) / 16.0  # [1797, 1, 8, 8]
        labels = torch.tensor(target, dtype=torch.long)
        test = np.sort(_stratified_take(target, self.test_fraction, np.random.default_rng(self.test_seed)))
        if len(test) == 0:  # each class's share rounds to zero: accuracy and loss would read 0.0 on nothing
            raise ConfigError(
                f"test_fraction {self.test_fraction} leaves no test examples of the {len(labels):,}; raise it, "
                "e.g. 0.2."
            )
        train = np.setdiff1d(np.arange(len(labels)), test)
        return DataArrays(images[train], labels[train], images[test], labels[test], num_classes=10)

    def setup(self, num_clients: int, seed: int) -> None:
        """Splits as every data set, then normalises with statistics of the clients' training examples
        (only known once the partition has set the server's share and the local splits apart)."""
        super().setup(num_clients, seed)
        if self.normalize == "none":
            return
        # sorted and distinct: the same examples give the same statistics whichever client holds them, and
        # clients that share examples (SampledPartitioner, 100,000 clients) count each example once
        seen = torch.unique(torch.cat([torch.cat([c.train, c.unlabeled]) for c in self.clients]))
        mean, std = normalization_stats(self.x[seen], self.normalize)
        self.x = (self.x - mean) / std
        self.test_x = (self.test_x - mean) / std


def read_digits() -> tuple[np.ndarray, np.ndarray]:
    """Pixels ``[1797, 64]`` (float64 counts 0-16) and labels ``[1797]``: ``load_digits``'s, read from its file.

    scikit-learn's own ``load_digits`` imports scikit-learn, which imports pandas and scipy (0.7 s of a digits
    run's 5 s of imports, ``python -X importtime``). The data is the CSV it bundles, read as it reads it
    (``np.loadtxt``); without the file (another scikit-learn layout), ``load_digits`` itself.
    """
    package = importlib.util.find_spec("sklearn")  # finds the package without importing it
    location = package.submodule_search_locations if package else None
    csv = Path(location[0], "datasets", "data", "digits.csv.gz") if location else None
    if csv is None or not csv.is_file():
        from sklearn.datasets import load_digits

        bunch = load_digits()
        return bunch.data, bunch.target
    with gzip.open(csv, mode="rt", encoding="utf-8") as rows:
        data = np.loadtxt(rows, delimiter=",")
    return data[:, :-1], data[:, -1].astype(int)


def normalization_stats(x: Tensor, normalize: str) -> tuple[Tensor, Tensor]:
    """Mean and std to normalise ``[N, 1, H, W]`` images by, estimated on ``x``.

    A pixel that never varies in ``x`` (digits' corners) keeps std 1, as scikit-learn's StandardScaler
    does: dividing by a near-zero std would blow up any test image that differs there.
    """
    if normalize == "channel":
        return x.mean(), x.std().clamp(min=1e-6)
    mean = x.mean(0, keepdim=True)
    if normalize == "mean_image":
        return mean, torch.ones_like(mean)
    std = x.std(0, keepdim=True)
    return mean, torch.where(std > 1e-6, std, torch.ones_like(std))
