"""The data sets read from a user's own files, on small files written here in their real formats: an .npz, a CSV and
a Parquet table, an image folder, a Hugging Face ``datasets`` copy saved to disk. Each is read, partitioned, checked
at the door, and run through ``flrun fit`` and ``flrun data inspect`` from a recipe in the test's folder."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, run_cli

from fl_lightning.data import DirichletPartitioner, IidPartitioner, NpzData
from fl_lightning.federation.errors import ConfigError

PNG = b"\x89PNG\r\n\x1a\n"


def blobs(n: int, features: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` examples of ``features`` values around one centre per class (learnable, not trivially: noise 1)."""
    rng = np.random.default_rng(seed)
    centres = np.random.default_rng(99).normal(0, 2, (classes, features))
    y = np.arange(n) % classes
    return (centres[y] + rng.normal(0, 1, (n, features))).astype(np.float32), y


def recipe(folder, data: dict, **changes) -> str:
    """A recipe file in ``folder``: the tests' tiny FedAvg run on ``data`` (a class path and its init_args)."""
    config = {**TINY, "data": data, **changes}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def fit(folder, config: str, *extra: str) -> dict:
    out = folder / "run"
    assert run_cli("fit", "--config", config, "--output_dir", str(out), *extra) == 0
    return json.loads((out / "summary.json").read_text())


def inspect_writes_a_chart(folder, config: str, capsys) -> str:
    chart = folder / "chart.png"
    assert run_cli("data", "inspect", "--config", config, "--output", str(chart)) == 0
    assert chart.read_bytes()[:8] == PNG
    return capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------------- npz
