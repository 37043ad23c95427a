"""Partitioners: IID, Dirichlet, pathological and natural-id partitions that cover every example once, are
deterministic by seed, follow their label skew and sizes, and refuse impossible settings saying how to fix them."""

import numpy as np
import pytest

from fl_lightning.data import DirichletPartitioner, IidPartitioner, NaturalIdPartitioner, PathologicalPartitioner
from fl_lightning.federation.errors import ConfigError

LABELS = np.repeat(np.arange(10), 100)  # 1,000 examples, 100 per class


def _covered(parts) -> set[int]:
    """The examples the clients hold together; a failure when two clients hold the same one."""
    flat = np.concatenate(parts)
    assert len(flat) == len(np.unique(flat)), "partitions overlap"
    return set(flat.tolist())


def test_iid_sizes_are_near_equal_and_cover_everything():
    parts = IidPartitioner()(np.zeros(10), 3, np.random.default_rng(0))
    assert sorted(len(p) for p in parts) == [3, 3, 4]
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))


def test_dirichlet_is_deterministic_by_seed_and_disjoint():
    part = DirichletPartitioner(alpha=0.5)
    a = part(LABELS, 10, np.random.default_rng(3))
    b = part(LABELS, 10, np.random.default_rng(3))
    c = part(LABELS, 10, np.random.default_rng(4))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert _covered(a) == set(range(len(LABELS)))  # disjoint, and every example is someone's
    assert sum(len(p) for p in a) == len(LABELS)  # no example is dropped
    assert min(len(p) for p in a) >= 10


def _mean_top_class_share(parts):
    return np.mean([np.bincount(LABELS[p], minlength=10).max() / len(p) for p in parts])


def test_dirichlet_alpha_controls_label_skew():
    rng = np.random.default_rng(0)
    skewed = _mean_top_class_share(DirichletPartitioner(alpha=0.1, min_partition_size=1)(LABELS, 10, rng))
    balanced = _mean_top_class_share(DirichletPartitioner(alpha=1000.0)(LABELS, 10, rng))
    # With alpha -> inf every client sees each class ~10% of the time; with alpha = 0.1 one class dominates.
    assert balanced < 0.2
    assert skewed > 0.5


def test_dirichlet_impossible_partition_says_how_to_fix_it():
    with pytest.raises(ConfigError, match="raise alpha, lower min_partition_size or use fewer clients"):
        DirichletPartitioner(alpha=0.001, min_partition_size=20)(LABELS, 40, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="cannot give 200 clients at least 10"):
        DirichletPartitioner(alpha=1.0, min_partition_size=10)(LABELS, 200, np.random.default_rng(0))
    with pytest.raises(ConfigError, match="alpha must be positive"):
        DirichletPartitioner(alpha=0.0)


def test_pathological_gives_exactly_k_classes_split_evenly():
    parts = PathologicalPartitioner(classes_per_client=2)(LABELS, 10, np.random.default_rng(0))
    for i, p in enumerate(parts):
        classes = sorted(set(LABELS[p].tolist()))
        assert classes == sorted({i % 10, (i + 1) % 10})  # deterministic assignment: i, i+1
        assert len(p) == 100  # each class is held by two clients: 50 + 50
    assert _covered(parts) == set(range(len(LABELS)))


def test_pathological_random_assignment_and_impossible_k():
    parts = PathologicalPartitioner(classes_per_client=3, assignment="random")(LABELS, 20, np.random.default_rng(1))
    assert all(len(set(LABELS[p].tolist())) == 3 for p in parts)
    with pytest.raises(ConfigError, match="classes_per_client=11 is impossible with 10 classes"):
        PathologicalPartitioner(classes_per_client=11)(LABELS, 5, np.random.default_rng(0))


def test_natural_id_one_client_per_group_and_sampling():
    groups = np.repeat(np.array([7, 3, 9]), [2, 3, 4])
    parts = NaturalIdPartitioner()(np.zeros(9), 3, np.random.default_rng(0), groups=groups)
    assert [p.tolist() for p in parts] == [[2, 3, 4], [0, 1], [5, 6, 7, 8]]  # sorted by id: 3, 7, 9
    assert len(NaturalIdPartitioner()(np.zeros(9), 2, np.random.default_rng(0), groups=groups)) == 2
    with pytest.raises(ConfigError, match="3 natural clients, fewer than num_clients=4"):
        NaturalIdPartitioner()(np.zeros(9), 4, np.random.default_rng(0), groups=groups)


