"""Paper 002's CIFAR-100 data sizes (Tables 1, 3 and 4), computed from each recipe's partition plan at full scale.

Federated CIFAR-100 has 500 training clients of 100 images each. The paper's split: 13,500 distillation
images, a 315-client federated pool of 31,500 images, 5,000 held out (13,500 + 31,500 + 5,000 = 50,000); the
high-capacity pool holds |P_H| = 3,100 / 4,700 / 6,300 images, 100 per client. The images do not matter for
the sizes, so the recipes run their ``setup`` on label arrays of the real layout with one-pixel images.
"""

import numpy as np
import pytest
import torch
from conftest import ROOT

from fl_lightning.data import FedCifar100Data
from fl_lightning.data.federated import DataArrays, FederatedData
from fl_lightning.data.partition import NaturalIdPartitioner
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Population, Tier
from fl_lightning.run.recipes import load_recipe

TFF_CLIENTS, PER_CLIENT = 500, 100


class _LayoutOnlyCifar100(FedCifar100Data):
    """TFF's Federated CIFAR-100 layout (client ids ``"0".."499"``, 100 images each) with one-pixel images."""

    def load(self) -> DataArrays:
        n = TFF_CLIENTS * PER_CLIENT
        groups = np.repeat([str(i) for i in range(TFF_CLIENTS)], PER_CLIENT)
        return DataArrays(
            torch.zeros(n, 1), torch.arange(n) % 100, torch.zeros(10_000, 1), torch.arange(10_000) % 100, groups, 100
        )


class _LayoutOnlyCifar10(FederatedData):
    """CIFAR-10's 50,000 training images, one pixel each (the out-of-domain server set)."""

    def load(self) -> DataArrays:
        return DataArrays(torch.zeros(50_000, 1), torch.arange(50_000) % 10, torch.zeros(1, 1), torch.zeros(1))


def _recipes(pattern):
    return sorted(ROOT.glob(f"recipes/{pattern}.yaml"))


FAMILIES = _recipes("fedadam_cifar100_*") + _recipes("*_codist_cifar100_*")


def _plan(path):
    """The recipe's data after ``setup`` and its clients (tier names), at the run seed 0."""
    recipe = load_recipe(path)
    args = dict(recipe["data"]["init_args"])
    if "server_dataset" in args:
        args["server_dataset"] = _LayoutOnlyCifar10()
    data = _LayoutOnlyCifar100(**args)
    population = recipe["population"]
    clients = Population(population["num_clients"], [Tier(**tier) for tier in population["tiers"]]).build(0)
    data.setup(len(clients), seed=0)
    return data, clients


def test_every_paper_002_cifar100_family_is_covered():
    names = {path.stem.rsplit("_ph", 1)[0] + "/" + path.stem.rsplit("_", 1)[-1] for path in FAMILIES}
    assert len(FAMILIES) == 15  # 3 pool sizes x (FedAdam, 2 methods x in- / out-of-domain)
    assert {"fedadam_cifar100/ph3100", "merged_codist_cifar100/indomain", "periodic_codist_cifar100/outdomain"} <= names


@pytest.mark.parametrize("path", FAMILIES, ids=lambda p: p.stem)
def test_pools_and_server_set_have_the_papers_sizes(path):
    data, clients = _plan(path)
    high = int(path.stem.split("_ph")[1][:4])  # |P_H| in examples, from the file name (Table 1's column)
    sizes = [len(c.train) for c in data.clients]
    assert len(sizes) == 315 and sum(sizes) == 31_500  # Table 3: the federated pool
    assert set(sizes) == {PER_CLIENT}  # every client keeps all of its images
    assert sum(size for size, spec in zip(sizes, clients) if "large" in spec.roles) == high  # Tables 1 and 4
    held = torch.cat([c.train for c in data.clients]).numpy()
    server = data.server_idx.numpy()
    if path.stem.endswith("_indomain"):
        assert len(server) == 13_500  # Table 3's distillation examples
        assert len(np.intersect1d(server, held)) == 0 and server.max() < TFF_CLIENTS * PER_CLIENT
        assert TFF_CLIENTS * PER_CLIENT - len(held) - len(server) == 5_000  # what the paper holds out
    elif path.stem.endswith("_outdomain"):
        assert len(server) == 50_000 and server.min() == TFF_CLIENTS * PER_CLIENT  # all of CIFAR-10, appended
        assert bool((data.y[data.server_idx] == -100).all())  # its labels are dropped
    else:
        assert len(server) == 0  # FedAdam has no distillation set


@pytest.mark.parametrize("high", ["3100", "4700", "6300"])
def test_baseline_and_codistillation_rows_train_on_the_same_clients(high):
    reference, _ = _plan(ROOT / f"recipes/fedadam_cifar100_ph{high}.yaml")
    for path in _recipes(f"*_codist_cifar100_ph{high}_*"):
        data, _ = _plan(path)
        assert all(torch.equal(a.train, b.train) for a, b in zip(reference.clients, data.clients)), path.stem


def _natural(groups_of, server_examples=None, **kwargs):
    """Four natural clients of three examples (ids 0-2, 3-5, 6-8, 9-11)."""

    class Tiny(FederatedData):
        default_partitioner = NaturalIdPartitioner

        def load(self):
            return DataArrays(torch.zeros(12, 1), torch.arange(12) % 2, torch.zeros(2, 1), torch.zeros(2), groups_of)

    return Tiny(server_examples=server_examples, **kwargs)


def test_server_examples_come_from_clients_outside_the_federation_and_leave_clients_whole():
    groups = np.repeat(["a", "b", "c", "d"], 3)
    plain, served = _natural(groups), _natural(groups, server_examples=4)
    plain.setup(2, seed=3), served.setup(2, seed=3)
    assert [c.train.tolist() for c in served.clients] == [c.train.tolist() for c in plain.clients]
    assert all(len(c.train) == 3 for c in served.clients)
    held = set(torch.cat([c.train for c in served.clients]).tolist())
    outside = set(range(12)) - held  # the two natural clients not chosen: six examples
    assert len(outside) == 6 and len(served.server_idx) == 4 and set(served.server_idx.tolist()) <= outside


def test_server_examples_beyond_what_the_partition_leaves_or_with_another_server_set_are_refused():
    groups = np.repeat(["a", "b", "c", "d"], 3)
    with pytest.raises(ConfigError, match="server_examples=7 but the partition leaves only 6 examples"):
        _natural(groups, server_examples=7).setup(2, seed=0)
    with pytest.raises(ConfigError, match="set only one of the three"):
        _natural(groups, server_examples=4, server_fraction=0.1)
    with pytest.raises(ConfigError, match="positive number of examples"):
        _natural(groups, server_examples=0)
