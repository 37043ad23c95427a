"""FINCH clustering (Sarfraz, Sharma and Stiefelhagen, "Efficient Parameter-free Clustering Using First Neighbor
Relations", CVPR 2019) by cosine distance, as FPL's server clusters each class's client prototypes.

The first partition links every row to its first neighbour (the nearest other row by cosine distance) and takes
the connected components of those links: rows i and j share a cluster when one is the other's first neighbour
or both have the same first neighbour (the paper's adjacency), which the components of the links alone already
join. Each further partition does the same on the previous clusters' means (of the original rows) and stops
before a step that leaves one cluster or merges nothing. Plain torch, no dependency.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

COSINE_EPS = 1e-12  # a zero row has cosine distance 1 to every other row (no NaN)


def first_neighbours(rows: Tensor) -> Tensor:
    """``[N]`` the index of each row's nearest other row by cosine distance (the first such index on a tie)."""
    unit = F.normalize(rows.double(), dim=1, eps=COSINE_EPS)
    distance = 1.0 - unit @ unit.T
    distance.fill_diagonal_(float("inf"))
    return distance.argmin(dim=1)


def first_partition(rows: Tensor) -> Tensor:
    """FINCH's first partition of ``rows`` ``[N, D]``: ``[N]`` cluster labels 0, 1, ... numbered in the order of
    each cluster's first row. One row is one cluster."""
    n = len(rows)
    if n < 2:
        return torch.zeros(n, dtype=torch.long)
    parent = list(range(n))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in enumerate(first_neighbours(rows).tolist()):
        a, b = root(i), root(j)
        if a != b:
            parent[max(a, b)] = min(a, b)
    roots = [root(i) for i in range(n)]
    numbering: dict[int, int] = {}
    return torch.tensor([numbering.setdefault(r, len(numbering)) for r in roots], dtype=torch.long)


def cluster_means(rows: Tensor, labels: Tensor) -> Tensor:
    """``[K, D]`` the mean of the rows of each cluster 0 .. K-1 (float64)."""
    k = int(labels.max()) + 1
    sums = torch.zeros(k, rows.shape[1], dtype=torch.float64).index_add_(0, labels, rows.double())
    counts = torch.bincount(labels, minlength=k).double()
    return sums / counts[:, None]


def finch(rows: Tensor) -> list[Tensor]:
    """FINCH's partitions of ``rows`` ``[N, D]``, finest first: each ``[N]`` cluster labels of the rows. The first
    is :func:`first_partition`; each next one partitions the previous clusters' means and is kept while it has
    more than one cluster and fewer than the previous (the authors' code without its early-exit option)."""
    rows = rows.detach().cpu()
    partitions = [first_partition(rows)]
    while True:
        previous = partitions[-1]
        count = int(previous.max()) + 1 if len(previous) else 0
        if count < 2:
            break
        merged = first_partition(cluster_means(rows, previous))[previous]
        merged_count = int(merged.max()) + 1
        if merged_count == 1 or merged_count >= count:
            break
        partitions.append(merged)
    return partitions
