"""A data set from Hugging Face ``datasets``: a Hub data set at a pinned commit, a copy saved with ``save_to_disk``,
or a local folder of data files, with the input and label columns named in the recipe."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from ..federation.errors import ConfigError
from .federated import DataArrays
from .image_folder import GREY, image_pixels
from .imdb import build_vocab, encode
from .own import Normalize, OwnData, as_examples, held_out, label_ids

COMMIT = re.compile(r"[0-9a-f]{40}")
Kind = Literal["image", "text", "features"]


class HubData(OwnData):
    """Examples from a Hugging Face ``datasets`` data set: images, text or numeric features, and a label column.

    Give either ``name`` (a Hub data set, read at ``revision``, a commit, so that every run reads the same
    files; offline once it is in the cache: ``HF_HUB_OFFLINE=1``) or ``path`` (a copy saved with
    ``Dataset.save_to_disk`` / ``DatasetDict.save_to_disk``, or a folder of data files that
    ``datasets.load_dataset`` reads: Parquet, CSV, JSON, an image folder).

    The input is one ``image`` column (PIL images, decoded by ``datasets``), one ``text`` column (tokenised into
    word ids: a vocabulary of the training split's ``vocab_size - 2`` commonest words, 0 padding, 1 unknown,
    ``max_length`` tokens per example) or the numeric ``features`` columns (numbers or lists of numbers); by
    default the data set's one image column, else its one text column, else its numeric columns. Labels are a
    ``ClassLabel`` (its names become ``classes``), integer indices or names (sorted).

    Args:
        name: the Hub data set (``owner/name``).
        revision: the commit (40 hex digits) of ``name`` to read.
        path: a local copy instead of ``name``.
        config: the data set's configuration (subset), if it has several.
        label: the label column.
        image: the image column.
        text: the text column.
        features: the numeric feature columns.
        train_split: the split that is the training pool.
        test_split: the split that is the global test set; ``None`` (or a data set without splits) holds out
            ``test_fraction`` of each class of the training split with ``test_seed``.
        test_fraction: the share of each class held out when there is no test split.
        test_seed: the seed of that hold-out.
        cache_dir: where ``datasets`` caches a Hub data set (its default: ``~/.cache/huggingface/datasets``).
        image_size: resize every image to this height and width; by default all must have one size.
        color: ``auto`` (one channel when every image is greyscale, else RGB), ``grey`` or ``rgb``.
        vocab_size: word ids of a text column, padding and unknown included (builders taking ``vocab_size``
            get it).
        max_length: tokens kept per text.
        (normalize, num_classes: see OwnData; partitioner, server_fraction, local_split, ...: see FederatedData)
    """

    def __init__(
        self,
        name: str | None = None,
        revision: str | None = None,
        path: str | None = None,
        config: str | None = None,
        label: str = "label",
        image: str | None = None,
        text: str | None = None,
        features: list[str] | None = None,
        train_split: str = "train",
        test_split: str | None = "test",
        test_fraction: float = 0.2,
        test_seed: int = 0,
        cache_dir: str | None = None,
        image_size: int | None = None,
        color: Literal["auto", "grey", "rgb"] = "auto",
        vocab_size: int = 20_000,
        max_length: int = 256,
        normalize: Normalize = "feature",
        num_classes: int | None = None,
        **kwargs,
    ):
        super().__init__(normalize=normalize, num_classes=num_classes, **kwargs)
        if (name is None) == (path is None):
            raise ConfigError(
                "HubData needs either name (a Hub data set, with its revision) or path (a local copy), not "
                f"{'both' if name else 'neither'}."
            )
        if name is not None and (revision is None or not COMMIT.fullmatch(revision)):
            raise ConfigError(
                f"HubData's revision must be the commit (40 hex digits) of {name} to read, so that every run reads "
                f"the same files, got {revision!r}; the data set's page lists its commits under 'Files and versions'."
            )
        if sum(given is not None for given in (image, text, features)) > 1:
            raise ConfigError("give one input of HubData: image, text or features, not several.")
        if features is not None and not features:
            raise ConfigError("features must name at least one column; leave it out to use every numeric column.")
        for key, value in (("vocab_size", vocab_size), ("max_length", max_length)):
            if isinstance(value, bool) or not isinstance(value, int) or value < (3 if key == "vocab_size" else 1):
                raise ConfigError(f"{key} must be a whole number (vocab_size at least 3), got {value!r}.")
        self.name, self.revision, self.path, self.config = name, revision, path, config
        self.label, self.image, self.text, self.features = label, image, text, features
        self.train_split, self.test_split = train_split, test_split
        self.test_fraction, self.test_seed, self.cache_dir = test_fraction, test_seed, cache_dir
        self.image_size, self.color, self.vocab_size, self.max_length = image_size, color, vocab_size, max_length
        self.classes: list[str] | None = None
        self.kind: Kind | None = None
        self._grey = False  # images read as one channel: decided on the training split, kept for the test split

    @property
    def source(self) -> str:
        return f"the Hub data set {self.name} at {self.revision}" if self.name else str(self.path)

    def load(self) -> DataArrays:
        splits = self._open()
        if self.train_split not in splits:
            raise ConfigError(
                f"{self.source} has no split {self.train_split!r} (its splits: {', '.join(splits)}); name it with "
                "train_split."
            )
        train = splits[self.train_split]
        test = None
        if self.test_split is not None and len(splits) > 1:
            if self.test_split not in splits:
                raise ConfigError(
                    f"{self.source} has no split {self.test_split!r} (its splits: {', '.join(splits)}); name it with "
                    "test_split, or set test_split: null to hold out test_fraction of the training split."
                )
            test = splits[self.test_split]
        self.kind, columns = self._inputs(train)
        y, self.classes = self._labels(train, None)
        x = self._examples(train, columns, fit=True)
        if test is None:
            keep, held = held_out(y, self.test_fraction, self.test_seed, self.source)
            x, tx, y, ty = x[keep], x[held], y[keep], y[held]
        else:
            absent = [c for c in [self.label, *columns] if c not in test.column_names]
            if absent:
                raise ConfigError(f"{self.source}'s split {self.test_split!r} has no column {absent[0]!r}.")
            ty, _ = self._labels(test, self.classes)
            tx = self._examples(test, columns, fit=False)
        x_t, tx_t = (
            (torch.from_numpy(x), torch.from_numpy(tx))
            if self.kind == "text"
            else (as_examples(x, "NHWC" if self.kind == "image" else "auto", f"{self.source}'s inputs"),
                  as_examples(tx, "NHWC" if self.kind == "image" else "auto", f"{self.source}'s inputs"))
        )  # fmt: skip
        count = self.given_classes or (len(self.classes) if self.classes else self.class_count(y, ty))
        return DataArrays(x_t, torch.from_numpy(y), tx_t, torch.from_numpy(ty), num_classes=count)

    def input_sizes(self) -> dict[str, int]:
        """As every data set's, and for text the vocabulary, for the builders that embed word ids."""
        sizes = super().input_sizes()
        return {**sizes, "vocab_size": self.vocab_size} if self.kind == "text" else sizes

    # ------------------------------------------------------------------ reading
    def _open(self) -> dict[str, Any]:
        """The data set's splits by name (a data set without splits is one named ``train_split``)."""
        try:
            import datasets
        except ImportError:
            raise ConfigError("HubData needs the datasets package: pip install datasets.") from None
        try:
            if self.path is not None:
                local = Path(self.path)
                if not local.exists():
                    raise ConfigError(
                        f"{local} does not exist; save the data set there with save_to_disk, or put its data files "
                        "there, or give name and revision to read it from the Hub."
                    )
                saved = (local / "dataset_dict.json").is_file() or (local / "state.json").is_file()
                loaded = (
                    datasets.load_from_disk(str(local))
                    if saved
                    else datasets.load_dataset(str(local), self.config, cache_dir=self.cache_dir)
                )
            else:
                loaded = datasets.load_dataset(self.name, self.config, revision=self.revision, cache_dir=self.cache_dir)
        except ConfigError:
            raise
        except Exception as err:  # noqa: BLE001 - datasets raises many types for one cause: it cannot be read
            first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            fix = (
                "check the folder (a save_to_disk copy or data files)"
                if self.path is not None
                else "check the name and revision; offline, load it once on a machine with internet (the same "
                "cache_dir), or save it with save_to_disk there and give its path"
            )
            raise ConfigError(f"{self.source} could not be loaded ({type(err).__name__}: {first}); {fix}.") from None
        if isinstance(loaded, datasets.DatasetDict):
            return dict(loaded)
        return {self.train_split: loaded}

    def _inputs(self, split: Any) -> tuple[Kind, list[str]]:
        """What the examples are and from which columns: the recipe's, else the one image column, else the one
        text column, else the numeric columns."""
        import datasets

        features = split.features
        if self.label not in features:
            raise ConfigError(
                f"{self.source} has no label column {self.label!r} (its columns: {', '.join(features)}); name it "
                "with label."
            )
        named = {"image": self.image, "text": self.text}
        for kind, column in named.items():
            if column is not None:
                if column not in features:
                    raise ConfigError(
                        f"{self.source} has no {kind} column {column!r} (its columns: {', '.join(features)})."
                    )
                return kind, [column]  # type: ignore[return-value]
        if self.features is not None:
            absent = [c for c in self.features if c not in features]
            if absent:
                raise ConfigError(
                    f"{self.source} has no feature column {absent[0]!r} (its columns: {', '.join(features)})."
                )
            return "features", list(self.features)
        others = {name: f for name, f in features.items() if name != self.label}
        images = [name for name, f in others.items() if isinstance(f, datasets.Image)]
        texts = [name for name, f in others.items() if _is_text(f)]
        for kind, found in (("image", images), ("text", texts)):
            if len(found) > 1:
                raise ConfigError(
                    f"{self.source} has {len(found)} {kind} columns ({', '.join(found)}); name the one to read with "
                    f"{kind}: <column>."
                )
            if found:
                return kind, found  # type: ignore[return-value]
        numeric = [name for name, f in others.items() if not _is_text(f)]
        if not numeric:
            raise ConfigError(f"{self.source} has no input column besides the label {self.label!r}.")
        return "features", numeric

    def _labels(self, split: Any, names: list[str] | None) -> tuple[np.ndarray, list[str] | None]:
        import datasets

        feature = split.features[self.label]
        where = f"{self.source}'s column {self.label!r}"
        if isinstance(feature, datasets.ClassLabel):
            return label_ids(np.asarray(split[self.label]), where)[0], list(feature.names)
        labels, classes = label_ids(np.asarray(split[self.label], dtype=object), where, text=True, names=names)
        return labels, classes if classes is not None else names

    def _examples(self, split: Any, columns: list[str], fit: bool) -> np.ndarray:
        """The inputs of ``split``: uint8 ``[N, H, W, C]`` images, int64 ``[N, max_length]`` word ids or float32
        ``[N, F]`` features (``fit``: the training split, whose words make the vocabulary)."""
        where = f"{self.source}'s column {columns[0]!r}"
        if self.kind == "image":
            pictures = split[columns[0]]
            if any(not hasattr(p, "convert") for p in pictures):
                raise ConfigError(f"{where} holds values that are not images (PIL images, as datasets decodes them).")
            sizes = {p.size for p in pictures}
            if self.image_size is None and len(sizes) > 1:
                shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes)[:3])
                raise ConfigError(
                    f"{where} holds images of {len(sizes)} sizes ({shown}); give image_size to resize them all to one "
                    "size."
                )
            if fit:
                self._grey = self.color == "grey" or (self.color == "auto" and all(p.mode in GREY for p in pictures))
            size = (self.image_size, self.image_size) if self.image_size else None
            return np.stack([image_pixels(p, self._grey, size) for p in pictures])
        if self.kind == "text":
            texts = split[columns[0]]
            if any(not isinstance(t, str) for t in texts):
                raise ConfigError(f"{where} holds values that are not text.")
            if fit:
                self.vocab = build_vocab(texts, self.vocab_size)
            return encode(texts, self.vocab, self.max_length).numpy()
        parts = []
        for column in columns:
            try:
                values = np.asarray(split[column], dtype=np.float32)
            except (TypeError, ValueError):
                raise ConfigError(
                    f"{self.source}'s column {column!r} is not numbers (or lists of numbers of one length); name the "
                    "input columns with image, text or features."
                ) from None
            parts.append(values if values.ndim > 1 else values[:, None])
        if len(parts) == 1:  # one column keeps its shape: an array of pixels stays an image
            return parts[0]
        return np.concatenate([part.reshape(len(part), -1) for part in parts], axis=1)


def _is_text(feature: Any) -> bool:
    import datasets

    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string")
