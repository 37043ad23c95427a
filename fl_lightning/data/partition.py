"""Partitioners: split example indices among clients.

The semantics follow flwr-datasets' partitioners (IID, Dirichlet with a minimum partition size and
retries, pathological k-classes-per-client, natural id), reimplemented on index arrays because our
data stay tensors in memory and flwr-datasets 0.6 pins ``datasets<5``, which conflicts with current
``transformers`` (see docs/architecture.md). Every partitioner is deterministic given its generator
and raises :class:`ConfigError` with a fix when the requested split is impossible.
"""

from __future__ import annotations

import math
from typing import Literal

import numpy as np

from ..federation.errors import ConfigError


class Partitioner:
    """Splits ``labels`` (one per example) into ``num_clients`` disjoint index arrays."""

    def __call__(
        self, labels: np.ndarray, num_clients: int, rng: np.random.Generator, groups: np.ndarray | None = None
    ) -> list[np.ndarray]:
        raise NotImplementedError

    @staticmethod
    def _check_count(n: int, num_clients: int, min_size: int) -> None:
        if num_clients < 1:
            raise ConfigError(f"num_clients must be at least 1, got {num_clients}.")
        if n < num_clients * min_size:
            raise ConfigError(
                f"cannot give {num_clients} clients at least {min_size} example(s) each from {n} examples; "
                "use fewer clients, a smaller minimum partition size or more data."
            )


class IidPartitioner(Partitioner):
    """Uniformly random, near-equal shards (sizes differ by at most one)."""

    def __call__(self, labels, num_clients, rng, groups=None):
        self._check_count(len(labels), num_clients, 1)
        return [np.sort(part) for part in np.array_split(rng.permutation(len(labels)), num_clients)]


