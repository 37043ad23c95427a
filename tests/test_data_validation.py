"""Data a user hands over is checked at the door: labels outside the class range, values a format does not allow,
shapes that do not agree, empty splits, files that are not files, and a model too small for the data each end in
one sentence naming the file (or the split), what is wrong and the first offending index, before training."""

from __future__ import annotations

import gzip
import io
import json
import os
import pickle
import resource
import zlib
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pandas as pd
import pytest
import soundfile
import torch
from PIL import Image
from test_benchmark_data import write_tff
from test_vision_data import write_cifar10, write_idx
from torch import nn

from fl_lightning.client.data_fit import check_models_fit_data
from fl_lightning.data import (
    Cifar10Data,
    Cinic10Data,
    DataArrays,
    DigitsData,
    FedCifar100Data,
    FederatedData,
    FemnistData,
    ImdbData,
    MnistData,
    SpeechCommandsData,
    StackOverflowData,
)
from fl_lightning.federation.errors import ConfigError
from fl_lightning.models import FeatureClassifier
from fl_lightning.models.paper001 import imdb_bilstm

RNG = np.random.default_rng(0)


# ---------------------------------------------------------------------------------------------- small real files
def write_mnist(root: Path, train_labels=None, train_images=None) -> Path:
    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = RNG.integers(0, 256, (12, 28, 28)) if train_images is None else train_images
    write_idx(raw / "train-images-idx3-ubyte.gz", images)
    write_idx(raw / "train-labels-idx1-ubyte.gz", np.arange(12) % 10 if train_labels is None else train_labels)
    write_idx(raw / "t10k-images-idx3-ubyte.gz", images[:4])
    write_idx(raw / "t10k-labels-idx1-ubyte.gz", np.arange(4))
    return raw


def write_leaf(root: Path, writers: dict[str, tuple]) -> Path:
    folder = root / "femnist" / "all_data"
    folder.mkdir(parents=True)
    users = {w: {"x": np.asarray(x).tolist(), "y": list(y)} for w, (x, y) in writers.items()}
    path = folder / "all_data_0.json"
    path.write_text(json.dumps({"users": list(users), "user_data": users}))  # NaN is written as NaN, as json reads
    return path


def leaf_writer(n: int = 10, label: int = 0):
    return RNG.random((n, 784)).round(3), [label] * n


def write_fed_cifar100(root: Path, train: dict | None = None, test: dict | None = None) -> Path:
    folder = root / "fed_cifar100"
    folder.mkdir(parents=True)

    def image(n):
        return RNG.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)

    train = train or {str(i): (image(5), np.full(5, i, dtype=np.int64)) for i in range(3)}
    write_tff(folder / "fed_cifar100_train.h5", train, ("image", "label"))
    write_tff(folder / "fed_cifar100_test.h5", test or {"0": (image(3), np.arange(3))}, ("image", "label"))
    return folder


def write_stackoverflow(root: Path) -> Path:
    folder = root / "stackoverflow"
    folder.mkdir()
    (folder / "stackoverflow.word_count").write_text("the 100\nto 50\ncode 20\n")
    write_tff(folder / "stackoverflow_train.h5", {"u": ([b"the code"], [b"question"])}, ("tokens", "type"))
    write_tff(folder / "stackoverflow_test.h5", {"t": ([b"to"], [b"answer"])}, ("tokens", "type"))
    return folder


def write_speech(root: Path, wave: np.ndarray | None = None) -> Path:
    folder = root / "speech_commands_v0.02"
    (folder / "yes").mkdir(parents=True)
    for speaker in ("aaa", "bbb"):
        soundfile.write(folder / "yes" / f"{speaker}_nohash_0.wav", RNG.uniform(-0.5, 0.5, 16_000), 16_000)
    if wave is not None:
        soundfile.write(folder / "yes" / "aaa_nohash_0.wav", wave, 16_000, subtype="FLOAT")
    (folder / "testing_list.txt").write_text("yes/bbb_nohash_0.wav\n")
    return folder


