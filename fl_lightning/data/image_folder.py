"""A data set from a folder of images, one sub-folder per class (torchvision's ``ImageFolder`` layout)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..federation.errors import ConfigError
from . import sources
from .federated import DataArrays
from .own import Normalize, OwnData, as_examples, held_out

EXTENSIONS = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff", ".webp")  # torchvision's
GREY = ("1", "L", "LA", "I", "I;16", "F")  # PIL modes without colour


class ImageFolderData(OwnData):
    """Images from ``<path>/train/<class>/*`` and ``<path>/test/<class>/*`` (PNG, JPEG, BMP, ... by suffix).

    The classes are the sub-folders of ``train/``, in sorted order (``classes`` keeps the names), as
    torchvision's ``ImageFolder`` numbers them; ``test/`` may lack a class but not hold another. Without a
    ``test/`` folder, ``test_fraction`` of each class of ``train/`` is held out with ``test_seed``. Pixels are
    divided by 255 and then normalised (``normalize``).

    Args:
        path: the folder holding ``train/`` (and ``test/``).
        image_size: resize every image to this height and width; by default all must have one size.
        color: ``auto`` (greyscale, one channel, when every image is greyscale; else RGB), ``grey`` or ``rgb``.
        test_fraction: the share of each class held out when there is no ``test/`` folder.
        test_seed: the seed of that hold-out.
        (normalize, num_classes: see OwnData; partitioner, server_fraction, local_split, ...: see FederatedData)
    """

    def __init__(
        self,
        path: str = "data/my_images",
        image_size: int | None = None,
        color: Literal["auto", "grey", "rgb"] = "auto",
        test_fraction: float = 0.2,
        test_seed: int = 0,
        normalize: Normalize = "feature",
        num_classes: int | None = None,
        **kwargs,
    ):
        super().__init__(normalize=normalize, num_classes=num_classes, **kwargs)
        whole = isinstance(image_size, int) and not isinstance(image_size, bool)
        if image_size is not None and (not whole or image_size < 1):
            raise ConfigError(f"image_size must be a positive number of pixels, got {image_size!r}.")
        self.path, self.image_size, self.color = Path(path), image_size, color
        self.test_fraction, self.test_seed = test_fraction, test_seed
        self.classes: list[str] = []

    def load(self) -> DataArrays:
        train_dir, test_dir = self.path / "train", self.path / "test"
        if not train_dir.is_dir():
            raise ConfigError(
                f"{train_dir} is not a folder; put one folder of images per class there ({train_dir}/<class>/"
                f"<image>.png, and the test images in {test_dir}/<class>/), or give the folder as data.init_args.path."
            )
        self.classes = sorted(p.name for p in train_dir.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not self.classes:
            raise ConfigError(f"{train_dir} holds no class folders; put each class's images in {train_dir}/<class>/.")
        train = self._files(train_dir, require_all=True)
        test = self._files(test_dir, require_all=False) if test_dir.is_dir() else []
        if test_dir.is_dir() and not test:
            raise ConfigError(
                f"{test_dir} holds no images in class folders; put them in {test_dir}/<class>/, or remove the folder "
                "to hold out test_fraction of the training images instead."
            )
        images = self._read([path for path, _ in train + test])
        labels = np.array([label for _, label in train + test], dtype=np.int64)
        x, y = images[: len(train)], labels[: len(train)]
        if test:
            tx, ty = images[len(train) :], labels[len(train) :]
        else:
            keep, held = held_out(y, self.test_fraction, self.test_seed, str(train_dir))
            x, y, tx, ty = x[keep], y[keep], x[held], y[held]
        return DataArrays(
            as_examples(x, "NHWC", f"{train_dir}'s images"),
            torch.from_numpy(y),
            as_examples(tx, "NHWC", f"{test_dir}'s images"),
            torch.from_numpy(ty),
            num_classes=self.given_classes or len(self.classes),
        )

    def _files(self, folder: Path, require_all: bool) -> list[tuple[Path, int]]:
        """(image, label) of every image file under ``folder``'s class folders, in sorted order."""
        others = sorted(p.name for p in folder.iterdir() if p.is_dir() and p.name not in self.classes)
        if others:
            raise ConfigError(
                f"{folder} has a class folder {others[0]!r} that {self.path / 'train'} has not; every test class "
                "must be a training class."
            )
        files = []
        for label, name in enumerate(self.classes):
            found = sorted(p for p in (folder / name).glob("*") if p.suffix.lower() in EXTENSIONS)
            if require_all and not found:
                raise ConfigError(
                    f"{folder / name} holds no images ({', '.join(EXTENSIONS)}); remove the folder or add its images."
                )
            files += [(path, label) for path in found]
        return files

    def _read(self, paths: list[Path]) -> np.ndarray:
        """The images as uint8 ``[N, H, W, C]``: one size (or resized to ``image_size``), one colour mode.

        A first pass reads only the headers (size and mode: a huge image is refused before it is decoded), so
        the colour mode is known before any image is converted, and one image at a time is held decoded."""
        from PIL import Image

        first, modes = None, set()
        for path in paths:
            with sources.reading(path, "an image", None, self.path), Image.open(path) as image:
                if self.image_size is None and first is not None and image.size != first[1]:
                    raise ConfigError(
                        f"{path} is {image.size[0]}x{image.size[1]} pixels but {first[0]} is "
                        f"{first[1][0]}x{first[1][1]}; give image_size to resize them all to one size."
                    )
                first, mode = first or (path, image.size), image.mode
                modes.add(mode)
        grey = self.color == "grey" or (self.color == "auto" and modes <= set(GREY))
        size = (self.image_size, self.image_size) if self.image_size else None
        arrays = []
        for path in paths:
            with sources.reading(path, "an image", None, self.path), Image.open(path) as image:
                arrays.append(image_pixels(image, grey, size))
        return np.stack(arrays)


def image_pixels(image: Any, grey: bool, size: tuple[int, int] | None) -> np.ndarray:
    """A PIL image as uint8 ``[H, W, C]``: greyscale (C = 1) or RGB, resized (bilinear) to ``size`` when given."""
    from PIL import Image

    picture = image.convert("L" if grey else "RGB")
    if size is not None and picture.size != size:
        picture = picture.resize(size, Image.Resampling.BILINEAR)
    pixels = np.asarray(picture, dtype=np.uint8)
    return pixels[:, :, None] if grey else pixels
