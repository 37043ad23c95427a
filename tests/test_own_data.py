"""The data sets read from a user's own files, on small files written here in their real formats: an .npz, a CSV and
a Parquet table, an image folder, a Hugging Face ``datasets`` copy saved to disk. Each is read, partitioned, checked
at the door, and run through ``flrun fit`` and ``flrun data inspect`` from a recipe in the test's folder."""

from __future__ import annotations

import json
import re
import sys

import numpy as np
import pytest
import torch
import yaml
from conftest import TINY, run_cli

from fl_lightning.data import DirichletPartitioner, HubData, IidPartitioner, ImageFolderData, NpzData, TableData
from fl_lightning.data.own import held_out
from fl_lightning.federation.errors import ConfigError
from fl_lightning.models.registry import ModelSpec
from fl_lightning.run.checkpoint import load_checkpoint, tensors_by_path

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
    generator = ModelSpec("random_image_generator").build(num_classes=4, **data.input_sizes())  # defaults: 1, 8x8
    assert generator.head(torch.zeros(2, 32)).shape == (2, 3, 6, 6)  # images of the data's shape


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
    assert run_cli("report", str(tmp_path / "run"), "--output", str(tmp_path / "report.html")) == 0
    measured = f'<td class="num">{summary["final"]["global/test_acc"]:.4f}</td>'
    assert measured in (tmp_path / "report.html").read_text()  # the run's final accuracy, in the report's table


def test_npz_takes_the_partition_and_local_splits_of_the_bundled_sets(tmp_path):
    """The shared options reach FederatedData: a Dirichlet partition with a local val split, as on the bundled sets."""
    x, y = blobs(200, 4, 4, seed=0)
    path = write_npz(tmp_path / "d.npz", x_train=x, y_train=y, x_test=x[:20], y_test=y[:20])
    data = NpzData(path=path, partitioner=DirichletPartitioner(alpha=0.3, min_partition_size=5),
                   local_split=(0.8, 0.2, 0.0))  # fmt: skip
    data.setup(num_clients=5, seed=3)
    assert sum(len(c.train) + len(c.val) for c in data.clients) == 200
    assert all(len(c.val) > 0 for c in data.clients)


