"""What a loader hands over (:class:`DataArrays`) and the door every data set's arrays pass before they are
partitioned: lengths and shapes that agree, labels inside the class range, finite features, no empty split.

A file that breaks a promise of its format (an idx header, uint8 pixels, LEAF's [0, 1] values) is named by
its reader, which knows the file (:func:`label_problem`, :func:`uint8_pixels`, :func:`unit_interval_problem`);
:func:`check_arrays` is the last check of any data set, a user's own included, naming the split. Every check
is vectorised and reads each array once (a few milliseconds for CIFAR-10's 150 million values); none changes
a value, so a valid run's numbers are the same with or without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

import numpy as np
import torch
from torch import Tensor

from ..federation.errors import ConfigError

IGNORED = -100  # a target that the loss and the accuracy skip (sequence padding, withheld labels)


@dataclass
class DataArrays:
    """Raw arrays of a data set: the training pool, the global test set, optional natural ids."""

    x: Tensor  # [N, ...]
    y: Tensor  # [N] int64
    test_x: Tensor
    test_y: Tensor
    groups: np.ndarray | None = None  # [N] natural client id per example, if any
    num_classes: int | None = None
    unlabeled_x: Tensor | None = None  # extra examples without labels (IMDB's 50k unsupervised reviews)


# ---------------------------------------------------------------------------------------------- for readers
def label_problem(labels: np.ndarray, num_classes: int, ignored: int | None = None) -> str | None:
    """Where ``labels`` leave ``0..num_classes-1`` (``ignored`` aside): "label 62 at index 9 is outside 0..61";
    None when none does."""
    labels = np.asarray(labels)
    bad = (labels < 0) | (labels >= num_classes)
    if ignored is not None:
        bad &= labels != ignored
    if not bad.any():
        return None
    i = int(np.argmax(bad.reshape(-1)))
    position = np.unravel_index(i, labels.shape)[0] if labels.ndim > 1 else i
    return f"label {labels.reshape(-1)[i]} at index {position} is outside 0..{num_classes - 1}"


def class_labels(values: object, num_classes: int) -> np.ndarray:
    """``values`` as int64 class labels ``[N]``; a ValueError names the first label that is not a whole number
    (1.5, NaN: a cast would truncate it) or is outside ``0..num_classes-1``. Text is left to numpy's error."""
    labels = np.asarray(values)
    if labels.dtype.kind == "f":
        bad = ~(labels == np.round(labels))  # NaN and infinities too
        if bad.any():
            i = int(np.argmax(bad.reshape(-1)))
            raise ValueError(f"label {labels.reshape(-1)[i]:g} at index {i} is not a whole number")
    labels = labels.astype(np.int64).reshape(-1)
    problem = label_problem(labels, num_classes)
    if problem is not None:
        raise ValueError(problem)
    return labels


def uint8_pixels(values: object, what: str = "image") -> np.ndarray:
    """``values`` (``[N, ...]``) as uint8 pixels, refusing every value the cast would change (NaN, 300 -> 44,
    0.5 -> 0, -1 -> 255) with a ValueError naming the first such ``what`` (its index along the first axis).

    uint8 arrays pass untouched; whole numbers 0..255 of another type are cast; text is left to numpy's own
    error."""
    array = np.asarray(values)
    if array.dtype == np.uint8 or array.dtype.kind not in "biuf" or array.ndim == 0:
        return array.astype(np.uint8, copy=False)
    bad = ~((array >= 0) & (array <= 255))  # NaN compares false: bad
    if array.dtype.kind == "f":
        bad |= array != np.round(array)
    if bad.any():
        i = int(np.argmax(bad.reshape(-1)))
        value = array.reshape(-1)[i]
        raise ValueError(
            f"{what} {i // max(array[:1].size, 1)} holds {value:g} ({array.dtype}), not a uint8 pixel 0..255"
        )
    return array.astype(np.uint8)


def unit_interval_problem(values: np.ndarray, what: str = "image") -> str | None:
    """Where ``values`` (``[N, ...]``) leave [0, 1] (NaN included): "image 3 holds nan, not a value in [0, 1]"."""
    bad = ~((values >= 0) & (values <= 1))
    if not bad.any():
        return None
    i = int(np.argmax(bad.reshape(-1)))
    return f"{what} {i // max(values[:1].size, 1)} holds {values.reshape(-1)[i]:g}, not a value in [0, 1]"


