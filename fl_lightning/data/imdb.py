"""IMDB sentiment (25k train / 25k test reviews, plus 50k unlabeled) with a locally built vocabulary."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from . import sources
from .arrays import class_labels
from .federated import DataArrays, FederatedData

TOKEN = re.compile(r"[a-z0-9']+")


def tokenize(text: str) -> list[str]:
    """Lower-case word tokens; HTML line breaks become spaces."""
    return TOKEN.findall(text.lower().replace("<br />", " "))


def build_vocab(texts: list[str], size: int) -> dict[str, int]:
    """The ``size - 2`` most frequent words (ties broken alphabetically) -> ids 2..; 0 is padding, 1 unknown."""
    counts = Counter(word for text in texts for word in tokenize(text))
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[: size - 2]
    return {word: i + 2 for i, (word, _) in enumerate(ranked)}


def encode(texts: list[str], vocab: dict[str, int], length: int) -> torch.Tensor:
    """``[N, length]`` ids: the first ``length`` tokens, right-padded with 0."""
    out = np.zeros((len(texts), length), dtype=np.int64)
    for row, text in enumerate(texts):
        ids = [vocab.get(word, 1) for word in tokenize(text)[:length]]
        out[row, : len(ids)] = ids
    return torch.from_numpy(out)


class ImdbData(FederatedData):
    """IMDB from the parquet files of ``stanfordnlp/imdb`` (``<data_dir>/imdb/{train,test,unsupervised}-*.parquet``),
    fetched at a pinned commit by ``flrun data fetch imdb`` or ``download``.

    The vocabulary is built from the training reviews (no tokenizer download). With
    ``use_unsupervised`` the 50k unlabeled reviews are shared IID among clients as unlabeled data
    (paper 001), in addition to any ``unlabeled_fraction`` of the labeled reviews.

    Args:
        download: fetch the parquet files (pinned commit, checked against the Hub's SHA-256) when absent.
        vocab_size: ids including padding (0) and unknown (1).
        max_length: tokens kept per review.
    """

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = True,
        vocab_size: int = 20_000,
        max_length: int = 256,
        use_unsupervised: bool = True,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.data_dir, self.download = Path(data_dir), download
        self.vocab_size, self.max_length, self.use_unsupervised = vocab_size, max_length, use_unsupervised

    def _split(self, name: str):
        import pandas as pd

        tables = []
        for path in sorted((self.data_dir / "imdb").glob(f"{name}-*.parquet")):
            with sources.reading(path, "an IMDB parquet file", "imdb", self.data_dir):
                tables.append(pd.read_parquet(path, columns=["text", "label"]))
                if not all(isinstance(text, str) for text in tables[-1]["text"]):
                    raise TypeError("its text column holds values that are not strings")
                if not pd.api.types.is_integer_dtype(tables[-1]["label"]):
                    raise TypeError(f"its label column is {tables[-1]['label'].dtype}, not integers")
                if name != "unsupervised":  # whose labels are all -1
                    class_labels(tables[-1]["label"].to_numpy(), 2)
        return pd.concat(tables, ignore_index=True)

    def load(self) -> DataArrays:
        sources.ensure("imdb", self.data_dir, self.download)
        train, test = self._split("train"), self._split("test")
        self.vocab = build_vocab(train["text"].tolist(), self.vocab_size)
        unlabeled = None
        if self.use_unsupervised:
            unlabeled = encode(self._split("unsupervised")["text"].tolist(), self.vocab, self.max_length)
        return DataArrays(
            encode(train["text"].tolist(), self.vocab, self.max_length),
            torch.as_tensor(train["label"].to_numpy().copy(), dtype=torch.long),
            encode(test["text"].tolist(), self.vocab, self.max_length),
            torch.as_tensor(test["label"].to_numpy().copy(), dtype=torch.long),
            num_classes=2,
            unlabeled_x=unlabeled,
        )
