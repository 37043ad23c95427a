"""Federated digits data: the bundled set and its fixed test split, the sizes and disjointness of the server,
unlabeled and local splits, partitions deterministic by seed, bad fractions refused, and pooled test sets."""

import numpy as np
import pytest
import torch

from fl_lightning.data import DigitsData, IidPartitioner
from fl_lightning.federation.errors import ConfigError


def test_digits_is_the_real_bundled_set_with_a_fixed_test_split():
    data = DigitsData(test_fraction=0.2)
    data.setup(num_clients=5, seed=0)
    assert data.x.shape[1:] == (1, 8, 8) and data.x.dtype == torch.float32
    assert len(data.x) + len(data.test_x) == 1797
    # 20% of each class, rounded: 178 zeros give 36, 182 ones 36, 177 twos 35, ... 359 of 1797
    assert len(data.test_y) == sum(round(n * 0.2) for n in np.bincount(np.concatenate([data.y, data.test_y]))) == 359
    raw = DigitsData(test_fraction=0.2, normalize="none")
    raw.setup(num_clients=5, seed=0)
    assert float(raw.x.min()) == 0.0 and float(raw.x.max()) == 1.0  # pixel counts 0-16 over 16
    assert abs(float(data.x.mean())) < 1e-6  # standardised per pixel by default
    other = DigitsData(test_fraction=0.2)
    other.setup(num_clients=5, seed=1)  # another run seed keeps the global test set
    assert torch.equal(data.test_y, other.test_y) and torch.equal(data.test_x, other.test_x)


def test_server_unlabeled_and_local_splits_have_requested_sizes_and_are_disjoint():
    data = DigitsData(
        partitioner=IidPartitioner(), server_fraction=0.1, unlabeled_fraction=0.5, local_split=(0.8, 0.1, 0.1)
    )
    data.setup(num_clients=4, seed=0)
    pool = len(data.x)
    assert len(data.server_idx) == sum(round(n * 0.1) for n in np.bincount(data.y.numpy())) == 143  # 10% a class
    everything = [data.server_idx]
    for client in data.clients:
        total = sum(len(p) for p in (client.train, client.unlabeled, client.val, client.test))
        assert len(client.val) == round(0.1 * total) and len(client.test) == round(0.1 * total)
        local_train = len(client.train) + len(client.unlabeled)
        assert len(client.unlabeled) == round(0.5 * local_train)
        everything += [client.train, client.unlabeled, client.val, client.test]
    flat = torch.cat(everything).numpy()
    assert len(flat) == len(np.unique(flat)) == pool  # disjoint and nothing lost


def test_partition_summary_is_deterministic_by_seed():
    a, b, c = DigitsData(), DigitsData(), DigitsData()
    a.setup(6, 0), b.setup(6, 0), c.setup(6, 1)
    assert a.partition_summary()["sha256"] == b.partition_summary()["sha256"] != c.partition_summary()["sha256"]
    counts = a.client_class_counts()
    assert counts.shape == (6, 10) and counts.sum() == sum(len(cl.train) for cl in a.clients)


def test_bad_fractions_are_rejected():
    with pytest.raises(ConfigError, match="local_split"):
        DigitsData(local_split=(0.5, 0.1, 0.1))
    with pytest.raises(ConfigError, match="unlabeled_fraction"):
        DigitsData(unlabeled_fraction=1.0)


def test_pool_test_set_splits_train_and_test_among_clients_and_tests_on_their_local_test_splits():
    plain = DigitsData(test_fraction=0.2)
    plain.setup(num_clients=4, seed=0)
    pooled = DigitsData(test_fraction=0.2, pool_test_set=True, local_split=(0.75, 0.0, 0.25))
    pooled.setup(num_clients=4, seed=0)
    assert len(pooled.x) == len(plain.x) + len(plain.test_x) == 1797  # the test set joined the pool
    held = sum(len(c.train) + len(c.test) for c in pooled.clients)
    assert held == 1797 and all(len(c.test) == round(0.25 * (len(c.train) + len(c.test))) for c in pooled.clients)
    tests = torch.cat([c.test for c in pooled.clients])
    # the global test set is the clients' local test splits together: no example a client trains on
    assert torch.equal(pooled.test_x, pooled.x[tests]) and torch.equal(pooled.test_y, pooled.y[tests])
    assert not set(tests.tolist()) & set(torch.cat([c.train for c in pooled.clients]).tolist())
    with pytest.raises(ConfigError, match=r"give local_split a test share, e.g. \[0.75, 0.0, 0.25\]"):
        DigitsData(pool_test_set=True)
