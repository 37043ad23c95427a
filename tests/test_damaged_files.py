"""A data file that is present but is not what its name says (text, cut short, another format) is one sentence
naming the file, why, and how to restore it, from every reader; never a traceback from pickle, json, PIL, h5py,
soundfile or pyarrow."""

import gzip
import io
import json
import pickle

import numpy as np
import pandas as pd
import pytest
import soundfile
from conftest import write_recipe
from PIL import Image
from test_benchmark_data import write_tff
from test_vision_data import write_cifar10, write_idx

from fl_lightning.data import (
    Cifar10Data,
    Cinic10Data,
    FedCifar100Data,
    FemnistData,
    ImdbData,
    MnistData,
    SpeechCommandsData,
    StackOverflowData,
)
from fl_lightning.federation.errors import ConfigError

TEXT = b"Images of cats and dogs\nsee the README\n"  # starts as pickle's INT opcode: int("mages of ...") fails
CIFAR_FIX = r"replace it with the published archive's file, e\.g\. by deleting it and running `flrun data fetch cifar10"


@pytest.mark.parametrize(
    "content, reason",
    [
        (TEXT, "could not convert string to int"),
        (b"", "it is empty or cut short"),
        (pickle.dumps({"data": 1, "labels": [0]})[:-4], "pickle data was truncated"),
        (pickle.dumps([1, 2]), "it holds a list, not a dict of data and labels"),
        (pickle.dumps({"labels": [0]}), "it has no 'data'"),
        (pickle.dumps({"data": "abc", "labels": [0]}), "invalid literal for int"),
        (pickle.dumps({"data": np.zeros((2, 100), np.uint8), "labels": [0, 1]}), "cannot reshape array of size 200"),
        (pickle.dumps({"data": np.zeros((2, 3072), np.uint8), "labels": [0]}), "2 images but 1 labels"),
        (
            pickle.dumps({"data": np.zeros((2, 3072), np.uint8), "labels": [0, 12]}),
            "label 12 at index 1 is outside 0..9",
        ),
    ],
    ids=["text", "empty", "truncated", "list", "no_data", "text_data", "wrong_size", "fewer_labels", "label_12"],
)
def test_a_cifar_batch_that_is_not_one_is_one_sentence(tmp_path, content, reason):
    write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(content)
    with pytest.raises(ConfigError) as err:
        Cifar10Data(data_dir=str(tmp_path)).load()
    message = str(err.value)
    assert message.startswith(f"{tmp_path}/cifar-10-batches-py/data_batch_1 is not a CIFAR batch file ({reason}")
    assert f"flrun data fetch cifar10 --data_dir {tmp_path}`." in message and "\n" not in message


def test_a_text_cifar_batch_exits_2_with_one_line(tmp_path, capsys):
    from conftest import run_cli

    write_cifar10(tmp_path / "data")
    (tmp_path / "data" / "cifar-10-batches-py" / "data_batch_1").write_bytes(TEXT)
    data = {"class_path": "fl_lightning.data.Cifar10Data", "init_args": {"data_dir": str(tmp_path / "data")}}
    recipe = write_recipe(tmp_path / "r.yaml", data=data, models={"global": {"builder": "resnet20"}})
    code = run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "out"))
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Warning" not in line]
    assert code == 2 and len(lines) == 1, lines
    assert "data_batch_1 is not a CIFAR batch file (could not convert string to int)" in lines[0]


def test_mnist_idx_files_that_are_not_idx(tmp_path):
    raw = tmp_path / "MNIST" / "raw"
    raw.mkdir(parents=True)
    images = np.zeros((4, 28, 28))
    write_idx(raw / "train-images-idx3-ubyte.gz", images)
    write_idx(raw / "train-labels-idx1-ubyte.gz", np.arange(4))
    write_idx(raw / "t10k-images-idx3-ubyte.gz", images)
    write_idx(raw / "t10k-labels-idx1-ubyte.gz", np.arange(4))
    cases = [
        (TEXT, "Not a gzipped file"),
        (gzip.compress(b"ab"), "no uint8 idx header"),
        (gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 9]) + b"\x01\x02"), "cannot reshape array of size 2"),
        (gzip.compress(bytes([0, 0, 8, 1, 0, 0, 0, 9]) + bytes(9))[:-6], "it is empty or cut short"),
    ]
    target = raw / "t10k-labels-idx1-ubyte.gz"
    for content, reason in cases:
        target.write_bytes(content)
        with pytest.raises(ConfigError, match=rf"t10k-labels-idx1-ubyte.gz is not an MNIST idx file \({reason}"):
            MnistData(data_dir=str(tmp_path)).load()
    write_idx(target, np.arange(3))  # a valid file of the wrong length
    with pytest.raises(ConfigError, match=r"MNIST's t10k files in .* do not match \(\(4, 28, 28\) images, 3 labels\)"):
        MnistData(data_dir=str(tmp_path)).load()


