"""The scikit-learn digits set: 1,797 real 8x8 handwritten digits, bundled, so it works offline."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import ConfigError
from .federated import DataArrays, FederatedData, _stratified_take


class DigitsData(FederatedData):
    """scikit-learn's ``load_digits`` as ``[N, 1, 8, 8]`` images scaled to [0, 1].

    It has no official test split, so ``test_fraction`` of each class is held out as the global test
    set with a fixed ``test_seed``: the test set stays the same across run seeds.

    Args:
        test_fraction: share of each class held out for the global test set.
        test_seed: seed of that hold-out.
        (the rest as in :class:`FederatedData`)
    """

    def __init__(
        self,
        test_fraction: float = 0.2,
        test_seed: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if not 0.0 < test_fraction < 1.0:
            raise ConfigError(f"test_fraction must be in (0, 1), got {test_fraction}.")
        self.test_fraction = test_fraction
        self.test_seed = test_seed

    def load(self) -> DataArrays:
        from sklearn.datasets import load_digits

        bunch = load_digits()
        images = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # [1797, 1, 8, 8]
        labels = torch.tensor(bunch.target, dtype=torch.long)
        test = np.sort(_stratified_take(bunch.target, self.test_fraction, np.random.default_rng(self.test_seed)))
        train = np.setdiff1d(np.arange(len(labels)), test)
        return DataArrays(images[train], labels[train], images[test], labels[test], num_classes=10)