class DirichletPartitioner(Partitioner):
    """Label skew: for each class, client shares are drawn from Dirichlet(alpha, ..., alpha).

    Args:
        alpha: concentration; small values give few classes per client (0.1 in paper 001, 0.5 in 003).
        min_partition_size: every client must receive at least this many examples; the draw is
            repeated (fresh randomness) up to ``max_tries`` times until it does.
        max_tries: draws before giving up with an error.
        self_balancing: a client that already holds ``n / num_clients`` examples gets none of the later
            classes (their shares renormalised over the others), as flwr-datasets' ``self_balancing`` and
            PFLlib's generator (HtFLlib's data), which caps how large a client grows.
    """

    def __init__(
        self, alpha: float = 0.5, min_partition_size: int = 10, max_tries: int = 10, self_balancing: bool = False
    ):
        if not 0 < alpha < math.inf:  # NaN too: numpy's Dirichlet would fail inside
            raise ConfigError(f"Dirichlet alpha must be positive, got {alpha}.")
        if min_partition_size < 0 or max_tries < 1:
            raise ConfigError(
                f"Dirichlet min_partition_size must be at least 0 and max_tries at least 1, got "
                f"{min_partition_size} and {max_tries}."
            )
        self.alpha = alpha
        self.min_partition_size = min_partition_size
        self.max_tries = max_tries
        self.self_balancing = self_balancing

    def __call__(self, labels, num_clients, rng, groups=None):
        self._check_count(len(labels), num_clients, self.min_partition_size)
        for _ in range(self.max_tries):
            result = self._draw(labels, num_clients, rng)
            if min(len(p) for p in result) >= self.min_partition_size:
                return result
        raise ConfigError(
            f"Dirichlet(alpha={self.alpha}) did not give all {num_clients} clients at least "
            f"{self.min_partition_size} examples (of {len(labels)}) in {self.max_tries} draws; "
            "raise alpha, lower min_partition_size or use fewer clients."
        )

    def _draw(self, labels: np.ndarray, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        held = np.zeros(num_clients, dtype=np.int64)
        for c in np.unique(labels):
            idx = rng.permutation(np.flatnonzero(labels == c))
            shares = rng.dirichlet(np.full(num_clients, self.alpha))
            if self.self_balancing:
                open_shares = shares * (held < len(labels) / num_clients)
                shares = open_shares / open_shares.sum() if open_shares.sum() > 0 else shares
            # multinomial counts: cutting at truncated (or rounded) cumulative shares always hands a
            # class's remainder to the same clients, which starves them when classes are small
            cuts = np.cumsum(rng.multinomial(len(idx), shares))[:-1]
            for client, piece in enumerate(np.split(idx, cuts)):
                parts[client].append(piece)
                held[client] += len(piece)
        return [np.sort(np.concatenate(p)) for p in parts]


class PathologicalPartitioner(Partitioner):
    """Each client holds exactly ``classes_per_client`` classes (e.g. 2 of 10, 10 of 100 in FedGH).

    A class no client holds is unused.

    Args:
        classes_per_client: k.
        assignment: ``random`` (k distinct classes drawn per client), ``deterministic`` (client i holds
            classes i, i+1, ..., i+k-1 modulo C, so every class is used when N >= C) or ``sequential``
            (PFLlib's generator, HtFLlib's data: class by class, the first ``ceil(N k / C)`` clients that
            hold fewer than k classes take it, so blocks of clients share the same k classes).
        balanced: split each class evenly among its holders; ``false``: every holder but the last gets a
            count drawn uniformly between a tenth of an even share and an even share, the last the rest
            (PFLlib's unbalanced split).
        min_partition_size: smallest acceptable client.
    """

    def __init__(
        self,
        classes_per_client: int = 2,
        assignment: Literal["random", "deterministic", "sequential"] = "deterministic",
        balanced: bool = True,
        min_partition_size: int = 1,
    ):
        self.k = classes_per_client
        self.assignment = assignment
        self.balanced = balanced
        self.min_partition_size = min_partition_size

    def __call__(self, labels, num_clients, rng, groups=None):
        classes = np.unique(labels)
        if not 1 <= self.k <= len(classes):
            raise ConfigError(
                f"classes_per_client={self.k} is impossible with {len(classes)} classes; choose 1..{len(classes)}."
            )
        self._check_count(len(labels), num_clients, self.min_partition_size)
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for c, owners in self._holders(classes, num_clients, rng).items():
            if owners:
                idx = rng.permutation(np.flatnonzero(labels == c))
                for owner, piece in zip(owners, self._split(idx, len(owners), rng)):
                    parts[owner].append(piece)
        result = [np.sort(np.concatenate(p)) if p else np.empty(0, dtype=np.int64) for p in parts]
        smallest = min(len(p) for p in result)
        if smallest < self.min_partition_size:
            raise ConfigError(
                f"a client received {smallest} examples with {self.k} classes per client over {num_clients} clients "
                f"(minimum {self.min_partition_size}); use fewer clients or more classes per client."
            )
        return result

    def _holders(self, classes: np.ndarray, num_clients: int, rng: np.random.Generator) -> dict[int, list[int]]:
        """The clients holding each class, in client order."""
        if self.assignment == "sequential":
            quota, per_class, holders = [self.k] * num_clients, math.ceil(num_clients * self.k / len(classes)), {}
            for c in classes:
                holders[c] = [i for i in range(num_clients) if quota[i] > 0][:per_class]
                for i in holders[c]:
                    quota[i] -= 1
            return holders
        if self.assignment == "deterministic":
            held = [classes[(i + np.arange(self.k)) % len(classes)] for i in range(num_clients)]
        else:
            held = [rng.choice(classes, self.k, replace=False) for _ in range(num_clients)]
        return {c: [i for i in range(num_clients) if c in held[i]] for c in classes}

    def _split(self, idx: np.ndarray, holders: int, rng: np.random.Generator) -> list[np.ndarray]:
        """One class's shuffled examples cut among its ``holders``: evenly, or PFLlib's unbalanced counts."""
        if self.balanced or holders == 1:
            return np.array_split(idx, holders)
        even = len(idx) / holders
        counts = rng.integers(int(even / 10), max(int(even), int(even / 10) + 1), holders - 1)
        return np.split(idx, np.cumsum(counts))


class NaturalIdPartitioner(Partitioner):
    """One client per natural group (FEMNIST writer, speaker, StackOverflow user).

    If ``num_clients`` is smaller than the number of groups, that many groups are sampled.
    """

    def __call__(self, labels, num_clients, rng, groups=None):
        if groups is None:
            raise ConfigError(
                "NaturalIdPartitioner needs a data set with natural client ids (writers, speakers, users)."
            )
        ids = np.unique(groups)
        if num_clients > len(ids):
            raise ConfigError(f"the data set has {len(ids)} natural clients, fewer than num_clients={num_clients}.")
        chosen = ids if num_clients == len(ids) else np.sort(rng.choice(ids, num_clients, replace=False))
        # one stable sort instead of a scan of all examples per group: 34,248 StackOverflow users over 13.6M
        # posts would be 4.6e11 comparisons; the indices of each group stay in ascending order, as before
        group_of = np.searchsorted(ids, groups)
        order = np.argsort(group_of, kind="stable")
        bounds = np.searchsorted(group_of[order], np.arange(len(ids) + 1))
        position = np.searchsorted(ids, chosen)
        return [order[bounds[i] : bounds[i + 1]] for i in position]


class SampledPartitioner(Partitioner):
    """Populations larger than the data: every client draws its examples with replacement.

    Cross-device simulators give thousands to millions of clients a small local data set each; when
    the population outnumbers the examples, clients must share examples. Client k draws
    ``examples_per_client`` indices with replacement, either from the whole pool (``alpha: null``) or
    with its own class proportions ``p_k ~ Dirichlet(alpha)`` (label skew as in
    :class:`DirichletPartitioner`). Clients are therefore not disjoint, and one client may hold an
    example twice. Memory: ``num_clients x examples_per_client`` int64 indices (160 MB for 100,000
    clients of 200 examples), plus the local splits made from them.

    Args:
        examples_per_client: size of every client's local data set.
        alpha: Dirichlet concentration of each client's class proportions; ``None`` draws from the pool.
    """

    def __init__(self, examples_per_client: int = 20, alpha: float | None = None):
        if examples_per_client < 1:
            raise ConfigError(f"examples_per_client must be at least 1, got {examples_per_client}.")
        if alpha is not None and not 0 < alpha < math.inf:
            raise ConfigError(f"SampledPartitioner alpha must be positive or null, got {alpha}.")
        self.examples_per_client, self.alpha = examples_per_client, alpha

    def __call__(self, labels, num_clients, rng, groups=None):
        if num_clients < 1:
            raise ConfigError(f"num_clients must be at least 1, got {num_clients}.")
        if len(labels) == 0:
            raise ConfigError("SampledPartitioner has no examples to draw from; check the data set and its splits.")
        m = self.examples_per_client
        if self.alpha is None:
            return list(np.sort(rng.integers(0, len(labels), size=(num_clients, m)), axis=1))
        classes = np.unique(labels)
        proportions = rng.dirichlet(np.full(len(classes), self.alpha), size=num_clients)  # [N, C]
        counts = rng.multinomial(m, proportions)  # [N, C], each row sums to m
        owners, chosen = [], []
        for j, c in enumerate(classes):
            members = np.flatnonzero(labels == c)
            owners.append(np.repeat(np.arange(num_clients), counts[:, j]))
            chosen.append(members[rng.integers(0, len(members), int(counts[:, j].sum()))])
        owners_all, chosen_all = np.concatenate(owners), np.concatenate(chosen)
        order = np.lexsort((chosen_all, owners_all))  # by client, then index
        return np.split(chosen_all[order], np.arange(1, num_clients) * m)