def write_imdb(root: Path, train_labels=(1, 0)) -> Path:
    folder = root / "imdb"
    folder.mkdir()
    texts = ["a good film", "a bad film"]
    pd.DataFrame({"text": texts, "label": list(train_labels)}).to_parquet(folder / "train-00000-of-00001.parquet")
    pd.DataFrame({"text": texts, "label": [1, 0]}).to_parquet(folder / "test-00000-of-00001.parquet")
    pd.DataFrame({"text": texts, "label": [-1, -1]}).to_parquet(folder / "unsupervised-00000-of-00001.parquet")
    return folder


def write_cinic(root: Path) -> None:
    for split in ("train", "test"):
        for name in Cinic10Data.classes:
            folder = root / "CINIC-10" / split / name
            folder.mkdir(parents=True)
            Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(folder / "0.png")


# ---------------------------------------------------------------------------------------------- files of the wrong kind
def _mnist(root):
    write_mnist(root)
    return "MNIST/raw/train-labels-idx1-ubyte.gz", "an MNIST idx file", MnistData(data_dir=str(root))


def _cifar(root):
    write_cifar10(root, per_batch=2, test=2)
    return "cifar-10-batches-py/data_batch_3", "a CIFAR batch file", Cifar10Data(data_dir=str(root))


def _cinic(root):
    write_cinic(root)
    return "CINIC-10/train/cat/0.png", "a CINIC-10 image", Cinic10Data(data_dir=str(root))


def _femnist(root):
    write_leaf(root, {"w": leaf_writer()})
    return "femnist/all_data/all_data_0.json", "a LEAF FEMNIST JSON file", FemnistData(data_dir=str(root), hub_id=None)


def _fed_cifar100(root):
    write_fed_cifar100(root)
    return "fed_cifar100/fed_cifar100_train.h5", "a TFF h5 file", FedCifar100Data(data_dir=str(root))


def _word_count(root):
    write_stackoverflow(root)
    return "stackoverflow/stackoverflow.word_count", "a word count file", StackOverflowData(data_dir=str(root))


def _speech(root):
    write_speech(root)
    return "speech_commands_v0.02/testing_list.txt", "a text file of test clips", SpeechCommandsData(data_dir=str(root))


def _imdb(root):
    write_imdb(root)
    return "imdb/test-00000-of-00001.parquet", "an IMDB parquet file", ImdbData(data_dir=str(root))


LOADERS = {
    "mnist": _mnist,
    "cifar10": _cifar,
    "cinic10": _cinic,
    "femnist": _femnist,
    "fed_cifar100": _fed_cifar100,
    "stackoverflow": _word_count,
    "speech_commands": _speech,
    "imdb": _imdb,
}
KINDS = {  # how the file is replaced, and what the message says it is
    "directory": (lambda path, tmp: path.mkdir(), "is a directory, not"),
    "link to /dev/zero": (
        lambda path, tmp: path.symlink_to("/dev/zero"),
        "is a symbolic link to /dev/zero, a character",
    ),
    "link to nothing": (lambda path, tmp: path.symlink_to(tmp / "nowhere"), "which does not exist"),
    "named pipe": (lambda path, tmp: os.mkfifo(path), "is a named pipe (FIFO), not"),
}