def _write_cinic(root):
    for split in ("train", "test"):
        for name in Cinic10Data.classes:
            folder = root / "CINIC-10" / split / name
            folder.mkdir(parents=True)
            Image.fromarray(np.zeros((32, 32, 3), dtype=np.uint8)).save(folder / "0.png")


def test_cinic_pngs_that_are_not_32x32_images(tmp_path):
    _write_cinic(tmp_path)
    png = tmp_path / "CINIC-10" / "train" / "cat" / "0.png"
    png.write_bytes(TEXT)
    with pytest.raises(ConfigError, match=r"cat/0.png is not a CINIC-10 image \(cannot identify image file"):
        Cinic10Data(data_dir=str(tmp_path)).load()
    Image.fromarray(np.zeros((16, 20, 3), dtype=np.uint8)).save(png)
    with pytest.raises(ConfigError, match=r"cat/0.png is not a CINIC-10 image \(a 20x16 image, not 32x32\)"):
        Cinic10Data(data_dir=str(tmp_path)).load()


def test_femnist_leaf_json_and_hub_parquet_that_are_not(tmp_path):
    leaf = tmp_path / "femnist" / "all_data"
    leaf.mkdir(parents=True)
    path = leaf / "all_data_0.json"
    cases = [
        (TEXT.decode(), "Expecting value: line 1 column 1"),
        (json.dumps({"user_data": {}}), "it has no 'users'"),
        (json.dumps({"users": ["w"], "user_data": {"w": {"x": [[0.0] * 10], "y": [0]}}}), "cannot reshape array"),
        (json.dumps({"users": ["w"], "user_data": {"w": {"x": [[0.0] * 784], "y": [0, 1]}}}), "writer w has 1 images"),
    ]
    for content, reason in cases:
        path.write_text(content)
        with pytest.raises(
            ConfigError, match=rf"all_data_0.json is not a LEAF FEMNIST JSON file \({reason}.*check the"
        ):
            FemnistData(data_dir=str(tmp_path), hub_id=None).load()
    path.unlink()
    hub = tmp_path / "femnist" / "hub"
    hub.mkdir()
    (hub / "train-0.parquet").write_bytes(TEXT)
    with pytest.raises(
        ConfigError, match=r"train-0.parquet is not a FEMNIST parquet file \(.*flrun data fetch femnist"
    ):
        FemnistData(data_dir=str(tmp_path)).load()
    png = io.BytesIO()
    Image.fromarray(np.zeros((28, 28), dtype=np.uint8)).save(png, format="PNG")
    cells = [{"bytes": png.getvalue(), "path": None}, {"bytes": TEXT, "path": None}]
    pd.DataFrame({"image": cells, "writer_id": ["a", "b"], "character": [0, 1]}).to_parquet(hub / "train-0.parquet")
    with pytest.raises(ConfigError, match=r"train-0.parquet is not a FEMNIST parquet file \(cannot identify image"):
        FemnistData(data_dir=str(tmp_path)).load()


def test_speech_wav_and_test_list_that_are_not(tmp_path):
    root = tmp_path / "speech_commands_v0.02"
    (root / "yes").mkdir(parents=True)
    wav = root / "yes" / "aaa_nohash_0.wav"
    soundfile.write(wav, np.zeros(16_000), 16_000)
    (root / "testing_list.txt").write_text("yes/aaa_nohash_0.wav\n")
    wav.write_bytes(TEXT)
    with pytest.raises(ConfigError, match=r"aaa_nohash_0.wav is not a WAV file \(.*flrun data fetch speech_commands"):
        SpeechCommandsData(data_dir=str(tmp_path)).load()
    soundfile.write(wav, np.zeros((16_000, 2)), 16_000)
    with pytest.raises(ConfigError, match=r"aaa_nohash_0.wav has 2 channels, expected one \(mono\)"):
        SpeechCommandsData(data_dir=str(tmp_path)).load()
    (root / "testing_list.txt").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ConfigError, match=r"testing_list.txt is not a text file of test clips \('utf-8' codec"):
        SpeechCommandsData(data_dir=str(tmp_path)).load()


