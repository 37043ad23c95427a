"""Image benchmarks: CIFAR-10, CIFAR-100, MNIST and CINIC-10, from local files or downloaded.

Each reads the files in their published format (CIFAR python pickles, MNIST idx, CINIC-10 PNG folders)
from ``data_dir``; with ``download: true`` a missing set is fetched first and checked against its
published checksum (:mod:`fl_lightning.data.sources`, the same as ``flrun data fetch``). Missing files
offline are one sentence naming the expected files and the fetch command; nothing falls back to
synthetic data.
"""

from __future__ import annotations

import gzip
import pickle
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from ..federation.errors import ConfigError
from . import sources
from .arrays import class_labels, uint8_pixels
from .federated import DataArrays, FederatedData
from .transforms import CropFlip

CIFAR_MEAN, CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.2023, 0.1994, 0.2010)  # papers 002 / 003

Normalization = Literal["channel", "pixel", "mean_image", "symmetric", "none"]


class ImageData(FederatedData):
    """Common options of image data sets.

    Args:
        data_dir: where the files are (or are downloaded to).
        download: fetch missing files (needs internet).
        normalize: ``channel`` (per-channel mean / std), ``pixel`` (per-pixel mean and std of the
            training set, paper 001's code), ``mean_image`` (subtract the per-pixel mean image, FedHe's
            MNIST / CIFAR preprocessing), ``symmetric`` (values in [-1, 1], mean and std 0.5 per channel:
            PFLlib's and HtFLlib's) or ``none`` (values in [0, 1]).
        augment: pad-4 random crop and horizontal flip on training batches (paper 001 / 002 CIFAR).
        augment_per_example: a fresh crop / flip per image (``false``: one per batch, as FedJAX).
        (partitioner, server_fraction, unlabeled_fraction, local_split, partition_seed: see FederatedData)
    """

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = False,
        normalize: Normalization = "channel",
        augment: bool = False,
        augment_per_example: bool = True,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.data_dir, self.download = Path(data_dir), download
        self.normalize, self.augment_train, self.augment_per_example = normalize, augment, augment_per_example

    @property
    def augmentation(self) -> CropFlip | None:
        return CropFlip(per_example=self.augment_per_example) if self.augment_train else None

    def ensure_files(self, name: str) -> None:
        """Fetches (``download: true``) and checks the data set's files; one sentence when they are missing."""
        sources.ensure(name, self.data_dir, self.download)

    def _finish(
        self, train_x: np.ndarray, train_y, test_x: np.ndarray, test_y, num_classes: int, mean=CIFAR_MEAN, std=CIFAR_STD
    ) -> DataArrays:
        """uint8 NHWC (or NHW) arrays -> normalised float32 NCHW tensors."""

        def to_tensor(a: np.ndarray) -> Tensor:
            t = torch.tensor(a, dtype=torch.uint8).float().div_(255.0)  # a copy: idx buffers are read-only
            return t.unsqueeze(1) if t.dim() == 3 else t.permute(0, 3, 1, 2).contiguous()

        x, tx = to_tensor(train_x), to_tensor(test_x)
        if self.normalize == "channel":
            m = torch.tensor(mean[: x.shape[1]]).view(1, -1, 1, 1)
            s = torch.tensor(std[: x.shape[1]]).view(1, -1, 1, 1)
            x, tx = (x - m) / s, (tx - m) / s
        elif self.normalize == "symmetric":  # (x - 0.5) / 0.5, exactly
            x, tx = x * 2 - 1, tx * 2 - 1
        elif self.normalize in ("pixel", "mean_image"):
            m = x.mean(0, keepdim=True)
            scale = x.std(0, keepdim=True).clamp(min=1e-6) if self.normalize == "pixel" else 1.0
            x, tx = (x - m) / scale, (tx - m) / scale
        return DataArrays(
            x,
            torch.as_tensor(np.array(train_y), dtype=torch.long),
            tx,
            torch.as_tensor(np.array(test_y), dtype=torch.long),
            num_classes=num_classes,
        )