def write_npz(path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


def test_npz_channels_last_uint8_images_load_as_nchw_floats_in_0_1(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (40, 6, 6, 3), dtype=np.uint8)  # NHWC
    tx = rng.integers(0, 256, (12, 6, 6, 3), dtype=np.uint8)
    path = write_npz(tmp_path / "d.npz", x_train=x, y_train=np.arange(40) % 4, x_test=tx, y_test=np.arange(12) % 4)
    data = NpzData(path=path, normalize="none")
    data.setup(num_clients=2, seed=0)
    assert data.x.shape == (40, 3, 6, 6) and data.test_x.shape == (12, 3, 6, 6) and data.num_classes == 4
    assert torch.equal(data.x[5, 2], torch.tensor(x[5, :, :, 2] / 255.0, dtype=torch.float32))  # blue plane
    assert data.input_sizes() == {"in_channels": 3, "in_features": 108, "image_size": 6}


def test_npz_features_are_standardised_with_the_clients_statistics_only(tmp_path):
    x, y = blobs(60, 5, 3, seed=0)
    tx, ty = blobs(30, 5, 3, seed=1)
    path = write_npz(tmp_path / "d.npz", x_train=x, y_train=y, x_test=tx, y_test=ty)
    data = NpzData(path=path, server_fraction=0.2, partitioner=IidPartitioner())
    data.setup(num_clients=3, seed=0)
    seen = torch.cat([c.train for c in data.clients]).sort().values
    raw = torch.from_numpy(x)
    mean, std = raw[seen].mean(0), raw[seen].std(0)  # the clients' examples, not the server's 20 %
    assert torch.allclose(data.x, (raw - mean) / std, atol=1e-5)
    assert torch.allclose(data.test_x, (torch.from_numpy(tx) - mean) / std, atol=1e-5)
    assert len(data.server_idx) == 12 and data.input_sizes() == {"in_channels": 1, "in_features": 5}


def test_npz_greyscale_images_without_channel_axis_and_channel_normalisation(tmp_path):
    x = np.random.default_rng(0).random((20, 4, 4)).astype(np.float32)
    path = write_npz(tmp_path / "d.npz", x_train=x, y_train=np.arange(20) % 2, x_test=x[:4], y_test=[0, 1, 0, 1])
    data = NpzData(path=path, normalize="channel", num_classes=3)
    data.setup(num_clients=1, seed=0)
    raw = torch.from_numpy(x).unsqueeze(1)
    assert data.num_classes == 3 and data.x.shape == (20, 1, 4, 4)
    assert torch.allclose(data.x, (raw - raw.mean()) / raw.std(), atol=1e-5)  # one channel: one mean and std


@pytest.mark.parametrize(
    "arrays, says",
    [
        ({"x_train": np.zeros((4, 2)), "y_train": np.zeros(4)}, "has no x_test, y_test (it holds x_train, y_train)"),
        (
            {"x_train": np.zeros((4, 2)), "y_train": np.zeros(3), "x_test": np.zeros((2, 2)), "y_test": np.zeros(2)},
            "x_train holds 4 examples but y_train 3 labels",
        ),
        (
            {"x_train": np.zeros((4, 2)), "y_train": [0, 1, 0.5, 1], "x_test": np.zeros((2, 2)), "y_test": [0, 1]},
            "y_train holds the label 0.5 at index 2, not a whole number",
        ),
        (
            {"x_train": np.zeros((2, 2)), "y_train": ["a", "b"], "x_test": np.zeros((1, 2)), "y_test": ["a"]},
            "y_train holds text labels ('a', ...); labels must be integer class indices",
        ),
        (
            {"x_train": np.zeros((2, 2)), "y_train": [0, 1], "x_test": np.zeros((1, 3)), "y_test": [0]},
            "x_test examples have shape [3], x_train's [2]",
        ),
        (
            {"x_train": np.zeros((2, 2)), "y_train": [0, -1], "x_test": np.zeros((1, 2)), "y_test": [0]},
            "label -1 at index 1 is outside 0..0",
        ),
    ],
)
def test_npz_files_that_break_the_format_are_one_sentence(tmp_path, arrays, says):
    path = write_npz(tmp_path / "d.npz", **arrays)
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        NpzData(path=path).setup(num_clients=1, seed=0)


def test_npz_a_missing_file_says_where_and_how_to_write_it(tmp_path, capsys):
    config = recipe(tmp_path, {"class_path": "fl_lightning.data.NpzData", "init_args": {"path": "nowhere/d.npz"}})
    assert run_cli("fit", "--config", config, "--output_dir", str(tmp_path / "run")) == 2
    err = capsys.readouterr().err
    assert "nowhere/d.npz does not exist; save your data there with numpy.savez('d.npz', x_train=..." in err
    assert "Traceback" not in err


def test_npz_a_file_with_pickled_objects_or_not_an_npz_is_refused(tmp_path):
    bad = tmp_path / "d.npz"
    bad.write_text("x_train,y_train\n")
    with pytest.raises(ConfigError, match=r"d.npz is not an .npz file \("):
        NpzData(path=str(bad)).setup(num_clients=1, seed=0)
    objects = np.empty(2, dtype=object)
    np.savez(bad, x_train=objects, y_train=[0, 1], x_test=objects, y_test=[0, 1])
    with pytest.raises(ConfigError, match=r"d.npz is not an .npz file \(.*allow_pickle"):
        NpzData(path=str(bad)).setup(num_clients=1, seed=0)


def test_npz_tabular_features_with_the_mlp_builder_and_no_in_features_fit_and_inspect(tmp_path, capsys):
    """30 features and digits_mlp without in_features: the builder gets the data's 30 (its default is 64)."""
    x, y = blobs(600, 30, 3, seed=0)
    tx, ty = blobs(150, 30, 3, seed=1)
    path = write_npz(tmp_path / "tab.npz", x_train=x, y_train=y, x_test=tx, y_test=ty)
    data = {
        "class_path": "fl_lightning.data.NpzData",
        "init_args": {"path": path, "partitioner": {"class_path": "fl_lightning.data.DirichletPartitioner",
                                                    "init_args": {"alpha": 0.5, "min_partition_size": 10}}},
    }  # fmt: skip
    config = recipe(tmp_path, data)
    assert "8 clients, 3 classes" in inspect_writes_a_chart(tmp_path, config, capsys)
    summary = fit(tmp_path, config, "--rounds", "6", "--eval_every", "6")
    assert summary["final"]["global/test_acc"] > 0.8  # three separated blobs: learnt (chance 1/3)
    assert "in_features" not in (tmp_path / "run/config.yaml").read_text()  # inferred, not written by the user


def test_npz_takes_the_partition_and_local_splits_of_the_bundled_sets(tmp_path):
    """The shared options reach FederatedData: a Dirichlet partition with a local val split, as on the bundled sets."""
    x, y = blobs(200, 4, 4, seed=0)
    path = write_npz(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:20], y_test=y[:20])
    data = NpzData(path=path, partitioner=DirichletPartitioner(alpha=0.3, min_partition_size=5),
                   local_split=(0.8, 0.2, 0.0))  # fmt: skip
    data.setup(num_clients=5, seed=3)
    assert sum(len(c.train) + len(c.val) for c in data.clients) == 200
    assert all(len(c.val) > 0 for c in data.clients)