def test_imdb_parquet_that_is_not(tmp_path):
    folder = tmp_path / "imdb"
    folder.mkdir()
    for split in ("train", "test", "unsupervised"):
        pd.DataFrame({"text": ["a good film"], "label": [1]}).to_parquet(folder / f"{split}-00000-of-00001.parquet")
    (folder / "test-00000-of-00001.parquet").write_bytes(TEXT)
    with pytest.raises(ConfigError, match=r"test-00000-of-00001.parquet is not an IMDB parquet file \(.*fetch imdb"):
        ImdbData(data_dir=str(tmp_path)).load()
    pd.DataFrame({"review": ["a good film"], "label": [1]}).to_parquet(folder / "test-00000-of-00001.parquet")
    with pytest.raises(ConfigError, match=r"test-00000-of-00001.parquet is not an IMDB parquet file \(.*text"):
        ImdbData(data_dir=str(tmp_path)).load()
    pd.DataFrame({"text": ["a good film"], "label": ["pos"]}).to_parquet(folder / "test-00000-of-00001.parquet")
    with pytest.raises(ConfigError, match=r"\(its label column is \w+, not integers\)"):
        ImdbData(data_dir=str(tmp_path)).load()


def test_tff_h5_and_word_count_files_that_are_not(tmp_path):
    root = tmp_path / "fed_cifar100"
    root.mkdir()
    image = np.zeros((2, 32, 32, 3), dtype=np.uint8)
    write_tff(root / "fed_cifar100_test.h5", {"0": (image, np.arange(2))}, ("image", "label"))
    (root / "fed_cifar100_train.h5").write_bytes(TEXT)
    with pytest.raises(ConfigError, match=r"fed_cifar100_train.h5 is not a TFF h5 file \(.*fetch fed_cifar100"):
        FedCifar100Data(data_dir=str(tmp_path)).load()
    write_tff(root / "fed_cifar100_train.h5", {"0": (image[:, :16], np.arange(2))}, ("image", "label"))
    with pytest.raises(
        ConfigError,
        match=r"fed_cifar100_train.h5 is not a TFF h5 file \(client 0: images \(2, 16, 32, 3\) and 2 labels, not \[N",
    ):
        FedCifar100Data(data_dir=str(tmp_path)).load()
    write_tff(root / "fed_cifar100_train.h5", {"0": (image, np.arange(2))}, ("picture", "label"))
    with pytest.raises(
        ConfigError, match=r"fed_cifar100_train.h5 is not a TFF h5 file \(.*object 'image' doesn't exist"
    ):
        FedCifar100Data(data_dir=str(tmp_path)).load()

    so = tmp_path / "stackoverflow"
    so.mkdir()
    (so / "stackoverflow.word_count").write_text("the 100\n")
    write_tff(so / "stackoverflow_test.h5", {"u": ([b"the"], [b"question"])}, ("tokens", "type"))
    (so / "stackoverflow_train.h5").write_bytes(TEXT)
    with pytest.raises(ConfigError, match=r"stackoverflow_train.h5 is not a TFF h5 file \(.*fetch stackoverflow"):
        StackOverflowData(data_dir=str(tmp_path), vocab_size=1).load()
    write_tff(so / "stackoverflow_train.h5", {"u": ([b"the"], [b"answer"])}, ("tokens", "type"))
    (so / "stackoverflow.word_count").write_bytes(b"\xff\xfe\x00\x81")
    with pytest.raises(ConfigError, match=r"stackoverflow.word_count is not a word count file \('utf-8' codec"):
        StackOverflowData(data_dir=str(tmp_path), vocab_size=1).load()
    (so / "stackoverflow.word_count").write_text("the 100\n")
    (so / "stackoverflow_test.h5").write_bytes(b"")
    with pytest.raises(ConfigError, match=r"stackoverflow_test.h5 is not a TFF h5 file"):
        StackOverflowData(data_dir=str(tmp_path), vocab_size=1).load()
    write_tff(so / "stackoverflow_test.h5", {"u": ([b"the"], [b"question"])}, ("tokens", "type"))
    assert StackOverflowData(data_dir=str(tmp_path), vocab_size=1).load().test_x.tolist() == [[3, 1, 4] + [0] * 17]


def test_a_distillation_text_file_of_the_users_is_checked_without_a_fetch_command(tmp_path):
    so = tmp_path / "stackoverflow"
    so.mkdir()
    (so / "stackoverflow.word_count").write_text("the 100\n")
    write_tff(so / "stackoverflow_train.h5", {"u": ([b"the"], [b"answer"])}, ("tokens", "type"))
    write_tff(so / "stackoverflow_test.h5", {"u": ([b"the"], [b"question"])}, ("tokens", "type"))
    texts = tmp_path / "c4.json"
    texts.write_text('{"text": "the end"}\nnot json\n')
    data = StackOverflowData(data_dir=str(tmp_path), vocab_size=1, distillation_texts=str(texts))
    with pytest.raises(ConfigError, match=r"c4.json is not a C4 text file \(Expecting value.*check the file or give"):
        data.load()
