"""What the data sets read from a user's own files share (:class:`OwnData`): the class count, images laid out as
``[N, C, H, W]`` floats, a global test set held out by class when the files give none, and standardisation with
statistics of the clients' training examples only.

The readers (``npz``, ``table``, ``image_folder``, ``hub``) turn a format into arrays; everything federated
(partition, server share, local splits) is :class:`~fl_lightning.data.federated.FederatedData`'s, and every
array then passes the same door as the bundled sets' (:func:`~fl_lightning.data.arrays.check_arrays`).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from torch import Tensor

from ..federation.errors import ConfigError
from .federated import FederatedData, _stratified_take

Normalize = Literal["feature", "channel", "none"]
Layout = Literal["auto", "NCHW", "NHWC"]
COLOR_AXES = (1, 3, 4)  # channels an image's colour axis holds: grey, RGB, RGBA


class OwnData(FederatedData):
    """Common options of the data sets read from your own files.

    Args:
        normalize: ``feature`` (default: each feature, i.e. each pixel of an image or each column of a table,
            to mean 0 and std 1; a feature constant in the clients' data keeps std 1), ``channel`` (one mean and
            std per image channel; per column for feature vectors) or ``none`` (as stored; 8-bit pixels are
            always divided by 255 first). The statistics come from the clients' training examples (labeled and
            unlabeled), never from the test set, the server's set or the local val / test splits.
        num_classes: the number of classes; by default one more than the largest label.
        (partitioner, server_fraction, unlabeled_fraction, local_split, partition_seed: see FederatedData)
    """

    def __init__(self, normalize: Normalize = "feature", num_classes: int | None = None, **kwargs):
        super().__init__(**kwargs)
        if num_classes is not None and (isinstance(num_classes, bool) or not isinstance(num_classes, int)):
            raise ConfigError(f"num_classes must be a whole number of classes, got {num_classes!r}.")
        if num_classes is not None and num_classes < 2:
            raise ConfigError(f"num_classes must be at least 2, got {num_classes}.")
        self.normalize = normalize
        self.given_classes = num_classes

    def class_count(self, *labels: np.ndarray) -> int:
        """``num_classes`` when given, else one more than the largest of ``labels`` (the door then checks them)."""
        if self.given_classes is not None:
            return self.given_classes
        return int(max((int(y.max()) for y in labels if len(y)), default=0)) + 1

    def setup(self, num_clients: int, seed: int) -> None:
        """Splits as every data set, then standardises floating-point features with the clients' statistics
        (only known once the partition has set the server's share and the local splits apart)."""
        super().setup(num_clients, seed)
        if self.normalize == "none" or not self.x.is_floating_point():  # token ids are not standardised
            return
        # sorted and distinct: the same examples give the same statistics whichever client holds them
        seen = torch.unique(torch.cat([torch.cat([c.train, c.unlabeled]) for c in self.clients]))
        mean, std = standardization(self.x[seen], self.normalize)
        self.x = (self.x - mean) / std
        self.test_x = (self.test_x - mean) / std


def standardization(x: Tensor, normalize: str) -> tuple[Tensor, Tensor]:
    """Mean and std of ``x`` (``[N, ...]``) per feature or per channel (axis 1); a std of 0 counts as 1, as
    scikit-learn's StandardScaler does (a constant feature would blow up any test example that differs)."""
    axes = [0] if normalize == "feature" or x.dim() < 3 else [0, *range(2, x.dim())]
    mean = x.mean(dim=axes, keepdim=True)
    std = x.std(dim=axes, keepdim=True) if len(x) > 1 else torch.ones_like(mean)
    return mean, torch.where(std > 1e-6, std, torch.ones_like(std))


def as_examples(values: np.ndarray, layout: Layout, where: str) -> Tensor:
    """Numbers ``[N, ...]`` as float32 examples: 8-bit pixels divided by 255, greyscale ``[N, H, W]`` images
    given a channel axis, colour images as ``[N, C, H, W]`` (``layout``: the stored order; ``auto`` reads the
    axis of 1, 3 or 4 entries), feature vectors ``[N, F]`` as they are."""
    array = np.asarray(values)
    if array.dtype.kind not in "biuf":
        raise ConfigError(f"{where} holds {array.dtype} values; examples must be numbers (pixels or features).")
    if array.ndim < 2:
        raise ConfigError(
            f"{where} has shape {list(array.shape)}; examples must be [N, features] or images [N, C, H, W] / "
            "[N, H, W, C] / [N, H, W]."
        )
    x = torch.from_numpy(np.ascontiguousarray(array))
    x = x.float().div_(255.0) if array.dtype == np.uint8 else x.float()
    if x.dim() == 3 and layout == "auto":  # [N, H, W]: greyscale images
        return x.unsqueeze(1)
    if x.dim() != 4:
        return x
    if layout == "auto":
        first, last = x.shape[1] in COLOR_AXES, x.shape[3] in COLOR_AXES
        if first and last and x.shape[1] != x.shape[3]:
            raise ConfigError(
                f"{where} has images of shape {list(x.shape[1:])}, whose channels may be first or last; give "
                "layout: NCHW or layout: NHWC."
            )
        layout = "NHWC" if last and not first else "NCHW"
    return x.permute(0, 3, 1, 2).contiguous() if layout == "NHWC" else x


def held_out(labels: np.ndarray, fraction: float, seed: int, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Train and test indices: ``fraction`` of each class held out for the global test set with ``seed`` (the
    same examples whatever the run's seed), both sorted."""
    if not 0.0 < fraction < 1.0:
        raise ConfigError(f"test_fraction must be in (0, 1), got {fraction}.")
    test = np.sort(_stratified_take(labels, fraction, np.random.default_rng(seed)))
    if len(test) == 0:  # each class's share rounds to zero: accuracy and loss would read 0.0 on nothing
        raise ConfigError(
            f"test_fraction {fraction} leaves {source} no test examples of the {len(labels):,}; raise it, e.g. 0.2."
        )
    return np.setdiff1d(np.arange(len(labels)), test), test


def label_ids(
    values: object, where: str, text: bool = False, names: list[str] | None = None
) -> tuple[np.ndarray, list[str] | None]:
    """Labels as int64 class indices ``[N]`` and, for text labels, the class names they index.

    Whole numbers pass as they are (1.0 too); with ``text``, text labels become indices of their sorted distinct
    names, or of ``names`` when given (a test split then uses the training split's classes); any other value is
    one sentence naming ``where`` and the first offending label.
    """
    array = np.asarray(values)
    if array.ndim == 2 and array.shape[1] == 1:
        array = array[:, 0]
    if array.ndim != 1:
        raise ConfigError(f"{where} has shape {list(array.shape)}; labels must be one class per example, [N].")
    if array.dtype.kind in "OUS" and len(array) and all(isinstance(v, (str, bytes)) for v in array.tolist()):
        if not text:
            raise ConfigError(
                f"{where} holds text labels ({array.tolist()[0]!r}, ...); labels must be integer class indices 0..C-1."
            )
        words = [v.decode() if isinstance(v, bytes) else v for v in array.tolist()]
        classes = names if names is not None else sorted(set(words))
        index = {name: i for i, name in enumerate(classes)}
        unknown = next((v for v in words if v not in index), None)
        if unknown is not None:
            raise ConfigError(f"{where} holds the label {unknown!r}, a class the training split does not have.")
        return np.array([index[v] for v in words], dtype=np.int64), classes
    if array.dtype.kind == "b" or array.dtype.kind not in "iuf" and array.dtype.kind != "O":
        raise ConfigError(f"{where} holds {array.dtype} labels; labels must be integer class indices 0..C-1.")
    try:
        numbers = array.astype(np.float64)
    except (TypeError, ValueError):
        raise ConfigError(
            f"{where} mixes numbers and other values; labels must be integer class indices 0..C-1."
        ) from None
    bad = ~(np.isfinite(numbers) & (numbers == np.round(numbers)))
    if bad.any():
        i = int(np.argmax(bad))
        raise ConfigError(
            f"{where} holds the label {array[i]} at index {i}, not a whole number; labels must be integer class "
            "indices 0..C-1."
        )
    if array.dtype.kind in "iu":
        return array.astype(np.int64), None
    return numbers.astype(np.int64), None
