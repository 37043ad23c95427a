"""FederatedData: a data set held as tensors in memory plus per-client index sets.

Subclasses only implement :meth:`FederatedData.load` (the raw arrays); the split into a server
(public / distillation) set, client partitions, labeled / unlabeled parts and local train / val / test
splits is common and lives here.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from ..federation.errors import ConfigError
from ..federation.user_code import calling
from .arrays import DataArrays, check_arrays, check_features
from .partition import IidPartitioner, Partitioner
from .transforms import CropFlip


@dataclass
class ClientData:
    """Index sets (into the pool ``FederatedData.x``) of one client.

    ``train`` is labeled local training data; ``unlabeled`` has its labels withheld from training;
    ``val`` and ``test`` are the local splits used to evaluate personalized models.
    """

    train: Tensor
    unlabeled: Tensor
    val: Tensor
    test: Tensor


class FederatedData:
    """Base class of federated data sets.

    Args:
        partitioner: how the pool is split among clients (IID, Dirichlet, pathological, natural id).
        server_fraction: share of the pool held back as the server's unlabeled public / distillation set.
        unlabeled_fraction: share of each client's local training data whose labels are withheld.
        local_split: fractions (train, val, test) of each client's data; e.g. [0.8, 0.1, 0.1] for
            personalized evaluation as in FedGH. [1, 0, 0] keeps all local data for training.
        partition_seed: seed of the split; ``None`` uses the run's seed. Fix it to compare seeds of
            training on one partition.
        server_dataset: another data set whose training images become the server's unlabeled set
            (out-of-domain distillation: CIFAR-10 for CIFAR-100 in paper 002); its labels are dropped.
            Replaces ``server_fraction``.
        server_examples: size of a server set drawn at random from the pool examples that the partition
            gives to no client, so that every client keeps all of its data (paper 002: 13,500 of the
            18,500 images of the 185 Federated CIFAR-100 clients outside the 315-client pool). Needs a
            partition that leaves examples over (natural ids with fewer clients than ids); replaces
            ``server_fraction``, which takes its share of the pool before the partition.
        pool_test_set: the published test set joins the training pool before the partition, and the global
            test set becomes every client's local test split, pooled (PFLlib's generator, HtFLlib's data:
            CIFAR's 60,000 images split among the clients, each client's split 75 / 25 into train / test).
            Needs a local test share and a data set partitioned by label.
    """

    default_partitioner: type[Partitioner] = IidPartitioner  # natural-id data sets default to one client per id

    def __init__(
        self,
        partitioner: Partitioner | None = None,
        server_fraction: float = 0.0,
        unlabeled_fraction: float = 0.0,
        local_split: tuple[float, float, float] = (1.0, 0.0, 0.0),
        partition_seed: int | None = None,
        server_dataset: FederatedData | None = None,
        server_examples: int | None = None,
        pool_test_set: bool = False,
    ):
        self.partitioner = partitioner or self.default_partitioner()
        self.server_dataset = server_dataset
        self.extra_tests: dict[str, tuple[Tensor, Tensor]] = {}  # more named test sets (per-domain test splits)
        for name, value in (("server_fraction", server_fraction), ("unlabeled_fraction", unlabeled_fraction)):
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"{name} must be in [0, 1), got {value}.")
        if len(local_split) != 3 or min(local_split) < 0 or abs(sum(local_split) - 1.0) > 1e-6 or local_split[0] <= 0:
            raise ConfigError(
                f"local_split must be three non-negative fractions (train, val, test) summing to 1 "
                f"with a positive train share, got {list(local_split)}."
            )
        if server_examples is not None:
            if isinstance(server_examples, bool) or not isinstance(server_examples, int) or server_examples < 1:
                raise ConfigError(f"server_examples must be a positive number of examples, got {server_examples!r}.")
            if server_fraction > 0 or server_dataset is not None:
                raise ConfigError(
                    "server_examples replaces server_fraction and server_dataset; set only one of the three."
                )
        if pool_test_set and local_split[2] <= 0:
            raise ConfigError(
                "pool_test_set puts the test set into the clients' data, so each client needs a local test split; "
                "give local_split a test share, e.g. [0.75, 0.0, 0.25]."
            )
        self.pool_test_set = pool_test_set
        self.server_fraction = server_fraction
        self.server_examples = server_examples
        self.unlabeled_fraction = unlabeled_fraction
        self.local_split = tuple(local_split)
        self.partition_seed = partition_seed
        self.clients: list[ClientData] = []

    # ------------------------------------------------------------------ to override
    def load(self) -> DataArrays:
        """Returns the raw arrays; subclasses read local files or download them."""
        raise NotImplementedError

    @property
    def augmentation(self) -> CropFlip | None:
        """Training-time augmentation of a batch (none by default; the CIFAR-like data sets crop and flip)."""
        return None

    def augment(self, x: Tensor, generator: torch.Generator) -> Tensor:
        """``augmentation`` applied to a batch with the client's generator. A subclass may override this
        instead of ``augmentation`` (the batched executor then augments client by client)."""
        return x if self.augmentation is None else self.augmentation(x, generator)

    # ------------------------------------------------------------------ common splitting
    def setup(self, num_clients: int, seed: int) -> None:
        """Loads the arrays and builds every client's index sets, deterministically from the seed."""
        arrays = _loaded(self)
        self.num_classes = check_arrays(arrays, type(self).__name__)  # the door: one sentence, never a traceback
        if self.pool_test_set:
            arrays = self._with_test_pooled(arrays)
        self.x, self.y = arrays.x, arrays.y.long()
        self.test_x, self.test_y = arrays.test_x, arrays.test_y.long()
        self.groups = arrays.groups
        rng = np.random.default_rng(self.partition_seed if self.partition_seed is not None else seed)
        # sequence targets (language modelling) are partitioned by natural id; their first token stands in
        labels = (self.y if self.y.dim() == 1 else self.y[:, 0]).numpy()

        pool = np.arange(len(labels))
        self.server_idx = torch.empty(0, dtype=torch.long)
        if self.server_fraction > 0:
            if self.y.dim() == 1:
                server = _stratified_take(labels, self.server_fraction, rng)
            else:  # sequences have no class to stratify by
                server = rng.choice(len(labels), int(round(len(labels) * self.server_fraction)), replace=False)
            if len(server) == 0:
                raise ConfigError(
                    f"server_fraction {self.server_fraction} leaves no server examples of the {len(labels):,}; "
                    "raise it, e.g. 0.1."
                )
            self.server_idx = torch.from_numpy(np.sort(server))
            pool = np.setdiff1d(pool, server)
        if self.server_dataset is not None:
            outside = _loaded(self.server_dataset).x
            check_features(outside, f"server_dataset {type(self.server_dataset).__name__}'s examples")
            if outside.shape[1:] != self.x.shape[1:]:
                raise ConfigError(
                    f"server_dataset examples have shape {tuple(outside.shape[1:])}, the federated data "
                    f"{tuple(self.x.shape[1:])}; they must match."
                )
            self.server_idx = torch.arange(len(self.x), len(self.x) + len(outside))
            self.x = torch.cat([self.x, outside])
            self.y = torch.cat([self.y, torch.full((len(outside),) + tuple(self.y.shape[1:]), -100, dtype=torch.long)])
        groups = arrays.groups[pool] if arrays.groups is not None else None
        parts = self.partitioner(labels[pool], num_clients, rng, groups=groups)
        self.clients = [self._split_client(pool[part], rng) for part in parts]
        self._require_training_examples()
        self._require_requested_splits()
        if self.pool_test_set:  # the clients' local test splits, together, stand in for the global test set
            tests = torch.cat([client.test for client in self.clients])
            self.test_x, self.test_y = self.x[tests], self.y[tests]
        if self.server_examples is not None:  # drawn after the clients, who are then as without a server set
            self.server_idx = self._draw_unassigned(pool, parts, rng, self.server_examples)
        if arrays.unlabeled_x is not None:  # appended to the pool, shared IID as every client's unlabeled data
            start = len(self.x)
            self.x = torch.cat([self.x, arrays.unlabeled_x])
            self.y = torch.cat([self.y, torch.full((len(arrays.unlabeled_x),), -100, dtype=torch.long)])
            extra = np.array_split(rng.permutation(np.arange(start, len(self.x))), len(self.clients))
            for client, more in zip(self.clients, extra):
                client.unlabeled = torch.cat([client.unlabeled, torch.from_numpy(np.sort(more)).long()])

    def _with_test_pooled(self, arrays: DataArrays) -> DataArrays:
        """``arrays`` with the test set appended to the training pool (``pool_test_set``)."""
        if arrays.groups is not None:
            raise ConfigError(
                f"pool_test_set needs a data set partitioned by label; {type(self).__name__}'s clients are its "
                "natural ids, whose test set has none: leave pool_test_set out."
            )
        return dataclasses.replace(
            arrays, x=torch.cat([arrays.x, arrays.test_x]), y=torch.cat([arrays.y, arrays.test_y.to(arrays.y.dtype)])
        )

    def _require_training_examples(self) -> None:
        """A client without a training example could never train (FedAvg would weigh its update by 0): refused."""
        empty = [i for i, client in enumerate(self.clients) if len(client.train) == 0]
        if empty:
            shown = ", ".join(map(str, empty[:5])) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
            raise ConfigError(
                f"the partition leaves {len(empty)} of {len(self.clients)} clients without a training example "
                f"(client {shown}); raise the partitioner's min_partition_size or alpha, lower local_split's val "
                "and test shares, or use fewer clients."
            )

    def _require_requested_splits(self) -> None:
        """A local val / test share or an unlabeled share that rounds to no example on any client is refused
        (the share does nothing: a mistake). A client left without a local split that the method evaluates on
        is refused by the strategy's setup (``strategies/base.py``); one that no method reads may stay empty."""
        for name, share in (("val", self.local_split[1]), ("test", self.local_split[2])):
            if share > 0 and not any(len(getattr(client, name)) for client in self.clients):
                largest = max(len(c.train) + len(c.val) + len(c.test) for c in self.clients)
                raise ConfigError(
                    f"local_split {list(self.local_split)} leaves every client no local {name} examples (the "
                    f"largest holds {largest}); raise the {name} share (e.g. [0.8, 0.1, 0.1]) "
                    "or give clients more examples."
                )
        if self.unlabeled_fraction > 0 and not any(len(client.unlabeled) for client in self.clients):
            raise ConfigError(
                f"unlabeled_fraction {self.unlabeled_fraction} leaves no client an unlabeled example; raise it, "
                "e.g. 0.5."
            )

    def _draw_unassigned(
        self, pool: np.ndarray, parts: list[np.ndarray], rng: np.random.Generator, count: int
    ) -> Tensor:
        """``count`` (``server_examples``) indices drawn at random from the pool examples that no client holds."""
        held = np.zeros(len(pool), dtype=bool)
        for part in parts:
            held[part] = True
        unassigned = pool[~held]
        if len(unassigned) < count:
            raise ConfigError(
                f"server_examples={count} but the partition leaves only {len(unassigned)} examples "
                "to no client; lower server_examples or num_clients, or use server_fraction with a partition "
                "that gives every example to a client (IID, Dirichlet)."
            )
        return torch.from_numpy(np.sort(rng.choice(unassigned, count, replace=False))).long()

    def _split_client(self, idx: np.ndarray, rng: np.random.Generator) -> ClientData:
        idx = rng.permutation(idx)
        n_val = int(round(len(idx) * self.local_split[1]))
        n_test = int(round(len(idx) * self.local_split[2]))
        train, val, test = np.split(idx, [len(idx) - n_val - n_test, len(idx) - n_test])
        n_unlabeled = int(round(len(train) * self.unlabeled_fraction))
        unlabeled, train = train[:n_unlabeled], train[n_unlabeled:]

        def as_tensor(a):
            return torch.from_numpy(np.sort(a)).long()

        return ClientData(as_tensor(train), as_tensor(unlabeled), as_tensor(val), as_tensor(test))

    def input_sizes(self) -> dict[str, int]:
        """The model input sizes the examples fix, passed to every builder that takes them and whose recipe does not
        set them: ``in_channels`` (an image's channels, 1 for other examples), ``in_features`` (the values of one
        example, flattened: an MLP's input) and, for square images, ``image_size``."""
        x = self.x
        sizes = {"in_channels": int(x.shape[1]) if x.dim() == 4 else 1, "in_features": int(x[0].numel())}
        if x.dim() == 4 and x.shape[2] == x.shape[3]:
            sizes["image_size"] = int(x.shape[2])
        return sizes

    def to(self, device: torch.device | str) -> None:
        """Moves every tensor (pool, test set, client indices) to ``device`` once, before training."""
        self.x, self.y = self.x.to(device), self.y.to(device)
        self.test_x, self.test_y = self.test_x.to(device), self.test_y.to(device)
        self.extra_tests = {k: (x.to(device), y.to(device)) for k, (x, y) in self.extra_tests.items()}
        self.server_idx = self.server_idx.to(device)
        self.clients = [
            ClientData(*(getattr(c, f).to(device) for f in ("train", "unlabeled", "val", "test"))) for c in self.clients
        ]

    # ------------------------------------------------------------------ inspection
    def client_class_counts(self) -> np.ndarray:
        """``[num_clients, num_classes]`` counts of labeled training examples."""
        counts = np.zeros((len(self.clients), self.num_classes), dtype=np.int64)
        for i, client in enumerate(self.clients):
            targets = self.y[client.train].cpu().numpy().ravel()
            counts[i] = np.bincount(targets[targets >= 0], minlength=self.num_classes)
        return counts

    def partition_summary(self) -> dict:
        """Sizes, class counts and a hash of every client's indices, to audit and to check on resume."""
        digest = hashlib.sha256()
        for client in self.clients:
            for part in (client.train, client.unlabeled, client.val, client.test):
                digest.update(part.cpu().numpy().tobytes())
                digest.update(b"|")
        digest.update(self.server_idx.cpu().numpy().tobytes())
        return {
            "num_clients": len(self.clients),
            "num_classes": self.num_classes,
            "server_size": len(self.server_idx),
            "test_size": len(self.test_y),
            "sha256": digest.hexdigest(),
            "clients": [
                {
                    "train": len(c.train),
                    "unlabeled": len(c.unlabeled),
                    "val": len(c.val),
                    "test": len(c.test),
                    # a 10,004-word vocabulary per client would dwarf the file: only for class labels
                    **({"class_counts": counts.tolist()} if self.num_classes <= 1000 else {}),
                }
                for c, counts in zip(self.clients, self.client_class_counts())
            ],
        }


def _stratified_take(labels: np.ndarray, fraction: float, rng: np.random.Generator) -> np.ndarray:
    """Indices of ``fraction`` of each class, drawn at random."""
    taken = []
    for c in np.unique(labels):
        idx = np.flatnonzero(labels == c)
        taken.append(rng.choice(idx, int(round(len(idx) * fraction)), replace=False))
    return np.concatenate(taken)


def _loaded(data: FederatedData) -> DataArrays:
    """``data.load()``: what a user's data set raises there is named as theirs (``your data set mymod.Npz.load
    raised FileNotFoundError: ...``) with their frames; the bundled sets' errors are ours."""
    cls = type(data)
    with calling(f"data set {cls.__module__}.{cls.__qualname__}.load"):
        return data.load()
