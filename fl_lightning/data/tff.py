"""TensorFlow Federated's h5 data sets: Federated CIFAR-100 (500 clients) and StackOverflow.

Files keep TFF's layout (``examples/<client id>/<feature>``) and are read with h5py; with ``download``
the archives are fetched over https, checked against TFF's published SHA-256 and unpacked with a path
filter (:mod:`fl_lightning.data.sources`, as ``flrun data fetch``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from ..federation.errors import ConfigError
from . import sources
from .arrays import class_labels, uint8_pixels
from .federated import DataArrays, FederatedData
from .partition import NaturalIdPartitioner
from .transforms import CropFlip
from .vision import CIFAR_MEAN, CIFAR_STD

OUTSIDE_USERS = "outside_users"  # StackOverflow distillation_texts: posts of training users no client holds


def require(path: Path, download: bool, name: str) -> Path:
    """``path`` of data set ``name`` (``fed_cifar100`` or ``stackoverflow``), fetched first with ``download``;
    one sentence naming the expected files and ``flrun data fetch`` when it is missing."""
    if not path.is_file():
        sources.ensure(name, path.parent.parent, download)
    return path


class FedCifar100Data(FederatedData):
    """Federated CIFAR-100 (TFF's Pachinko split: 500 training clients of 100 images, 100 test clients).

    Each training client is one natural client (``NaturalIdPartitioner`` samples ``num_clients`` of
    them); the test clients' images form the global test set. Normalisation and crop / flip as FedJAX
    (one crop and flip per batch, ``augment_per_example: false``; paper 002).
    """

    default_partitioner = NaturalIdPartitioner

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = False,
        augment: bool = True,
        augment_per_example: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.root, self.download = Path(data_dir) / "fed_cifar100", download
        self.augment_train, self.augment_per_example = augment, augment_per_example

    @property
    def augmentation(self) -> CropFlip | None:
        return CropFlip(per_example=self.augment_per_example) if self.augment_train else None

    def load(self) -> DataArrays:
        import h5py

        parts = []
        for split in ("train", "test"):
            path = require(self.root / f"fed_cifar100_{split}.h5", self.download, "fed_cifar100")
            with sources.reading(path, "a TFF h5 file", "fed_cifar100", self.root.parent):
                with h5py.File(path, "r") as f:
                    clients, client_images, labels = _client_arrays(f["examples"])
                images = np.concatenate(client_images)
            x = torch.from_numpy(images).float().div_(255).permute(0, 3, 1, 2)
            groups = np.concatenate([[c] * len(client_labels) for c, client_labels in zip(clients, labels)])
            m, s = torch.tensor(CIFAR_MEAN).view(1, 3, 1, 1), torch.tensor(CIFAR_STD).view(1, 3, 1, 1)
            parts.append(((x - m) / s, torch.from_numpy(np.concatenate(labels)).long().flatten(), groups))
        (x, y, groups), (tx, ty, _) = parts
        return DataArrays(x.contiguous(), y, tx.contiguous(), ty, groups=groups, num_classes=100)


FED_CIFAR100_IMAGES = 60_000  # TFF's 50,000 training and 10,000 test images


def _client_arrays(examples) -> tuple[list[str], list[np.ndarray], list[np.ndarray]]:
    """Every client's images ``[n, 32, 32, 3]`` and labels ``[n]`` of an h5 file's ``examples`` group, the
    shapes it declares checked before a byte is read: a small file may declare terabytes of fill values."""
    clients = sorted(examples)
    if not clients:
        raise ValueError("its examples group holds no client")
    shapes = {c: (examples[c]["image"].shape, examples[c]["label"].size) for c in clients}
    for client, (shape, labels) in shapes.items():
        if tuple(shape[1:]) != (32, 32, 3) or labels != shape[0]:
            raise ValueError(f"client {client}: images {shape} and {labels} labels, not [N, 32, 32, 3] and N labels")
    declared = sum(shape[0] for shape, _ in shapes.values())
    if declared > FED_CIFAR100_IMAGES:
        raise ValueError(f"its clients declare {declared:,} images, more than Federated CIFAR-100's 60,000")
    images = [_client_images(examples[c]["image"][()], c) for c in clients]
    return clients, images, [_client_labels(examples[c]["label"][()], c) for c in clients]


def _client_images(images: np.ndarray, client: str) -> np.ndarray:
    """A client's images as TFF stores them, uint8 pixels: float images (already in [0, 1], say) would be
    divided by 255 a second time, so every value that is not a whole number 0..255 is refused."""
    try:
        return uint8_pixels(images)
    except ValueError as err:
        raise ValueError(f"client {client}: {err}") from None


def _client_labels(labels: np.ndarray, client: str) -> np.ndarray:
    try:
        return class_labels(labels, 100)
    except ValueError as err:
        raise ValueError(f"client {client}: {err}") from None


class StackOverflowData(FederatedData):
    """StackOverflow next-word prediction (TFF): one client per user, sequences of ``sequence_length``.

    Vocabulary: the 10,000 most frequent words of TFF's word-count file; ids are padding 0, words
    1..10,000, out-of-vocabulary 10,001, beginning 10,002, end 10,003 (10,004 in all, paper 002). A post
    becomes ``[bos] + first 20 words + [eos]``, padded; inputs are ``ids[:-1]``, targets ``ids[1:]`` with
    padding targets set to -100 (ignored by the loss and the accuracy).

    Args:
        post_type: ``all``, ``question`` or ``answer`` (paper 002's domain-shifted pools).
        max_clients: users read from the training file into the client pool (see ``pool_users``); None
            reads all 342,477, which needs tens of GB.
        pool_users: which ``max_clients`` users: ``first`` in file order, or ``random``, drawn with
            ``pool_seed`` from all users of the training file (paper 002's 34,248 users are 10% of them).
        pool_seed: seed of the ``random`` draw; fixed, so that every run and recipe has the same pool.
        max_examples_per_client: posts kept per user (TFF's baseline uses 256); None keeps them all
            (paper 002's pools: Tables 3-5 count every post of the pool's users).
        test_examples: posts drawn (seeded) from the test file for the global test set.
        distillation_texts: the server's unlabeled set, unlabeled posts or documents encoded like posts.
            ``outside_users``: in-domain, posts of training-split users outside the client pool (paper
            002's in-domain distillation data, which no client holds): the first
            ``distillation_examples`` posts of those users in file order. Out-of-domain (paper 002's C4
            slice): a local ``.json[.gz]`` / ``.jsonl`` file with one ``{"text": ...}`` document per line
            (C4's own format) or a parquet file with a ``text`` column; ``hub`` reads
            ``<data_dir>/c4/c4-validation.00000-of-00008.json.gz``, the first shard of ``allenai/c4`` (en,
            validation), fetched with ``download`` or ``flrun data fetch c4``; its first
            ``distillation_examples`` documents. Replaces ``server_fraction``, which would take posts
            from the clients' users.
        distillation_revision: the ``allenai/c4`` commit to fetch and require (no commit is pinned by
            default: none could be found in public code; the fetched one is recorded in ``c4/REVISION``).
        question_clients: domain-shifted pools (paper 002 Table 2): clients ``0 .. k-1`` keep only their
            questions and the others only their answers; with contiguous tiers the first tier (the
            high-capacity pool) then holds questions, the rest answers.
        domain_test_sets: also evaluate on the questions-only and answers-only parts of the test set
            (metrics ``<role>/test_acc_questions`` and ``<role>/test_acc_answers``).
    """

    default_partitioner = NaturalIdPartitioner

    def setup(self, num_clients: int, seed: int) -> None:
        super().setup(num_clients, seed)
        if self.question_clients is None:
            return
        types = self.post_types

        def count(client, kind):
            idx = client.train[client.train < len(types)].numpy()
            return int((types[idx] == kind).sum())

        # the users with the most questions form the question pool, so that no client is left empty
        order = sorted(range(len(self.clients)), key=lambda i: -count(self.clients[i], "question"))
        questions, answers = order[: self.question_clients], order[self.question_clients :]
        empty = [i for i in questions if count(self.clients[i], "question") == 0]
        empty += [i for i in answers if count(self.clients[i], "answer") == 0]
        if empty:
            raise ConfigError(
                f"{len(empty)} clients have no posts of their pool's kind; lower question_clients or "
                "num_clients, or read more users (max_clients)."
            )
        self.clients = [self.clients[i] for i in questions + answers]
        for i, client in enumerate(self.clients):
            wanted = "question" if i < self.question_clients else "answer"
            for split in ("train", "unlabeled", "val", "test"):
                idx = getattr(client, split)
                inside = idx[idx < len(types)]  # out-of-domain server examples sit beyond the posts
                setattr(client, split, inside[torch.from_numpy(types[inside.numpy()] == wanted)])

    def __init__(
        self,
        data_dir: str = "data",
        download: bool = False,
        vocab_size: int = 10_000,
        sequence_length: int = 20,
        post_type: Literal["all", "question", "answer"] = "all",
        max_clients: int | None = 1000,
        max_examples_per_client: int | None = 256,
        test_examples: int = 10_000,
        test_seed: int = 0,
        distillation_texts: str | None = None,
        distillation_examples: int = 10_000,
        distillation_revision: str | None = None,
        question_clients: int | None = None,
        domain_test_sets: bool = False,
        pool_users: Literal["first", "random"] = "first",
        pool_seed: int = 0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.question_clients, self.domain_test_sets = question_clients, domain_test_sets
        if max_examples_per_client is not None and max_examples_per_client < 1:
            raise ConfigError(
                f"max_examples_per_client must be a positive number of posts or null (all of them), "
                f"got {max_examples_per_client}."
            )
        if test_examples < 1:
            raise ConfigError(f"test_examples must be at least 1 (the global test set's posts), got {test_examples}.")
        if distillation_texts is not None and (
            self.server_fraction > 0 or self.server_examples is not None or self.server_dataset is not None
        ):
            raise ConfigError(
                "distillation_texts replaces server_fraction, server_examples and server_dataset as the server's "
                "set; set only one."
            )
        self.pool_users, self.pool_seed = pool_users, pool_seed
        self.server_owners: np.ndarray | None = None  # the users of an outside_users server set
        self.root, self.download = Path(data_dir) / "stackoverflow", download
        self.vocab_size, self.sequence_length, self.post_type = vocab_size, sequence_length, post_type
        self.max_clients, self.max_examples_per_client = max_clients, max_examples_per_client
        self.test_examples, self.test_seed = test_examples, test_seed
        self.distillation_texts, self.distillation_examples = distillation_texts, distillation_examples
        self.distillation_revision = distillation_revision

    def load_vocab(self) -> dict[str, int]:
        path = require(self.root / "stackoverflow.word_count", self.download, "stackoverflow")
        words = []
        with sources.reading(path, "a word count file", "stackoverflow", self.root.parent), path.open() as f:
            for number, line in enumerate(f, 1):
                if not line.split():
                    raise ValueError(f"line {number} is empty, not a word and its count")
                words.append(line.split()[0])
                if len(words) == self.vocab_size:
                    break
        return {w: i + 1 for i, w in enumerate(words)}

    def encode(self, posts: Sequence[bytes | str]) -> tuple[torch.Tensor, torch.Tensor]:
        oov, bos, eos = self.vocab_size + 1, self.vocab_size + 2, self.vocab_size + 3
        ids = np.zeros((len(posts), self.sequence_length + 1), dtype=np.int64)
        for row, post in enumerate(posts):
            words = post.decode() if isinstance(post, bytes) else post
            seq = [bos] + [self.vocab.get(w, oov) for w in words.split()[: self.sequence_length]]
            if len(seq) <= self.sequence_length:
                seq.append(eos)
            ids[row, : len(seq)] = seq
        x, y = torch.from_numpy(ids[:, :-1]), torch.from_numpy(ids[:, 1:]).clone()
        y[y == 0] = -100
        return x, y

    def _read(self, path: Path, clients: list[str] | None, limit: int | None, total: int | None = None):
        """Posts, their users and kinds: at most ``limit`` per user, and with ``total`` that many in all."""
        import h5py

        posts: list[bytes] = []
        owners: list[str] = []
        types: list[str] = []
        with sources.reading(path, "a TFF h5 file", "stackoverflow", self.root.parent), h5py.File(path, "r") as f:
            names = clients if clients is not None else sorted(f["examples"])
            for name in names:
                if total is not None and len(posts) >= total:
                    break
                group = f["examples"][name]
                kinds = [k.decode() if isinstance(k, bytes) else k for k in group["type"][()]]
                pairs = [(t, k) for t, k in zip(group["tokens"][()], kinds) if self.post_type in ("all", k)]
                pairs = pairs[:limit] if limit else pairs
                pairs = pairs[: total - len(posts)] if total is not None else pairs
                posts += [t for t, _ in pairs]
                types += [k for _, k in pairs]
                owners += [name] * len(pairs)
        return posts, np.asarray(owners), np.asarray(types)

    def load(self) -> DataArrays:
        import h5py

        self.vocab = self.load_vocab()
        train_path = require(self.root / "stackoverflow_train.h5", self.download, "stackoverflow")
        with (
            sources.reading(train_path, "a TFF h5 file", "stackoverflow", self.root.parent),
            h5py.File(train_path, "r") as f,
        ):
            clients, outside = self.pool_and_outside_users(sorted(f["examples"]))
        posts, owners, self.post_types = self._read(train_path, clients, self.max_examples_per_client)
        test_path = require(self.root / "stackoverflow_test.h5", self.download, "stackoverflow")
        test_posts, _, test_types = self._read(test_path, None, None)
        rng = np.random.default_rng(self.test_seed)
        chosen = np.sort(rng.choice(len(test_posts), min(self.test_examples, len(test_posts)), replace=False))
        with sources.reading(train_path, "a TFF h5 file", "stackoverflow", self.root.parent):
            x, y = self.encode(posts)  # tokens that are not UTF-8 name their file
        with sources.reading(test_path, "a TFF h5 file", "stackoverflow", self.root.parent):
            tx, ty = self.encode([test_posts[i] for i in chosen])
        if self.domain_test_sets:  # paper 002 Table 2 reports answers-only and questions-only accuracy too
            for kind in ("question", "answer"):
                keep = torch.from_numpy(test_types[chosen] == kind)
                self.extra_tests[f"{kind}s"] = (tx[keep], ty[keep])
        arrays = DataArrays(x, y, tx, ty, groups=owners, num_classes=self.vocab_size + 4)
        if self.distillation_texts == OUTSIDE_USERS:
            self.server_dataset = _EncodedTexts(self.encode(self._outside_posts(train_path, outside))[0])
        elif self.distillation_texts is not None:
            documents = self._distillation_documents(self.distillation_texts)
            self.server_dataset = _EncodedTexts(self.encode(documents)[0])
        return arrays

    def pool_and_outside_users(self, names: list[str]) -> tuple[list[str], list[str]]:
        """The client pool's users (``max_clients`` of ``names``, chosen as ``pool_users`` says) and the
        others, both in file order."""
        if self.max_clients is None or self.max_clients >= len(names):
            return names, []
        if self.pool_users == "first":
            return names[: self.max_clients], names[self.max_clients :]
        chosen = np.zeros(len(names), dtype=bool)
        chosen[np.random.default_rng(self.pool_seed).choice(len(names), self.max_clients, replace=False)] = True
        return [n for n, c in zip(names, chosen) if c], [n for n, c in zip(names, chosen) if not c]

    def _outside_posts(self, path: Path, outside: list[str]) -> list[bytes]:
        """The first ``distillation_examples`` posts of the users outside the pool (in-domain server set)."""
        wanted = self.distillation_examples
        posts, owners, _ = self._read(path, outside, None, total=wanted)
        if len(posts) < wanted:
            raise ConfigError(
                f"distillation_texts: outside_users needs {wanted} posts of users outside the client pool, but "
                f"the {len(outside)} users outside it hold {len(posts)}; lower distillation_examples or max_clients."
            )
        self.server_owners = owners
        return posts

    def _distillation_documents(self, source: str) -> list[str]:
        """The server's texts from ``source``: ``hub`` (C4's first validation shard) or a file's path."""
        n = self.distillation_examples
        if source == "hub":  # the streamed validation split starts with this shard, in file order
            data_dir = self.root.parent
            sources.ensure("c4", data_dir, self.download, self.distillation_revision)
            path = data_dir / "c4" / "c4-validation.00000-of-00008.json.gz"
        else:
            path = Path(source)
        if not path.is_file():
            raise ConfigError(
                f"distillation_texts file {path} not found; download a C4 shard "
                "(e.g. c4-validation.00000-of-00008.json.gz) and give its path."
            )
        fetched = "c4" if self.distillation_texts == "hub" else None  # a file the user gave has no fetch command
        with sources.reading(path, "a C4 text file", fetched, self.root.parent):
            return self._read_documents(path, n)

    @staticmethod
    def _read_documents(path: Path, n: int) -> list[str]:
        """The first ``n`` documents' lower-cased text of a C4 parquet or JSON-lines (optionally gzipped) file."""
        if path.suffix == ".parquet":
            import pandas as pd

            return [_text(t, f"row {i}").lower() for i, t in enumerate(pd.read_parquet(path)["text"].tolist()[:n])]
        import gzip
        import json

        opener = gzip.open if path.suffix == ".gz" else open
        documents = []
        with opener(path, "rt") as f:
            for number, line in enumerate(f, 1):  # StackOverflow tokens are lower case
                documents.append(_text(json.loads(line)["text"], f"line {number}").lower())
                if len(documents) == n:
                    break
        return documents


def _text(value: object, where: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"the text of {where} is {type(value).__name__}, not a string")
    return value


class _EncodedTexts(FederatedData):
    """Already-encoded server examples handed to ``FederatedData.server_dataset``."""

    def __init__(self, x: torch.Tensor):
        super().__init__()
        self._x = x

    def load(self) -> DataArrays:
        return DataArrays(self._x, torch.zeros(len(self._x), dtype=torch.long), self._x[:0], torch.zeros(0))