# -------------------------------------------------------------------------------------------------------- tables
def write_csv(path, x: np.ndarray, y, header=None) -> str:
    names = header or [f"f{i}" for i in range(x.shape[1])]
    lines = [",".join([*names, "species"])]
    lines += [",".join([*(f"{v:.6f}" for v in row), str(label)]) for row, label in zip(x, y)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_parquet(path, x: np.ndarray, y) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {f"f{i}": x[:, i] for i in range(x.shape[1])} | {"species": np.asarray(y)}
    pq.write_table(pa.table(columns), path)
    return str(path)


NAMES = np.array(["setosa", "versicolor", "virginica"])


def test_a_csv_with_text_labels_holds_out_a_stratified_test_share_with_its_seed(tmp_path):
    x, y = blobs(60, 4, 3, seed=0)
    path = write_csv(tmp_path / "iris.csv", x, NAMES[y])
    data = TableData(path=path, label="species", features=["f2", "f0"], test_fraction=0.25, normalize="none")
    data.setup(num_clients=2, seed=5)
    assert data.classes == ["setosa", "versicolor", "virginica"] and data.num_classes == 3
    assert len(data.test_y) == 15 and data.test_y.bincount().tolist() == [5, 5, 5]  # 25 % of each class
    rows = {tuple(np.round(r, 4)) for r in x[:, [2, 0]]}
    assert {tuple(np.round(r, 4)) for r in data.test_x.numpy()} <= rows
    again = TableData(path=path, label="species", features=["f2", "f0"], test_fraction=0.25, normalize="none")
    again.setup(num_clients=2, seed=6)  # another run seed: the same test rows
    assert torch.equal(again.test_x, data.test_x)
    assert data.input_sizes()["in_features"] == 2


def test_a_parquet_table_with_a_test_file_keeps_the_training_file_s_class_names(tmp_path):
    x, y = blobs(30, 3, 3, seed=0)
    path = write_parquet(tmp_path / "train.parquet", x, NAMES[y])
    test = write_parquet(tmp_path / "test.parquet", x[:4], NAMES[[2, 2, 1, 2]])  # no setosa in the test file
    data = TableData(path=path, label="species", test_path=test, normalize="none")
    data.setup(num_clients=1, seed=0)
    assert data.test_y.tolist() == [2, 2, 1, 2] and data.x.shape == (30, 3)
    assert torch.allclose(data.x, torch.from_numpy(x))
    missing = write_parquet(tmp_path / "odd.parquet", x[:2], ["unknown", "setosa"])
    with pytest.raises(ConfigError, match="holds the label 'unknown', a class the training split does not have"):
        TableData(path=path, label="species", test_path=missing).setup(num_clients=1, seed=0)


@pytest.mark.parametrize(
    "text, options, says",
    [
        ("a,b\n1,0\n", {}, r"t.csv has no label column 'species' \(its columns: a, b\); name it with label"),
        ("a,species\n1,0\n,1\n", {}, "t.csv's feature column 'a' holds no value in row 2; every feature must be a "),
        ("a,species\n1,0\nx,1\n", {}, "feature column 'a' holds 'x' in row 2"),
        ("a,species\n1,0\n2,1.5\n", {}, r"t.csv's column 'species' holds the label 1.5 at index 1, not a whole"),
        ("a,species\n1,0\n2\n", {}, r"t.csv is not a CSV file \(row 2 has 1 cells but the header 2\)"),
        ("a,species\n1,0\n", {"features": ["b"]}, r"t.csv has no feature column 'b'"),
        ("a,a,species\n1,2,0\n", {}, "t.csv has two columns named 'a'"),
    ],
)
def test_tables_that_break_the_format_are_one_sentence(tmp_path, text, options, says):
    (tmp_path / "t.csv").write_text(text)
    with pytest.raises(ConfigError, match=says):
        TableData(path=str(tmp_path / "t.csv"), label="species", test_fraction=0.5, **options).setup(1, 0)


def test_a_missing_table_or_pyarrow_is_one_sentence_naming_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="nowhere.csv does not exist; put your table there"):
        TableData(path=str(tmp_path / "nowhere.csv")).setup(1, 0)
    x, y = blobs(10, 2, 2, seed=0)
    path = write_parquet(tmp_path / "t.parquet", x, y)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(ConfigError, match=r"needs pyarrow, which is not installed; .*fl-lightning\[parquet\]"):
        TableData(path=path, label="species").setup(1, 0)


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_a_table_runs_through_fit_and_inspect_with_the_mlp_builder(tmp_path, capsys, suffix):
    x, y = blobs(600, 12, 3, seed=0)
    write = write_csv if suffix == "csv" else write_parquet
    path = write(tmp_path / f"t.{suffix}", x, NAMES[y])
    data = {"class_path": "fl_lightning.data.TableData", "init_args": {"path": path, "label": "species"}}
    config = recipe(tmp_path, data)
    assert "8 clients, 3 classes" in inspect_writes_a_chart(tmp_path, config, capsys)
    summary = fit(tmp_path, config, "--rounds", "6", "--eval_every", "6")
    assert summary["final"]["global/test_acc"] > 0.8  # three separated blobs (chance 1/3)
    assert json.loads((tmp_path / "run/partition.json").read_text())["test_size"] == 120  # 20 % of each class held out


