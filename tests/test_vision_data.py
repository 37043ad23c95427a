"""Image loaders read small files written here in the published formats, through the users' code path."""

import gzip
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from fl_lightning.data import DirichletPartitioner
from fl_lightning.data.transforms import random_crop_flip
from fl_lightning.data.vision import CIFAR_MEAN, CIFAR_STD, Cifar10Data, Cifar100Data, Cinic10Data, MnistData
from fl_lightning.federation.errors import ConfigError

RNG = np.random.default_rng(0)


def write_cifar10(root, per_batch=20, test=30):
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    batches = {f"data_batch_{i}": per_batch for i in range(1, 6)} | {"test_batch": test}
    for name, n in batches.items():
        data = {
            "data": RNG.integers(0, 256, (n, 3072), dtype=np.uint8),
            "labels": (np.arange(n) % 10).tolist(),
            "batch_label": name,
            "filenames": [f"{i}.png" for i in range(n)],
        }
        with (folder / name).open("wb") as f:
            pickle.dump(data, f)


def test_cifar10_pickles_load_normalised_nchw(tmp_path):
    write_cifar10(tmp_path)
    data = Cifar10Data(data_dir=str(tmp_path), partitioner=DirichletPartitioner(alpha=0.5, min_partition_size=5))
    data.setup(num_clients=4, seed=0)
    assert data.x.shape == (100, 3, 32, 32) and data.test_x.shape == (30, 3, 32, 32)
    assert data.y.tolist() == [i % 10 for i in range(20)] * 5
    raw = pickle.load((tmp_path / "cifar-10-batches-py/data_batch_1").open("rb"))["data"][0]
    red = raw[:1024].reshape(32, 32) / 255.0  # CIFAR stores the red plane first
    assert torch.allclose(
        data.x[0, 0], torch.tensor((red - CIFAR_MEAN[0]) / CIFAR_STD[0], dtype=torch.float32), atol=1e-5
    )
    assert sum(len(c.train) for c in data.clients) == 100


def test_symmetric_normalisation_maps_pixels_to_minus_one_one_as_pflib(tmp_path):
    write_cifar10(tmp_path)
    data = Cifar10Data(data_dir=str(tmp_path), normalize="symmetric")
    data.setup(num_clients=2, seed=0)
    raw = pickle.load((tmp_path / "cifar-10-batches-py/data_batch_1").open("rb"))["data"][0]
    red = raw[:1024].reshape(32, 32) / 255.0
    # PFLlib's Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)): (x - 0.5) / 0.5
    assert torch.allclose(data.x[0, 0], torch.tensor((red - 0.5) / 0.5, dtype=torch.float32), atol=1e-6)


def test_cifar100_uses_fine_labels(tmp_path):
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for name, n in (("train", 40), ("test", 10)):
        data = {
            "data": RNG.integers(0, 256, (n, 3072), dtype=np.uint8),
            "fine_labels": (np.arange(n) % 100).tolist(),
            "coarse_labels": [0] * n,
        }
        with (folder / name).open("wb") as f:
            pickle.dump(data, f)
    data = Cifar100Data(data_dir=str(tmp_path))
    data.setup(num_clients=2, seed=0)
    assert data.num_classes == 100 and data.y.max() == 39


def test_missing_files_name_the_file_and_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"cifar-10-batches-py/\{data_batch_1\.\.5,test_batch\}.*download: true"):
        Cifar10Data(data_dir=str(tmp_path)).load()
    with pytest.raises(ConfigError, match=r"MNIST/raw/\{train,t10k\}-\{images-idx3,labels-idx1\}-ubyte"):
        MnistData(data_dir=str(tmp_path)).load()
    with pytest.raises(ConfigError, match="CINIC-10"):
        Cinic10Data(data_dir=str(tmp_path)).load()


def write_idx(path, array):
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(s).to_bytes(4, "big") for s in array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def test_mnist_idx_files_with_fedhe_mean_image_subtraction(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = RNG.integers(0, 256, (12, 28, 28))
    write_idx(raw / "train-images-idx3-ubyte.gz", images)
    write_idx(raw / "train-labels-idx1-ubyte.gz", np.arange(12) % 10)
    write_idx(raw / "t10k-images-idx3-ubyte.gz", images[:4])
    write_idx(raw / "t10k-labels-idx1-ubyte.gz", np.arange(4))
    data = MnistData(data_dir=str(tmp_path))
    arrays = data.load()
    assert arrays.x.shape == (12, 1, 28, 28) and arrays.y.tolist() == (np.arange(12) % 10).tolist()
    mean_image = images / 255.0
    assert torch.allclose(
        arrays.x[0, 0], torch.tensor(mean_image[0] - mean_image.mean(0), dtype=torch.float32), atol=1e-5
    )
    assert torch.allclose(arrays.x.mean(0), torch.zeros(1, 28, 28), atol=1e-5)


def test_cinic10_png_folders(tmp_path):
    for split, n in (("train", 2), ("test", 1)):
        for name in Cinic10Data.classes:
            folder = tmp_path / "CINIC-10" / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(RNG.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    arrays = Cinic10Data(data_dir=str(tmp_path)).load()
    assert arrays.x.shape == (20, 3, 32, 32) and arrays.test_x.shape == (10, 3, 32, 32)
    assert arrays.y.tolist() == [c for c in range(10) for _ in range(2)]


def test_random_crop_flip_shifts_and_mirrors():
    x = torch.arange(16.0).reshape(1, 1, 4, 4).repeat(64, 1, 1, 1)
    out = random_crop_flip(x, torch.Generator().manual_seed(0), padding=1)
    assert out.shape == x.shape
    # every output is a shifted (and maybe mirrored) window of the zero-padded input
    padded = torch.nn.functional.pad(x[0, 0], (1, 1, 1, 1))
    windows = [padded[r : r + 4, c : c + 4] for r in range(3) for c in range(3)]
    windows += [w.flip(1) for w in windows]
    assert all(any(torch.equal(o[0], w) for w in windows) for o in out)
    assert len({tuple(o.flatten().tolist()) for o in out}) > 5  # not one crop for all
    same = random_crop_flip(x, torch.Generator().manual_seed(0), padding=1, per_example=False)
    assert all(torch.equal(same[0], s) for s in same)


class _RunsCode:
    """What a crafted pickle carries: unpickling it calls ``os.system`` with a command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_cifar_batch_that_would_run_code_is_refused_before_it_runs(tmp_path):
    write_cifar10(tmp_path)
    marker = tmp_path / "pwned"
    with (tmp_path / "cifar-10-batches-py" / "data_batch_3").open("wb") as f:
        pickle.dump({"data": _RunsCode(marker), "labels": [0]}, f)
    data = Cifar10Data(data_dir=str(tmp_path), partitioner=DirichletPartitioner(alpha=0.5, min_partition_size=5))
    with pytest.raises(ConfigError, match=r"data_batch_3 is not a CIFAR batch file \(refusing to load posix.system\)"):
        data.setup(num_clients=4, seed=0)
    assert not marker.exists()