class _ArraysOnly(pickle.Unpickler):
    """Unpickles what CIFAR's batch files hold (dicts, lists, strings, numpy arrays) and nothing else.

    A pickle may name any importable callable; a crafted "data_batch_1" would run it on load. Only the
    names numpy needs to rebuild an array are resolved.
    """

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("_codecs", "encode"),  # bytes written by Python 3 with protocol 2
    }

    def find_class(self, module: str, name: str):
        if (module, name) not in self.ALLOWED:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name}")
        return super().find_class(module, name)


def read_cifar_batch(path: Path, label_key: str, num_classes: int, source: str) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[N, 32, 32, 3]`` uint8 and labels ``[N]`` of one CIFAR python batch file; a file that is not
    one (text, cut short, another pickle) is one sentence naming it and ``flrun data fetch``, never a traceback."""
    with sources.reading(path, "a CIFAR batch file", source, path.parent.parent), path.open("rb") as f:
        batch = _ArraysOnly(f, encoding="latin1").load()
        if not isinstance(batch, dict):
            raise TypeError(f"it holds a {type(batch).__name__}, not a dict of data and {label_key}")
        images = uint8_pixels(batch["data"]).reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)
        labels = class_labels(batch[label_key], num_classes)
        if len(labels) != len(images):
            raise ValueError(f"{len(images)} images but {len(labels)} {label_key}")
    return images, labels


class Cifar10Data(ImageData):
    """CIFAR-10 (50,000 / 10,000 32x32 images), the python pickles in ``<data_dir>/cifar-10-batches-py``."""

    source, folder, files, label_key, num_classes = (
        "cifar10",
        "cifar-10-batches-py",
        ([f"data_batch_{i}" for i in range(1, 6)], ["test_batch"]),
        "labels",
        10,
    )

    def load(self) -> DataArrays:
        self.ensure_files(self.source)
        root = self.data_dir / self.folder
        parts = []
        for names in self.files:
            batches = [read_cifar_batch(root / name, self.label_key, self.num_classes, self.source) for name in names]
            parts.append((np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])))
        (x, y), (tx, ty) = parts
        return self._finish(x, y, tx, ty, self.num_classes)


class Cifar100Data(Cifar10Data):
    """CIFAR-100 (fine labels), the python pickles in ``<data_dir>/cifar-100-python``."""

    source, folder, files, label_key, num_classes = (
        "cifar100",
        "cifar-100-python",
        (["train"], ["test"]),
        "fine_labels",
        100,
    )


class MnistData(ImageData):
    """MNIST, the idx files (optionally gzipped) in ``<data_dir>/MNIST/raw`` (torchvision's layout).

    FedHe divides by 255 and subtracts the training set's mean image: ``normalize: mean_image``.
    """

    files = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = False,
        normalize: Normalization = "mean_image",
        **kwargs,
    ):
        super().__init__(data_dir, download, normalize, False, True, **kwargs)

    def load(self) -> DataArrays:
        root = self.data_dir / "MNIST" / "raw"
        if not all(self._find(root, name) for name in self.files):  # unpacked idx files count too
            self.ensure_files("mnist")
        x, y, tx, ty = (self._read(root, name) for name in self.files)
        for images, labels, split in ((x, y, "train"), (tx, ty, "t10k")):
            if len(images) != len(labels):
                raise ConfigError(
                    f"MNIST's {split} files in {root} do not match ({images.shape} images, {len(labels)} labels); "
                    f"replace them, e.g. by deleting them and running {sources.fetch_command('mnist', self.data_dir)}."
                )
        return self._finish(x, y, tx, ty, 10, mean=(0.1307,), std=(0.3081,))

    def _read(self, root: Path, name: str) -> np.ndarray:
        """One idx file: labels ``[N]`` in 0..9 or images ``[N, 28, 28]``, as its name says."""
        path = self._find(root, name)
        if path is None:  # present as fetch counts files, but not under a name read here
            raise sources.missing("mnist", self.data_dir)
        labels = "labels" in name
        with sources.reading(path, "an MNIST idx file", "mnist", self.data_dir):
            array = read_idx(path, ndim=1 if labels else 3)
            if labels:
                class_labels(array, 10)
            elif array.shape[1:] != (28, 28):
                raise ValueError(f"its images are {array.shape[2]}x{array.shape[1]}, not 28x28")
        return array

    @staticmethod
    def _find(root: Path, name: str) -> Path | None:
        """The file of ``name`` (gzipped or not); whatever stands at that name counts (a folder, a link to a
        device), so that the reader names it instead of the loader calling the file missing."""
        for candidate in (root / name, root / f"{name}.gz"):
            if candidate.exists() or candidate.is_symlink():
                return candidate
        return None


IDX_LIMIT = 1 << 30  # values an idx file's header may promise: MNIST's largest file holds 47 million


def read_idx(path: Path, ndim: int) -> np.ndarray:
    """An idx file (big-endian header: zero, zero, type 0x08 = uint8, number of dimensions, sizes) of ``ndim``
    dimensions, read no further than its header says.

    Raises ValueError (or gzip's OSError, EOFError) for a file that is not one; the loader words it.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as f:
        magic = f.read(4)
        if len(magic) < 4 or magic[:2] != b"\x00\x00" or magic[2] != 0x08:
            raise ValueError("no uint8 idx header")
        if magic[3] != ndim:
            kind = "labels" if ndim == 1 else "images"
            raise ValueError(f"its header says {magic[3]} dimensions, not the {ndim} of an idx {kind} file")
        sizes = f.read(4 * ndim)
        if len(sizes) < 4 * ndim:
            raise EOFError("the header is cut short")
        shape = tuple(int.from_bytes(sizes[4 * i : 4 * i + 4], "big") for i in range(ndim))
        count = int(np.prod(shape, dtype=object))
        if count > IDX_LIMIT:
            raise ValueError(f"its header says {count:,} values {list(shape)}, more than an MNIST file holds")
        data = f.read(count + 1)  # one more than promised: a longer file is refused, not cut
    return np.frombuffer(data, dtype=np.uint8).reshape(shape)


class Cinic10Data(ImageData):
    """CINIC-10 (90,000 train / 90,000 test 32x32 PNGs), ``<data_dir>/CINIC-10/{train,test}/<class>/*.png``.

    The validation split is not used, as in paper 003. The archive's publishers give no checksum; the
    download is checked against the SHA-256 that public CINIC-10 loaders pin (docs/reference/datasets_and_models.md).
    """

    classes = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")

    def load(self) -> DataArrays:
        self.ensure_files("cinic10")
        root = self.data_dir / "CINIC-10"
        splits = [self._read(root / split) for split in ("train", "test")]
        (x, y), (tx, ty) = splits
        return self._finish(
            x, y, tx, ty, 10, mean=(0.47889522, 0.47227842, 0.43047404), std=(0.24205776, 0.23828046, 0.25874835)
        )

    def _read(self, folder: Path) -> tuple[np.ndarray, list[int]]:
        from PIL import Image

        images, labels = [], []
        for label, name in enumerate(self.classes):
            for png in sorted((folder / name).glob("*.png")):
                with sources.reading(png, "a CINIC-10 image", "cinic10", self.data_dir), Image.open(png) as image:
                    if image.size != (32, 32):  # read from the header: a huge image is never decoded
                        raise ValueError(f"a {image.size[0]}x{image.size[1]} image, not 32x32")
                    pixels = np.asarray(image.convert("RGB"), dtype=np.uint8)
                images.append(pixels)
                labels.append(label)
        if not images:
            raise sources.missing("cinic10", self.data_dir)
        return np.stack(images), labels