def test_dirichlet_does_not_favour_the_last_client_with_small_classes():
    labels = np.arange(200)  # 200 classes of one example each
    parts = DirichletPartitioner(alpha=1.0, min_partition_size=0)(labels, 4, np.random.default_rng(0))
    sizes = [len(p) for p in parts]
    assert sum(sizes) == 200 and min(sizes) > 20  # truncating the cumulative shares gave the last client all 200


@pytest.mark.parametrize("seed", range(4))
def test_natural_id_partition_is_each_chosen_groups_indices_in_order(seed):
    """The sort-based grouping (made for 34,248 users over 13.6M posts) equals a scan per group."""
    rng = np.random.default_rng(seed)
    groups = (
        rng.choice(np.array(["f0", "f1", "m7", "x", "writer_12"]), size=200) if seed % 2 else rng.integers(0, 40, 300)
    )
    ids = np.unique(groups)
    num_clients = len(ids) - seed  # all groups, or a sample of them
    parts = NaturalIdPartitioner()(None, num_clients, np.random.default_rng(seed), groups)
    chosen = (
        ids if num_clients == len(ids) else np.sort(np.random.default_rng(seed).choice(ids, num_clients, replace=False))
    )
    assert len(parts) == len(chosen)
    for part, group in zip(parts, chosen):
        assert part.tolist() == np.flatnonzero(groups == group).tolist()


def test_pathological_sequential_gives_blocks_of_clients_the_same_classes_as_pflib():
    # PFLlib's generator: class by class, the first ceil(N k / C) = ceil(20 x 2 / 10) = 4 clients that still
    # hold fewer than k classes take it, so clients 0-3 hold classes 0 and 1, clients 4-7 classes 2 and 3, ...
    parts = PathologicalPartitioner(2, assignment="sequential")(LABELS, 20, np.random.default_rng(0))
    assert [sorted(set(LABELS[p].tolist())) for p in parts] == [[2 * (i // 4), 2 * (i // 4) + 1] for i in range(20)]
    assert [len(p) for p in parts] == [50] * 20  # each class's 100 examples, 25 to each of its 4 holders
    assert _covered(parts) == set(range(len(LABELS)))
    # CIFAR-100's 10 of 100 classes over 20 clients: 2 holders a class, clients 2j and 2j+1 share classes 10j..10j+9
    many = np.repeat(np.arange(100), 6)
    parts = PathologicalPartitioner(10, assignment="sequential")(many, 20, np.random.default_rng(0))
    assert [sorted(set(many[p].tolist())) for p in parts] == [
        list(range(10 * (i // 2), 10 * (i // 2) + 10)) for i in range(20)
    ]


def test_pathological_unbalanced_counts_follow_pflib_bounds():
    # each class's 100 examples over 4 holders: an even share is 25, so the first three draw from [2, 25) and
    # the last holder takes the rest
    parts = PathologicalPartitioner(2, assignment="sequential", balanced=False)(LABELS, 20, np.random.default_rng(0))
    for c in range(10):
        counts = [int((LABELS[parts[i]] == c).sum()) for i in range(4 * (c // 2), 4 * (c // 2) + 4)]
        assert all(2 <= n < 25 for n in counts[:3]) and sum(counts) == 100
    assert len({len(p) for p in parts}) > 1  # the clients differ in size
    assert _covered(parts) == set(range(len(LABELS)))


def test_self_balancing_dirichlet_stops_giving_to_clients_that_hold_their_share():
    # five clients, five classes of 100: once a client holds n / num_clients = 100 examples it gets none of the
    # later classes, so the clients stay smaller than without the cap
    labels = np.repeat(np.arange(5), 100)
    capped = [
        DirichletPartitioner(0.1, 0, 1, self_balancing=True)(labels, 5, np.random.default_rng(s)) for s in range(20)
    ]
    free = [DirichletPartitioner(0.1, 0, 1)(labels, 5, np.random.default_rng(s)) for s in range(20)]
    for parts in capped:
        sizes = [len(p) for p in parts]
        assert sum(sizes) == 500
        for part in parts:  # every class after the one that filled the client is absent
            held = np.cumsum([int((labels[part] == c).sum()) for c in range(5)])
            full = np.flatnonzero(held >= 100)
            assert not len(full) or held[-1] == held[full[0]]
    assert max(len(p) for parts in free for p in parts) > max(len(p) for parts in capped for p in parts)