# ---------------------------------------------------------------------------------------------- the door
def check_arrays(arrays: DataArrays, source: str) -> int:
    """Refuses arrays no run could use rightly, in one sentence naming ``source`` (the data set's class), the
    split, what is wrong and the first offending example; returns the number of classes.

    Checks: one label (and natural id) per example; a training pool and a global test set that are not empty;
    test and unlabeled examples shaped as the training pool's; whole-number labels inside ``0..C-1`` (sequence
    targets may also be -100, ignored); finite floating-point features.
    """
    splits = {"training pool": (arrays.x, arrays.y), "global test set": (arrays.test_x, arrays.test_y)}
    given = {"x": arrays.x, "y": arrays.y, "test_x": arrays.test_x, "test_y": arrays.test_y}
    for name, value in {**given, "unlabeled_x": arrays.unlabeled_x}.items():
        if not isinstance(value, Tensor) and (value is not None or name != "unlabeled_x"):
            raise ConfigError(
                f"{source}'s load() gives {name} as {type(value).__name__}; DataArrays holds torch tensors, e.g. "
                f"torch.from_numpy({name})."
            )
    for split, (x, y) in splits.items():
        if len(x) != len(y):
            raise ConfigError(
                f"{source}'s {split} holds {len(x):,} examples but {len(y):,} labels; its load() must give one "
                "label per example."
            )
    if arrays.groups is not None and len(arrays.groups) != len(arrays.x):
        raise ConfigError(
            f"{source} gives {len(arrays.groups):,} natural ids for {len(arrays.x):,} training examples; its "
            "load() must give one id per example (groups)."
        )
    if len(arrays.x) == 0:
        raise ConfigError(
            f"{source} has no training examples (the global test set holds {len(arrays.test_x):,}); check its "
            "files and its test share or size."
        )
    if len(arrays.test_y) == 0:  # every global metric would be computed on nothing and read 0.0
        raise ConfigError(
            f"{source} has no global test examples (of {len(arrays.y):,} loaded); check its files and its test "
            "share or size."
        )
    _check_shapes(arrays, source)
    num_classes = _class_count(arrays, source)
    for split, (x, y) in splits.items():
        _check_labels(y, num_classes, f"{source}'s {split}")
        _check_finite(x, f"{source}'s {split}")
    if arrays.unlabeled_x is not None:
        _check_finite(arrays.unlabeled_x, f"{source}'s unlabeled examples")
    return num_classes


def check_features(x: Tensor, where: str) -> None:
    """Refuses non-finite floating-point features of ``where`` (a server data set's examples)."""
    _check_finite(x, where)


def _check_shapes(arrays: DataArrays, source: str) -> None:
    shape, dtype = tuple(arrays.x.shape[1:]), arrays.x.dtype
    others = {"global test set": arrays.test_x, "unlabeled examples": arrays.unlabeled_x}
    for split, x in others.items():
        if x is None or len(x) == 0:
            continue
        if tuple(x.shape[1:]) != shape or x.dtype != dtype:
            raise ConfigError(
                f"{source}'s {split} has examples of shape {list(x.shape[1:])} ({x.dtype}), the training pool's "
                f"are {list(shape)} ({dtype}); its load() must give both the same shape and type."
            )


def _class_count(arrays: DataArrays, source: str) -> int:
    """The data set's ``num_classes``, or one more than its largest label when it gives none."""
    given = arrays.num_classes
    if given is not None and (isinstance(given, bool) or not isinstance(given, Integral) or given < 1):
        raise ConfigError(f"{source} gives num_classes {given!r}; it must be a positive whole number (or None).")
    if given:
        return int(given)
    largest = max(int(y.max()) for y in (arrays.y, arrays.test_y) if len(y))
    return largest + 1


def _check_labels(y: Tensor, num_classes: int, where: str) -> None:
    if y.is_floating_point():  # .long() would truncate 1.7 to 1 and NaN to a large negative number
        whole = torch.isfinite(y) & (y == y.round())
        if not bool(whole.all()):
            i = int((~whole).reshape(len(y), -1).any(1).nonzero()[0])
            raise ConfigError(
                f"in {where}, label {y[i].tolist()} at index {i} is not a whole number; labels must be class "
                f"indices 0..{num_classes - 1}: check its files."
            )
    elif y.dtype == torch.bool or y.is_complex():
        raise ConfigError(f"in {where}, the labels are {y.dtype}; labels must be integer class indices.")
    problem = label_problem(y.cpu().long().numpy(), num_classes, IGNORED if y.dim() > 1 else None)
    if problem is not None:
        raise ConfigError(
            f"in {where}, {problem} (the data set has {num_classes} classes); check its files or its num_classes."
        )


def _check_finite(x: Tensor, where: str) -> None:
    """NaN or an infinity in the features: one pass (a sum) when there is none, a second to find the first."""
    if not x.is_floating_point() or len(x) == 0 or bool(torch.isfinite(x.sum())):
        return
    bad = ~torch.isfinite(x.reshape(len(x), -1)).all(1)
    if bool(bad.any()):  # else the sum overflowed on large finite values
        i = int(bad.nonzero()[0])
        value = x[i].reshape(-1)[~torch.isfinite(x[i].reshape(-1))][0].item()
        raise ConfigError(
            f"in {where}, example {i} holds {value}; every feature must be a finite number: check its files or "
            "its normalisation."
        )