@pytest.fixture
def bounded_memory():
    """Reading a device without end fails with MemoryError within 2 GiB more, instead of exhausting the machine."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    used = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (used + (2 << 30), hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("loader", LOADERS)
def test_a_data_file_that_is_not_a_file_is_named_before_a_byte_is_read(tmp_path, loader, kind, bounded_memory):
    relative, what, data = LOADERS[loader](tmp_path)
    path = tmp_path / relative
    path.unlink()
    make, said = KINDS[kind]
    make(path, tmp_path)
    with pytest.raises(ConfigError) as err:
        data.load()
    message = str(err.value)
    assert message.startswith(f"{path} ") and said in message and what in message, message
    assert f"flrun data fetch {loader} --data_dir {tmp_path}`." in message or loader == "femnist", message


# ---------------------------------------------------------------------------------------------- labels and values
@pytest.mark.parametrize("label, index", [(10, 3), (255, 0)])
def test_mnist_labels_outside_0_to_9_name_the_file_and_the_first_one(tmp_path, label, index):
    labels = np.arange(12) % 10
    labels[index] = label
    labels[11] = label
    raw = write_mnist(tmp_path, train_labels=labels)
    with pytest.raises(ConfigError) as err:
        MnistData(data_dir=str(tmp_path)).setup(num_clients=2, seed=0)
    assert str(err.value).startswith(
        f"{raw}/train-labels-idx1-ubyte.gz is not an MNIST idx file (label {label} at index {index} is outside 0..9); "
        f"replace it"
    )


def test_mnist_idx_headers_that_break_the_format(tmp_path):
    raw = write_mnist(tmp_path)
    labels = raw / "train-labels-idx1-ubyte.gz"
    write_idx(labels, (np.arange(12) % 10).reshape(2, 3, 2))  # the same bytes, three dimensions
    with pytest.raises(ConfigError, match=r"labels-idx1-ubyte.gz is not an MNIST idx file \(its header says 3 dim"):
        MnistData(data_dir=str(tmp_path)).load()
    write_idx(labels, np.arange(12) % 10)
    write_idx(raw / "train-images-idx3-ubyte.gz", np.zeros((12, 32, 32)))
    with pytest.raises(ConfigError, match=r"images-idx3-ubyte.gz is not an MNIST idx file \(its images are 32x32"):
        MnistData(data_dir=str(tmp_path)).load()
    with gzip.open(raw / "train-images-idx3-ubyte.gz", "wb") as f:  # promises 2^96 bytes: never allocated
        f.write(bytes([0, 0, 8, 3]) + b"\xff\xff\xff\xff" * 3 + bytes(100))
    with pytest.raises(ConfigError, match=r"its header says 79,228,162,458,924,105,385,300,197,375 values"):
        MnistData(data_dir=str(tmp_path)).load()


@pytest.mark.parametrize(
    "dtype, value, said",
    [
        (np.float64, np.nan, "image 1 holds nan (float64)"),
        (np.float64, 300.0, "image 1 holds 300 (float64)"),
        (np.float32, 0.5, "image 1 holds 0.5 (float32)"),
        (np.int16, -1, "image 1 holds -1 (int16)"),
    ],
)
def test_cifar_pixels_that_uint8_would_change_are_refused(tmp_path, dtype, value, said):
    write_cifar10(tmp_path, per_batch=3, test=2)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    batch = pickle.loads(path.read_bytes())
    data = batch["data"].astype(dtype)
    data[1, 7] = value
    path.write_bytes(pickle.dumps({**batch, "data": data}))
    with pytest.raises(ConfigError) as err:
        Cifar10Data(data_dir=str(tmp_path)).setup(num_clients=2, seed=0)
    assert str(err.value).startswith(f"{path} is not a CIFAR batch file ({said}, not a uint8 pixel 0..255); replace")


def test_cifar_pixels_stored_as_whole_numbers_of_another_type_load_as_uint8(tmp_path):
    write_cifar10(tmp_path, per_batch=3, test=2)
    path = tmp_path / "cifar-10-batches-py" / "data_batch_2"
    batch = pickle.loads(path.read_bytes())
    before = Cifar10Data(data_dir=str(tmp_path)).load()
    path.write_bytes(pickle.dumps({**batch, "data": batch["data"].astype(np.float64)}))
    after = Cifar10Data(data_dir=str(tmp_path)).load()
    assert torch.equal(before.x, after.x) and torch.equal(before.y, after.y)


@pytest.mark.parametrize(
    "writer, said",
    [
        (leaf_writer(label=62), "writer w: label 62 at index 0 is outside 0..61"),
        (leaf_writer(label=-1), "writer w: label -1 at index 0 is outside 0..61"),
        ((RNG.random((2, 784)), [3, 1.5]), "writer w: label 1.5 at index 1 is not a whole number"),
        (
            (np.where(np.arange(784) == 9, np.nan, 0.5)[None].repeat(3, 0), [0, 1, 2]),
            "writer w: image 0 holds nan, not a value in [0, 1]",
        ),
        ((np.full((3, 784), 255.0), [0, 1, 2]), "writer w: image 0 holds 255, not a value in [0, 1]"),
    ],
    ids=["label_62", "label_-1", "label_1.5", "nan_pixel", "pixel_255"],
)
def test_femnist_leaf_labels_and_pixels_outside_the_format(tmp_path, writer, said):
    path = write_leaf(tmp_path, {"ok": leaf_writer(), "w": writer})
    with pytest.raises(ConfigError) as err:
        FemnistData(data_dir=str(tmp_path), hub_id=None).setup(num_clients=2, seed=0)
    assert str(err.value) == f"{path} is not a LEAF FEMNIST JSON file ({said}); check the file or give another one."


def test_femnist_hub_characters_outside_0_to_61(tmp_path):
    hub = tmp_path / "femnist" / "hub"
    hub.mkdir(parents=True)
    png = io.BytesIO()
    Image.fromarray(np.zeros((28, 28), dtype=np.uint8)).save(png, format="PNG")
    cells = [{"bytes": png.getvalue(), "path": None}] * 3
    path = hub / "train-0.parquet"
    pd.DataFrame({"image": cells, "writer_id": ["a", "a", "b"], "character": [0, 62, 1]}).to_parquet(path)
    with pytest.raises(ConfigError, match=rf"{path} is not a FEMNIST parquet file \(label 62 at index 1 is outside"):
        FemnistData(data_dir=str(tmp_path)).load()


def test_fed_cifar100_labels_and_pixels_outside_the_format(tmp_path):
    images = RNG.integers(0, 256, (4, 32, 32, 3), dtype=np.uint8)
    folder = write_fed_cifar100(tmp_path / "a", train={"7": (images, np.array([1, 2, 100, 3]))})
    with pytest.raises(ConfigError) as err:
        FedCifar100Data(data_dir=str(tmp_path / "a")).setup(num_clients=1, seed=0)
    assert str(err.value).startswith(
        f"{folder}/fed_cifar100_train.h5 is not a TFF h5 file (client 7: label 100 at index 2 is outside 0..99);"
    )
    unit = (images / 255.0).astype(np.float32)  # already in [0, 1]: dividing by 255 again would be silent
    folder = write_fed_cifar100(tmp_path / "b", train={"7": (unit, np.arange(4))})
    with pytest.raises(ConfigError, match=r"\(client 7: image 0 holds 0\.\d+ \(float32\), not a uint8 pixel 0..255\)"):
        FedCifar100Data(data_dir=str(tmp_path / "b")).load()
    folder = write_fed_cifar100(tmp_path / "c", test={"t": (images, np.array([0, -1, 0, 0]))})
    with pytest.raises(ConfigError, match=r"fed_cifar100_test.h5 is not a TFF h5 file \(client t: label -1 at index 1"):
        FedCifar100Data(data_dir=str(tmp_path / "c")).load()


def _png_header(width: int, height: int) -> bytes:
    """A PNG that declares ``width`` x ``height`` RGB pixels and holds none (a decompression bomb's header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([8, 2, 0, 0, 0])
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


@pytest.mark.parametrize("size", [40_000, 10_000])  # beyond PIL's bomb limit, and below it (it would decode)
def test_images_declaring_a_huge_size_are_refused_from_their_header(tmp_path, size, bounded_memory):
    write_cinic(tmp_path)
    png = tmp_path / "CINIC-10" / "train" / "cat" / "0.png"
    png.write_bytes(_png_header(size, size))
    with pytest.raises(ConfigError, match=rf"cat/0.png is not a CINIC-10 image \((Image size|a {size}x{size} image)"):
        Cinic10Data(data_dir=str(tmp_path)).load()
    hub = tmp_path / "femnist" / "hub"
    hub.mkdir(parents=True)
    cells = [{"bytes": _png_header(size, 28), "path": None}]
    pd.DataFrame({"image": cells, "writer_id": ["a"], "character": [0]}).to_parquet(hub / "train-0.parquet")
    with pytest.raises(
        ConfigError, match=rf"train-0.parquet is not a FEMNIST parquet file \(a {size}x28 image, not 28x28"
    ):
        FemnistData(data_dir=str(tmp_path)).load()


def test_an_h5_file_declaring_more_images_than_it_holds_is_refused_before_reading(tmp_path, bounded_memory):
    folder = write_fed_cifar100(tmp_path)
    path = folder / "fed_cifar100_train.h5"
    with h5py.File(path, "w") as f:  # 10^7 images (30 GB) of fill values in a file of a few kilobytes
        f.create_dataset("examples/0/image", shape=(10**7, 32, 32, 3), dtype=np.uint8)
        f.create_dataset("examples/0/label", shape=(10**7,), dtype=np.int64)
    assert path.stat().st_size < 100_000
    with pytest.raises(ConfigError, match=r"\(its clients declare 10,000,000 images, more than Federated CIFAR-100's"):
        FedCifar100Data(data_dir=str(tmp_path)).load()
    with h5py.File(path, "w") as f:
        f.create_group("examples")
    with pytest.raises(ConfigError, match=r"fed_cifar100_train.h5 is not a TFF h5 file \(its examples group holds no"):
        FedCifar100Data(data_dir=str(tmp_path)).load()


def test_a_speech_clip_holding_nan_and_a_test_list_without_clips(tmp_path):
    wave = np.zeros(16_000, dtype=np.float32)
    wave[123] = np.nan
    folder = write_speech(tmp_path / "a", wave)
    with pytest.raises(ConfigError, match=r"aaa_nohash_0.wav is not a WAV file \(sample 123 holds nan, not a finite"):
        SpeechCommandsData(data_dir=str(tmp_path / "a")).load()
    folder = write_speech(tmp_path / "b")
    for wav in (folder / "yes").iterdir():
        wav.unlink()
    with pytest.raises(ConfigError, match="Speech Commands v0.02 not found"):
        SpeechCommandsData(data_dir=str(tmp_path / "b")).load()


def test_imdb_labels_outside_0_and_1(tmp_path):
    folder = write_imdb(tmp_path, train_labels=(1, 2))
    with pytest.raises(ConfigError, match=rf"{folder}/train-00000-of-00001.parquet is not an IMDB parquet file "):
        ImdbData(data_dir=str(tmp_path)).load()
    with pytest.raises(ConfigError, match=r"\(label 2 at index 1 is outside 0..1\)"):
        ImdbData(data_dir=str(tmp_path)).load()


def test_stackoverflow_text_files_that_break_their_format(tmp_path):
    folder = write_stackoverflow(tmp_path)
    (folder / "stackoverflow.word_count").write_text("the 100\n\nto 50\n")
    with pytest.raises(ConfigError, match=r"stackoverflow.word_count is not a word count file \(line 2 is empty"):
        StackOverflowData(data_dir=str(tmp_path), vocab_size=3).load()
    (folder / "stackoverflow.word_count").write_text("the 100\nto 50\n")
    write_tff(folder / "stackoverflow_train.h5", {"u": ([b"the \xff\xfe"], [b"question"])}, ("tokens", "type"))
    with pytest.raises(ConfigError, match=r"stackoverflow_train.h5 is not a TFF h5 file \('utf-8' codec can't decode"):
        StackOverflowData(data_dir=str(tmp_path), vocab_size=2).load()
    write_tff(folder / "stackoverflow_train.h5", {"u": ([b"the to"], [b"question"])}, ("tokens", "type"))
    texts = tmp_path / "c4.json"
    texts.write_text('{"text": "the end"}\n{"text": 7}\n')
    data = StackOverflowData(data_dir=str(tmp_path), vocab_size=2, distillation_texts=str(texts))
    with pytest.raises(ConfigError, match=r"c4.json is not a C4 text file \(the text of line 2 is int, not a string\)"):
        data.load()


# ---------------------------------------------------------------------------------------------- the door
class Given(FederatedData):
    """A user's own data set: whatever arrays its load() hands over."""

    def __init__(self, arrays: DataArrays, **kwargs):
        super().__init__(**kwargs)
        self.arrays = arrays

    def load(self) -> DataArrays:
        return self.arrays


def given(**changes) -> Given:
    arrays = {
        "x": torch.rand(20, 4),
        "y": torch.arange(20) % 4,
        "test_x": torch.rand(8, 4),
        "test_y": torch.arange(8) % 4,
    }
    arrays["num_classes"] = 4
    return Given(DataArrays(**{**arrays, **changes}))


def _set(tensor: torch.Tensor, index, value) -> torch.Tensor:
    tensor = tensor.clone()
    tensor[index] = value
    return tensor


DOOR = {
    "label = num_classes": (
        {"y": _set(torch.arange(20) % 4, 6, 4)},
        "in Given's training pool, label 4 at index 6 is outside 0..3 (the data set has 4 classes); check its files or "
        "its num_classes.",
    ),
    "negative test label": ({"test_y": _set(torch.arange(8) % 4, 5, -1)}, "global test set, label -1 at index 5"),
    "label beyond the inferred count in the test set only": (
        {"num_classes": None, "test_y": _set(torch.arange(8) % 4, 2, -3)},
        "global test set, label -3 at index 2 is outside 0..3",
    ),
    "fractional label": (
        {"y": _set((torch.arange(20) % 4).float(), 9, 2.5)},
        "training pool, label 2.5 at index 9 is not a whole number",
    ),
    "NaN label": ({"y": _set((torch.arange(20) % 4).float(), 0, float("nan"))}, "label nan at index 0"),
    "NaN feature": (
        {"x": _set(torch.rand(20, 4), (13, 2), float("nan"))},
        "in Given's training pool, example 13 holds nan; every feature must be a finite number",
    ),
    "infinite test feature": ({"test_x": _set(torch.rand(8, 4), (7, 0), float("-inf"))}, "example 7 holds -inf"),
    "NaN unlabeled example": (
        {"unlabeled_x": _set(torch.rand(5, 4), (4, 3), float("nan"))},
        "in Given's unlabeled examples, example 4 holds nan",
    ),
    "no training examples": ({"x": torch.rand(0, 4), "y": torch.zeros(0)}, "Given has no training examples"),
    "fewer labels than examples": ({"y": torch.arange(19) % 4}, "training pool holds 20 examples but 19 labels"),
    "test examples of another shape": ({"test_x": torch.rand(8, 5)}, "shape [5] (torch.float32), the training pool"),
    "test examples of another type": ({"test_x": torch.rand(8, 4).double()}, "[4] (torch.float64), the training"),
    "natural ids of another length": ({"groups": np.zeros(19)}, "gives 19 natural ids for 20 training examples"),
    "numpy arrays instead of tensors": (
        {"test_y": np.arange(8) % 4},
        "gives test_y as ndarray; DataArrays holds torch",
    ),
    "num_classes zero": ({"num_classes": 0}, "gives num_classes 0; it must be a positive whole number"),
    "num_classes fractional": ({"num_classes": 2.5}, "gives num_classes 2.5"),
    "sequence target outside the vocabulary": (
        {
            "x": torch.ones(20, 3).long(),
            "y": _set(torch.full((20, 3), -100), (4, 1), 9),
            "test_x": torch.ones(8, 3).long(),
            "test_y": torch.full((8, 3), 1),
        },
        "training pool, label 9 at index 4 is outside 0..3",
    ),
}


@pytest.mark.parametrize("case", DOOR)
def test_arrays_no_run_could_use_are_refused_at_the_door(case):
    changes, said = DOOR[case]
    with pytest.raises(ConfigError) as err:
        given(**changes).setup(num_clients=2, seed=0)
    assert said in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_the_door_lets_sequences_with_ignored_targets_and_an_inferred_class_count_through():
    y = _set(torch.full((20, 3), -100), (slice(None), 0), 2)
    tokens = {"x": torch.ones(20, 3).long(), "test_x": torch.ones(8, 3).long(), "test_y": torch.full((8, 3), 3)}
    data = given(num_classes=None, y=y, **tokens)
    data.setup(num_clients=2, seed=0)
    assert data.num_classes == 4 and data.partition_summary()["num_clients"] == 2


def test_a_server_data_set_with_nan_examples_is_refused():
    outside = given(x=_set(torch.rand(20, 4), (2, 1), float("nan")))
    data = Given(given().arrays, server_dataset=outside)
    with pytest.raises(ConfigError, match=r"in server_dataset Given's examples, example 2 holds nan"):
        data.setup(num_clients=2, seed=0)


# ---------------------------------------------------------------------------------------------- model against data
def _slots(**models: nn.Module) -> dict:
    return {role: SimpleNamespace(module=SimpleNamespace(model=model)) for role, model in models.items()}


def test_a_model_predicting_fewer_classes_than_the_data_has_is_refused():
    small = FeatureClassifier(nn.Flatten(), nn.Linear(64, 8), 64, 8)
    with pytest.raises(ConfigError) as err:
        check_models_fit_data(
            _slots(big=FeatureClassifier(nn.Flatten(), nn.Linear(64, 12), 64, 12), small=small), 10, torch.rand(4, 64)
        )
    assert str(err.value) == (
        "model role 'small' predicts 8 classes (its num_classes) but the data has 10; leave num_classes out of "
        "models.small.args (the data's count is passed) or set it to 10."
    )
    check_models_fit_data(
        _slots(exact=FeatureClassifier(nn.Flatten(), nn.Linear(64, 10), 64, 10)), 10, torch.rand(4, 64)
    )
    check_models_fit_data(_slots(own=nn.Linear(64, 3)), 10, torch.rand(4, 64))  # a module that declares no count


@pytest.mark.parametrize(
    "features, x, said",
    [
        (
            nn.Sequential(nn.Conv2d(3, 4, 3)),
            torch.rand(2, 1, 8, 8),
            "takes 3 input channels but the data's examples have 1",
        ),
        (
            nn.Sequential(nn.Flatten(), nn.Linear(100, 4)),
            torch.rand(2, 1, 8, 8),
            "takes 100 input features but the data's examples flatten to 64",
        ),
        (nn.Sequential(nn.Linear(5, 4)), torch.rand(2, 6), "takes 5 input features but the data's examples end in 6"),
        (
            nn.Sequential(nn.Sequential(nn.Conv1d(2, 4, 3)), nn.Flatten()),
            torch.rand(2, 3, 9),
            "takes 2 input channels but the data's examples have 3",
        ),
    ],
    ids=["conv_channels", "flattened_features", "linear_features", "nested_conv1d"],
)
def test_a_model_whose_first_layer_cannot_take_the_examples_is_refused(features, x, said):
    model = FeatureClassifier(features, nn.Linear(4, 10), 4, 10)
    with pytest.raises(ConfigError) as err:
        check_models_fit_data(_slots(m=model), 10, x, input_roles=["m"])
    assert str(err.value).startswith(f"model role 'm' {said} (shape {list(x.shape[1:])}); set the builder's input size")


def test_a_first_layer_the_examples_fit_or_one_the_model_hides_passes():
    fits = [
        (nn.Sequential(nn.Conv2d(1, 4, 3)), torch.rand(2, 1, 8, 8)),
        (nn.Sequential(nn.Flatten(), nn.Linear(64, 4)), torch.rand(2, 1, 8, 8)),
        (nn.Sequential(nn.Linear(8, 4)), torch.rand(2, 1, 8, 8)),  # applied to the last dimension
        (nn.Sequential(nn.Flatten(start_dim=2), nn.Linear(7, 4)), torch.rand(2, 1, 8, 8)),  # not the usual flatten
    ]
    for features, x in fits:
        check_models_fit_data(_slots(m=FeatureClassifier(features, nn.Linear(4, 10), 4, 10)), 10, x, ["m"])

    server = FeatureClassifier(nn.Sequential(nn.Conv2d(16, 4, 3)), nn.Linear(4, 10), 4, 10)  # FedGKT's: feature maps
    check_models_fit_data(_slots(server=server), 10, torch.rand(2, 1, 8, 8), input_roles=["client"])

    class Pooled(nn.Module):  # what a custom forward does first is unknown: no check, no false refusal
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 4)

        def forward(self, x):
            return self.linear(nn.functional.avg_pool2d(x, 2).flatten(1))

    check_models_fit_data(
        _slots(m=FeatureClassifier(Pooled(), nn.Linear(4, 10), 4, 10)), 10, torch.rand(2, 1, 8, 8), ["m"]
    )


def test_a_model_embedding_fewer_token_ids_than_the_data_uses_is_refused():
    model = imdb_bilstm(num_classes=2, vocab_size=50, embedding=4, hidden=4)
    tokens = _set(torch.randint(0, 50, (6, 9)), (0, 0), 0)
    check_models_fit_data(_slots(text=model), 2, tokens, ["text"])
    with pytest.raises(
        ConfigError, match=r"model role 'text' embeds token ids 0..49 but the data's inputs hold ids 0..80; "
    ):
        check_models_fit_data(_slots(text=model), 2, _set(tokens, (3, 3), 80), ["text"])


def test_valid_data_passes_the_door_unchanged():
    data = DigitsData()
    arrays = data.load()
    x, y = arrays.x.clone(), arrays.y.clone()
    data.load = lambda: arrays
    data.setup(num_clients=4, seed=0)
    assert torch.equal(arrays.x, x) and torch.equal(arrays.y, y) and data.num_classes == 10
