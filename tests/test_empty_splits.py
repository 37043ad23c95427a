"""A share of the data that rounds to no example at all is refused when the data is set up, instead of metrics
computed on nothing (accuracy and loss 0.0) or a failure after training."""

import json

import pytest
import torch
from conftest import ROOT, run_cli

from fl_lightning.data import DataArrays, DigitsData, FederatedData, FemnistData, IidPartitioner, StackOverflowData
from fl_lightning.federation.errors import ConfigError


def test_a_test_fraction_that_rounds_to_nothing_exits_2_before_the_run(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--config", str(ROOT / "recipes/quickstart.yaml"), "--rounds", "2", "--output_dir", str(out)]
    code = run_cli("fit", *argv, "--data.init_args.test_fraction", "0.001")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Warning" not in line]
    assert code == 2 and not out.exists()
    assert lines == ["flrun fit: error: test_fraction 0.001 leaves no test examples of the 1,797; raise it, e.g. 0.2."]


def test_the_smallest_test_fraction_that_keeps_one_example_per_class_is_accepted():
    data = DigitsData(test_fraction=0.003)  # the smallest class has 174 examples: round(0.522) = 1 each
    data.setup(num_clients=4, seed=0)
    assert len(data.test_y) == 10 and sorted(data.test_y.tolist()) == list(range(10))
    with pytest.raises(ConfigError, match="test_fraction 0.002 leaves no test examples"):  # round(0.36) = 0
        DigitsData(test_fraction=0.002).setup(num_clients=4, seed=0)


def test_a_server_fraction_that_rounds_to_nothing_is_refused():
    with pytest.raises(ConfigError, match=r"server_fraction 0.001 leaves no server examples of the 1,438; raise"):
        DigitsData(server_fraction=0.001).setup(num_clients=4, seed=0)


def test_a_local_share_that_leaves_every_client_no_example_is_refused():
    # 1,438 training digits over 4 IID clients: 360, 360, 359, 359; 0.001 of that rounds to 0
    data = DigitsData(partitioner=IidPartitioner(), local_split=(0.998, 0.001, 0.001))
    with pytest.raises(ConfigError, match=r"leaves every client no local val examples \(the largest holds 360\)"):
        data.setup(num_clients=4, seed=0)
    data = DigitsData(partitioner=IidPartitioner(), local_split=(0.99, 0.0, 0.01))  # round(3.6) = round(3.59) = 4
    data.setup(num_clients=4, seed=0)
    assert [len(c.test) for c in data.clients] == [4, 4, 4, 4]


def test_an_unlabeled_fraction_that_rounds_to_nothing_is_refused():
    with pytest.raises(ConfigError, match="unlabeled_fraction 0.001 leaves no client an unlabeled example"):
        DigitsData(partitioner=IidPartitioner(), unlabeled_fraction=0.001).setup(num_clients=4, seed=0)


def test_any_data_set_without_global_test_examples_is_refused():
    class NoTest(FederatedData):
        def load(self):
            return DataArrays(torch.zeros(8, 2), torch.arange(8) % 2, torch.zeros(0, 2), torch.zeros(0), num_classes=2)

    with pytest.raises(ConfigError, match=r"NoTest has no global test examples \(of 8 loaded\)"):
        NoTest().setup(num_clients=2, seed=0)


def test_femnist_test_fraction_is_checked(tmp_path):
    with pytest.raises(ConfigError, match=r"test_fraction must be in \(0, 1\), got 0.0"):
        FemnistData(data_dir=str(tmp_path), hub_id=None, test_fraction=0.0)
    leaf = tmp_path / "femnist" / "all_data"
    leaf.mkdir(parents=True)
    users = {f"w{i}": {"x": [[0.0] * 784] * 4, "y": [0, 1, 2, 3]} for i in range(3)}
    (leaf / "all_data_0.json").write_text(json.dumps({"users": list(users), "user_data": users}))
    with pytest.raises(ConfigError, match="test_fraction 0.1 leaves no test examples of the 12"):  # round(0.4) = 0
        FemnistData(data_dir=str(tmp_path), hub_id=None, test_fraction=0.1).load()
    arrays = FemnistData(data_dir=str(tmp_path), hub_id=None, test_fraction=0.25).load()  # one of each writer's 4
    assert len(arrays.test_y) == 3 and len(arrays.y) == 9


def test_stackoverflow_needs_test_examples():
    with pytest.raises(ConfigError, match="test_examples must be at least 1"):
        StackOverflowData(test_examples=0)


def test_a_local_val_share_some_clients_lack_is_refused_only_where_it_is_evaluated(tmp_path, capsys):
    # quickstart's smallest clients hold 16 examples: a 0.03 val share gives them none, and FedAvg reads no val
    argv = ["--config", str(ROOT / "recipes/quickstart.yaml"), "--rounds", "1", "--runtime.progress", "false"]
    split = ["--data.init_args.local_split", "[0.9, 0.03, 0.07]"]
    assert run_cli("fit", *argv, *split, "--output_dir", str(tmp_path / "fedavg")) == 0
    standalone = ["--strategy", "{class_path: fl_lightning.strategies.Standalone, init_args: {split: val}}"]
    assert run_cli("fit", *argv, *split, *standalone, "--output_dir", str(tmp_path / "own")) == 2
    assert "Standalone evaluates each client on its local val split, but client(s)" in capsys.readouterr().err
