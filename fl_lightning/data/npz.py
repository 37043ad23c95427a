"""A data set from one ``.npz`` file holding ``x_train``, ``y_train``, ``x_test`` and ``y_test``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from ..federation.errors import ConfigError
from . import sources
from .federated import DataArrays
from .own import Layout, Normalize, OwnData, as_examples, label_ids

KEYS = ("x_train", "y_train", "x_test", "y_test")


class NpzData(OwnData):
    """Examples and labels from one ``.npz`` file (``numpy.savez``) with ``x_train``, ``y_train``, ``x_test`` and
    ``y_test``.

    Examples are images (``[N, C, H, W]``, ``[N, H, W, C]`` or greyscale ``[N, H, W]``; uint8 pixels are
    divided by 255) or feature vectors ``[N, F]``; labels are integer class indices ``[N]``. The file is read
    without pickles (``allow_pickle`` stays off), so object arrays are refused.

    Args:
        path: the file.
        layout: the images' axis order; ``auto`` takes the axis of 1, 3 or 4 entries as the channels.
        (normalize, num_classes: see OwnData; partitioner, server_fraction, local_split, ...: see FederatedData)
    """

    def __init__(
        self,
        path: str = "data/my_data.npz",
        layout: Layout = "auto",
        normalize: Normalize = "feature",
        num_classes: int | None = None,
        **kwargs,
    ):
        super().__init__(normalize=normalize, num_classes=num_classes, **kwargs)
        self.path, self.layout = Path(path), layout

    def load(self) -> DataArrays:
        path = self.path
        if not path.exists() and not path.is_symlink():
            raise ConfigError(
                f"{path} does not exist; save your data there with numpy.savez({path.name!r}, x_train=..., "
                "y_train=..., x_test=..., y_test=...), or give its path as data.init_args.path."
            )
        with sources.reading(path, "an .npz file", None, path.parent), np.load(path, allow_pickle=False) as f:
            if not hasattr(f, "files"):  # a plain .npy array
                raise ValueError("it holds one array, not named arrays")
            missing = [key for key in KEYS if key not in f.files]
            if missing:
                raise ConfigError(
                    f"{path} has no {', '.join(missing)} (it holds {', '.join(f.files) or 'nothing'}); NpzData "
                    "needs x_train, y_train, x_test and y_test."
                )
            arrays = {key: f[key] for key in KEYS}
        for split in ("train", "test"):
            x, y = arrays[f"x_{split}"], arrays[f"y_{split}"]
            if x.ndim == 0 or y.ndim == 0 or len(x) != len(y):
                raise ConfigError(
                    f"{path}'s x_{split} holds {len(x) if x.ndim else 'no'} examples but y_{split} "
                    f"{len(y) if y.ndim else 'no'} labels; give one label per example."
                )
        x, test_x = (as_examples(arrays[key], self.layout, f"{path}'s {key}") for key in ("x_train", "x_test"))
        if x.shape[1:] != test_x.shape[1:]:
            raise ConfigError(
                f"{path}'s x_test examples have shape {list(arrays['x_test'].shape[1:])}, x_train's "
                f"{list(arrays['x_train'].shape[1:])}; both must have the same shape."
            )
        y, _ = label_ids(arrays["y_train"], f"{path}'s y_train")
        test_y, _ = label_ids(arrays["y_test"], f"{path}'s y_test")
        return DataArrays(
            x, torch.from_numpy(y), test_x, torch.from_numpy(test_y), num_classes=self.class_count(y, test_y)
        )