# -------------------------------------------------------------------------------------------------- image folders
def write_digit_folders(root, classes=(0, 1, 2), test_share=0.25) -> str:
    """scikit-learn's digits of ``classes`` as 8-bit greyscale PNGs in ``root/{train,test}/<name>/``."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for c in classes:
        images = digits.images[digits.target == c]
        cut = int(len(images) * (1 - test_share))
        for split, part in (("train", images[:cut]), ("test", images[cut:])):
            folder = root / split / f"digit_{c}"
            folder.mkdir(parents=True)
            for i, image in enumerate(part):
                Image.fromarray((image * 255 / 16).astype(np.uint8), mode="L").save(folder / f"{i:03d}.png")
    return str(root)


def test_an_image_folder_numbers_classes_in_sorted_order_and_reads_pixels(tmp_path):
    from PIL import Image

    root = write_digit_folders(tmp_path / "imgs", classes=(2, 0))
    data = ImageFolderData(path=root, normalize="none")
    data.setup(num_clients=2, seed=0)
    assert data.classes == ["digit_0", "digit_2"] and data.num_classes == 2
    assert data.x.shape[1:] == (1, 8, 8) and data.input_sizes() == {"in_channels": 1, "in_features": 64,
                                                                     "image_size": 8}  # fmt: skip
    first = np.asarray(Image.open(tmp_path / "imgs/train/digit_0/000.png"), dtype=np.float32) / 255
    assert torch.allclose(data.x[0, 0], torch.from_numpy(first)) and data.y[0] == 0
    assert len(data.test_y) == sum(1 for _ in (tmp_path / "imgs/test").rglob("*.png"))


def test_colour_images_of_two_sizes_resized_and_held_out_without_a_test_folder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for name in ("cat", "dog"):
        (tmp_path / "train" / name).mkdir(parents=True)
        for i in range(10):
            size = (12, 10) if i % 2 else (6, 6)
            pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(pixels, mode="RGB").save(tmp_path / "train" / name / f"{i}.jpg")
    (tmp_path / "train" / "notes.txt").write_text("not a class")
    with pytest.raises(ConfigError, match=r"1.jpg is 12x10 pixels but .*0.jpg is 6x6; give image_size to resize"):
        ImageFolderData(path=str(tmp_path)).setup(1, 0)
    data = ImageFolderData(path=str(tmp_path), image_size=8, test_fraction=0.2)
    data.setup(num_clients=1, seed=0)
    assert data.x.shape == (16, 3, 8, 8) and data.test_y.tolist() == [0, 0, 1, 1]  # 20 % of each class


@pytest.mark.parametrize(
    "layout, says",
    [
        ([], r"train is not a folder; put one folder of images per class there"),
        (["train/a/x.txt"], r"train/a holds no images"),
        (["train/a/0.png", "test/b/0.png"], r"test has a class folder 'b' that .*train has not"),
        (["train/a/0.png", "train/b/0.png", "train/b/1.png"], r"test_fraction 0.2 leaves .* no test examples"),
    ],
)
def test_image_folders_that_break_the_layout_are_one_sentence(tmp_path, layout, says):
    from PIL import Image

    for name in layout:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".png"):
            Image.fromarray(np.zeros((4, 4), dtype=np.uint8)).save(tmp_path / name)
        else:
            (tmp_path / name).write_text("")
    with pytest.raises(ConfigError, match=says):
        ImageFolderData(path=str(tmp_path)).setup(1, 0)


def test_a_broken_image_is_named(tmp_path):
    root = write_digit_folders(tmp_path / "imgs", classes=(0, 1))
    (tmp_path / "imgs/train/digit_1/000.png").write_bytes(b"not a png")
    with pytest.raises(ConfigError, match=r"digit_1/000.png is not an image \("):
        ImageFolderData(path=root).setup(1, 0)


def test_an_image_folder_runs_through_fit_and_inspect_with_the_cnn_builder(tmp_path, capsys):
    root = write_digit_folders(tmp_path / "imgs")
    data = {"class_path": "fl_lightning.data.ImageFolderData", "init_args": {"path": root}}
    config = recipe(tmp_path, data, models={"global": {"builder": "digits_cnn"}})
    assert "8 clients, 3 classes" in inspect_writes_a_chart(tmp_path, config, capsys)
    summary = fit(tmp_path, config, "--rounds", "6", "--eval_every", "6")
    assert summary["final"]["global/test_acc"] > 0.8  # real digits 0, 1 and 2 (chance 1/3)


# -------------------------------------------------------------------------------------------- Hugging Face datasets
def save_digit_images(folder, classes=(0, 1, 2)) -> str:
    """scikit-learn's digits of ``classes`` as a ``datasets`` DatasetDict (train / test, PIL images, ClassLabel),
    saved with save_to_disk: what a user copies from a machine with internet."""
    import datasets
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    keep = np.isin(digits.target, classes)
    images = [Image.fromarray((im * 255 / 16).astype(np.uint8), mode="L") for im in digits.images[keep]]
    labels = [classes.index(t) for t in digits.target[keep]]
    features = datasets.Features(
        {"img": datasets.Image(), "label": datasets.ClassLabel(names=[f"digit {c}" for c in classes])}
    )
    cut = int(len(images) * 0.75)
    splits = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"img": images[:cut], "label": labels[:cut]}, features=features),
            "test": datasets.Dataset.from_dict({"img": images[cut:], "label": labels[cut:]}, features=features),
        }
    )
    splits.save_to_disk(str(folder))
    return str(folder)


def review_texts(n: int, seed: int) -> tuple[list[str], list[str]]:
    """Short reviews whose words say the label ('pos' / 'neg'), with shared filler words."""
    rng = np.random.default_rng(seed)
    good, bad, filler = ["great", "fine", "loved", "superb"], ["awful", "boring", "hated", "poor"], ["the", "film", "a"]
    labels = ["pos" if i % 2 else "neg" for i in range(n)]
    words = [list(rng.choice((good if label == "pos" else bad) + filler, 6)) for label in labels]
    return [" ".join(w) for w in words], labels


def test_a_saved_image_dataset_reads_its_splits_and_class_names(tmp_path):
    path = save_digit_images(tmp_path / "saved")
    data = HubData(path=path, normalize="none")
    data.setup(num_clients=2, seed=0)
    assert data.kind == "image" and data.classes == ["digit 0", "digit 1", "digit 2"] and data.num_classes == 3
    assert data.x.shape[1:] == (1, 8, 8) and data.input_sizes() == {"in_channels": 1, "in_features": 64,
                                                                     "image_size": 8}  # fmt: skip
    import datasets

    saved = datasets.load_from_disk(path)
    first = np.asarray(saved["train"][0]["img"], dtype=np.float32) / 255
    assert torch.allclose(data.x[0, 0], torch.from_numpy(first)) and len(data.test_y) == len(saved["test"])


def test_a_saved_text_dataset_without_a_test_split_is_tokenised_and_held_out(tmp_path):
    import datasets

    texts, labels = review_texts(40, seed=0)
    datasets.Dataset.from_dict({"review": texts, "label": labels, "stars": [1.0] * 40}).save_to_disk(tmp_path / "t")
    data = HubData(path=str(tmp_path / "t"), vocab_size=12, max_length=4, test_fraction=0.25)
    data.setup(num_clients=2, seed=0)
    assert data.kind == "text" and data.classes == ["neg", "pos"] and data.x.dtype == torch.int64
    assert data.x.shape[1] == 4 and int(data.x.max()) < 12 and len(data.test_y) == 10  # 25 % of each class
    assert data.input_sizes()["vocab_size"] == 12  # the embedding builders get the vocabulary
    _, test = held_out(np.array([label == "pos" for label in labels], dtype=np.int64), 0.25, 0, "reviews")
    first = [data.vocab.get(word, 1) for word in texts[test[0]].split()[:4]]
    assert data.test_x[0].tolist() == first  # the first held-out review, its words' ids (1: a word out of vocabulary)


def test_a_saved_feature_dataset_of_numeric_columns_and_named_features(tmp_path):
    import datasets

    x, y = blobs(30, 3, 3, seed=0)
    columns = {"a": x[:, 0], "b": x[:, 1], "c": x[:, 2], "label": y}
    datasets.Dataset.from_dict(columns).save_to_disk(tmp_path / "f")
    data = HubData(path=str(tmp_path / "f"), features=["c", "a"], normalize="none", test_split=None)
    data.setup(num_clients=1, seed=0)
    assert data.kind == "features" and data.x.shape[1] == 2
    everything = HubData(path=str(tmp_path / "f"), normalize="none")
    everything.setup(num_clients=1, seed=0)
    assert everything.x.shape[1] == 3 and torch.allclose(everything.x[:, [2, 0]], data.x)


def test_a_local_folder_of_parquet_files_loads_through_datasets(tmp_path):
    x, y = blobs(40, 3, 2, seed=0)
    (tmp_path / "files").mkdir()
    write_parquet(tmp_path / "files/train.parquet", x[:30], NAMES[y[:30]])
    write_parquet(tmp_path / "files/test.parquet", x[30:], NAMES[y[30:]])
    data = HubData(path=str(tmp_path / "files"), label="species", cache_dir=str(tmp_path / "cache"))
    data.setup(num_clients=1, seed=0)
    assert data.classes == ["setosa", "versicolor"] and len(data.y) == 30 and len(data.test_y) == 10


@pytest.mark.parametrize(
    "options, says",
    [
        ({"name": "someone/set"}, "revision must be the commit (40 hex digits) of someone/set"),
        ({"name": "someone/set", "revision": "main"}, "got 'main'; the data set's page lists its commits"),
        ({}, "needs either name (a Hub data set, with its revision) or path (a local copy), not neither"),
        ({"path": "x", "image": "a", "text": "b"}, "give one input of HubData: image, text or features"),
        ({"path": "nowhere"}, "nowhere does not exist; save the data set there with save_to_disk"),
    ],
)
def test_hub_data_options_that_cannot_work_are_one_sentence(tmp_path, options, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        HubData(**{k: str(tmp_path / v) if k == "path" else v for k, v in options.items()}).setup(1, 0)


def test_a_saved_dataset_without_the_named_split_or_column_is_one_sentence(tmp_path):
    path = save_digit_images(tmp_path / "saved", classes=(0, 1))
    with pytest.raises(ConfigError, match=r"has no split 'validation' \(its splits: train, test\); name it"):
        HubData(path=path, test_split="validation").setup(1, 0)
    with pytest.raises(ConfigError, match=r"has no label column 'digit' \(its columns: img, label\)"):
        HubData(path=path, label="digit").setup(1, 0)


def test_a_hub_name_not_in_the_cache_offline_is_one_sentence(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True, raising=False)
    with pytest.raises(ConfigError, match=r"the Hub data set nobody/nothing at 0{40} could not be loaded \(.*offline"):
        HubData(name="nobody/nothing", revision="0" * 40, cache_dir=str(tmp_path)).setup(1, 0)


def test_saved_datasets_run_through_fit_and_inspect(tmp_path, capsys):
    path = save_digit_images(tmp_path / "images")
    config = recipe(tmp_path, {"class_path": "fl_lightning.data.HubData", "init_args": {"path": path, "image": "img"}},
                    models={"global": {"builder": "digits_cnn"}})  # fmt: skip
    assert "8 clients, 3 classes" in inspect_writes_a_chart(tmp_path, config, capsys)
    summary = fit(tmp_path, config, "--rounds", "6", "--eval_every", "6")
    assert summary["final"]["global/test_acc"] > 0.8  # real digits 0, 1 and 2 (chance 1/3)


def test_a_saved_text_dataset_fits_an_embedding_model_sized_by_its_vocabulary(tmp_path):
    import datasets

    texts, labels = review_texts(400, seed=0)
    datasets.Dataset.from_dict({"review": texts, "label": labels}).save_to_disk(tmp_path / "t")
    data = {"class_path": "fl_lightning.data.HubData",
            "init_args": {"path": str(tmp_path / "t"), "vocab_size": 16, "max_length": 6}}  # fmt: skip
    model = {"builder": "imdb_bilstm", "args": {"embedding": 8, "hidden": 8}}  # no vocab_size: the data's
    config = recipe(tmp_path, data, models={"global": model})
    summary = fit(tmp_path, config, "--rounds", "6", "--eval_every", "6")
    assert summary["final"]["global/test_acc"] > 0.8  # the words give the label away (chance 1/2)
    weights = tensors_by_path(load_checkpoint(tmp_path / "run/checkpoints/last.ckpt"))
    (embedding,) = [w for path, w in weights.items() if path.endswith("embedding.weight")]
    assert embedding.shape == (16, 8)  # the data's vocabulary (the builder's default is 20,000)
