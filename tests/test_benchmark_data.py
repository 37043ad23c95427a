"""FEMNIST, IMDB, Speech Commands and TFF h5 loaders on small files written in the real formats."""

import json

import h5py
import numpy as np
import pandas as pd
import pytest
import soundfile
import torch

from fl_lightning.data.femnist import FemnistData
from fl_lightning.data.imdb import ImdbData, build_vocab, encode
from fl_lightning.data.speech import SAMPLE_RATE, SpeechCommandsData, spectrogram
from fl_lightning.data.tff import FedCifar100Data, StackOverflowData
from fl_lightning.federation.errors import ConfigError

RNG = np.random.default_rng(0)


def test_femnist_leaf_json_one_client_per_writer_with_90_10_split(tmp_path):
    folder = tmp_path / "femnist" / "all_data"
    folder.mkdir(parents=True)
    users = {f"f{i:04d}_{i}": 20 for i in range(6)}
    blob = {
        "users": list(users),
        "num_samples": list(users.values()),
        "user_data": {
            u: {"x": RNG.random((n, 784)).round(3).tolist(), "y": (np.arange(n) % 62).tolist()}
            for u, n in users.items()
        },
    }
    (folder / "all_data_0.json").write_text(json.dumps(blob))
    data = FemnistData(data_dir=str(tmp_path), hub_id=None)
    data.setup(num_clients=4, seed=0)  # samples 4 of the 6 writers
    assert data.x.shape == (6 * 18, 1, 28, 28) and len(data.test_y) == 6 * 2
    assert len(data.clients) == 4 and all(len(c.train) == 18 for c in data.clients)
    for client in data.clients:  # every client is exactly one writer
        assert len(set(data.groups[client.train.numpy()])) == 1
    with pytest.raises(ConfigError, match="FEMNIST not found"):
        FemnistData(data_dir=str(tmp_path / "empty"), hub_id=None).load()


def test_imdb_parquet_vocab_encoding_and_unsupervised_reviews(tmp_path):
    folder = tmp_path / "imdb"
    folder.mkdir()
    texts = ["a great great movie", "a bad film<br />really bad", "great cast", "bad bad bad plot"]
    pd.DataFrame({"text": texts, "label": [1, 0, 1, 0]}).to_parquet(folder / "train-00000-of-00001.parquet")
    pd.DataFrame({"text": ["great", "bad movie"], "label": [1, 0]}).to_parquet(folder / "test-00000-of-00001.parquet")
    pd.DataFrame({"text": ["unknown words here", "great"] * 3, "label": [-1] * 6}).to_parquet(
        folder / "unsupervised-00000-of-00001.parquet"
    )
    vocab = build_vocab(texts, size=5)
    assert vocab == {"bad": 2, "great": 3, "a": 4}  # by frequency, ties alphabetical; 0 pad, 1 unknown
    assert encode(["great unseen bad"], vocab, 5).tolist() == [[3, 1, 2, 0, 0]]
    data = ImdbData(data_dir=str(tmp_path), vocab_size=5, max_length=6)
    data.setup(num_clients=2, seed=0)
    assert data.x.shape == (4 + 6, 6) and data.test_x.shape == (2, 6)
    assert sum(len(c.unlabeled) for c in data.clients) == 6 and (data.y[4:] == -100).all()
    assert sum(len(c.train) for c in data.clients) == 4


def test_speech_commands_wav_by_speaker_and_official_test_list(tmp_path):
    root = tmp_path / "speech_commands_v0.02"
    tests = []
    for word in ("no", "yes"):
        (root / word).mkdir(parents=True)
        for speaker in ("aaa111", "bbb222", "ccc333"):
            for k in range(2):
                length = SAMPLE_RATE if k == 0 else SAMPLE_RATE // 2  # short clips are zero-padded
                soundfile.write(root / word / f"{speaker}_nohash_{k}.wav", RNG.uniform(-0.5, 0.5, length), SAMPLE_RATE)
        tests.append(f"{word}/ccc333_nohash_0.wav")
    (root / "_background_noise_").mkdir()
    (root / "testing_list.txt").write_text("\n".join(tests))
    data = SpeechCommandsData(data_dir=str(tmp_path))
    data.setup(num_clients=3, seed=0)
    assert data.words == ["no", "yes"] and data.num_classes == 2
    assert data.x.shape == (10, 1, 65, 126) and len(data.test_y) == 2
    assert sorted(len(c.train) for c in data.clients) == [2, 4, 4]  # speaker ccc333 lost its two test clips
    wave = torch.zeros(1, 8000)
    assert spectrogram(wave).shape == (1, 1, 65, 126) and spectrogram(wave).abs().sum() == 0


def write_tff(path, clients, features):
    with h5py.File(path, "w") as f:
        for name, values in clients.items():
            group = f.create_group(f"examples/{name}")
            for feature, value in zip(features, values):
                group.create_dataset(feature, data=value)


def test_fed_cifar100_h5_clients(tmp_path):
    root = tmp_path / "fed_cifar100"
    root.mkdir()

    def image(n):
        return RNG.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)

    write_tff(
        root / "fed_cifar100_train.h5",
        {str(i): (image(5), np.full(5, i, dtype=np.int64)) for i in range(4)},
        ("image", "label"),
    )
    write_tff(root / "fed_cifar100_test.h5", {"0": (image(3), np.arange(3, dtype=np.int64))}, ("image", "label"))
    data = FedCifar100Data(data_dir=str(tmp_path))
    data.setup(num_clients=4, seed=0)
    assert data.x.shape == (20, 3, 32, 32) and data.num_classes == 100
    assert sorted(set(data.y[c.train].tolist()).pop() for c in data.clients) == [0, 1, 2, 3]
    with pytest.raises(
        ConfigError, match=r"fed_cifar100/fed_cifar100_\{train,test\}\.h5.*flrun data fetch fed_cifar100"
    ):
        FedCifar100Data(data_dir=str(tmp_path / "none")).load()


def test_stackoverflow_h5_next_word_sequences_and_post_types(tmp_path):
    root = tmp_path / "stackoverflow"
    root.mkdir()
    (root / "stackoverflow.word_count").write_text("the 100\nto 50\ncode 20\n")
    posts = {"u1": ([b"the code", b"to the the"], [b"question", b"answer"]), "u2": ([b"unknown to"], [b"answer"])}
    write_tff(root / "stackoverflow_train.h5", posts, ("tokens", "type"))
    test_posts = {"u3": ([b"code"], [b"question"]), "u4": ([b"to"], [b"answer"])}  # answers-only needs a test answer
    write_tff(root / "stackoverflow_test.h5", test_posts, ("tokens", "type"))
    data = StackOverflowData(data_dir=str(tmp_path), vocab_size=3, sequence_length=4)
    data.setup(num_clients=2, seed=0)
    # ids: pad 0, the 1, to 2, code 3, oov 4, bos 5, eos 6
    assert data.x[0].tolist() == [5, 1, 3, 6] and data.y[0].tolist() == [1, 3, 6, -100]
    assert data.x[2].tolist() == [5, 4, 2, 6]
    assert data.test_x.tolist() == [[5, 3, 6, 0], [5, 2, 6, 0]]
    answers = StackOverflowData(data_dir=str(tmp_path), vocab_size=3, sequence_length=4, post_type="answer")
    answers.setup(num_clients=2, seed=0)
    assert len(answers.x) == 2 and answers.test_x.tolist() == [[5, 2, 6, 0]]


def test_out_of_domain_server_set_comes_from_another_data_set(tmp_path):
    from test_vision_data import write_cifar10

    from fl_lightning.data import Cifar10Data

    root = tmp_path / "fed_cifar100"
    root.mkdir()

    def image(n):
        return RNG.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)

    write_tff(
        root / "fed_cifar100_train.h5",
        {str(i): (image(5), np.full(5, i, dtype=np.int64)) for i in range(3)},
        ("image", "label"),
    )
    write_tff(root / "fed_cifar100_test.h5", {"0": (image(2), np.arange(2, dtype=np.int64))}, ("image", "label"))
    write_cifar10(tmp_path, per_batch=4, test=2)
    data = FedCifar100Data(data_dir=str(tmp_path), server_dataset=Cifar10Data(data_dir=str(tmp_path)))
    data.setup(num_clients=3, seed=0)
    assert len(data.server_idx) == 20 and (data.y[data.server_idx] == -100).all()  # CIFAR-10's 5 x 4 images
    assert set(torch.cat([c.train for c in data.clients]).tolist()).isdisjoint(data.server_idx.tolist())


def test_stackoverflow_c4_slice_becomes_the_server_set(tmp_path):
    import gzip

    root = tmp_path / "stackoverflow"
    root.mkdir()
    (root / "stackoverflow.word_count").write_text("the 100\nto 50\ncode 20\n")
    write_tff(root / "stackoverflow_train.h5", {"u1": ([b"the code"], [b"question"])}, ("tokens", "type"))
    write_tff(root / "stackoverflow_test.h5", {"u3": ([b"code"], [b"question"])}, ("tokens", "type"))
    c4 = tmp_path / "c4-validation.00000-of-00008.json.gz"
    with gzip.open(c4, "wt") as f:
        for text in ("The code", "to THE moon", "nothing known"):
            f.write(json.dumps({"text": text, "url": "x", "timestamp": "y"}) + "\n")
    data = StackOverflowData(
        data_dir=str(tmp_path), vocab_size=3, sequence_length=4, distillation_texts=str(c4), distillation_examples=2
    )
    data.setup(num_clients=1, seed=0)
    assert data.x[data.server_idx].tolist() == [[5, 1, 3, 6], [5, 2, 1, 4]]  # lower-cased, encoded like posts
    with pytest.raises(ConfigError, match="distillation_texts file"):
        StackOverflowData(
            data_dir=str(tmp_path), distillation_texts=str(tmp_path / "none.json.gz"), vocab_size=3
        ).load()


def test_stackoverflow_domain_shifted_pools_and_per_domain_test_sets(tmp_path):
    root = tmp_path / "stackoverflow"
    root.mkdir()
    (root / "stackoverflow.word_count").write_text("the 100\nto 50\ncode 20\n")
    posts = {
        "asker": ([b"the code", b"to the", b"code"], [b"question", b"question", b"answer"]),
        "helper": ([b"to code", b"the"], [b"answer", b"answer"]),
        "both": ([b"code code", b"the to"], [b"question", b"answer"]),
    }
    write_tff(root / "stackoverflow_train.h5", posts, ("tokens", "type"))
    write_tff(
        root / "stackoverflow_test.h5",
        {"t": ([b"the", b"to", b"code"], [b"question", b"answer", b"answer"])},
        ("tokens", "type"),
    )
    data = StackOverflowData(
        data_dir=str(tmp_path), vocab_size=3, sequence_length=4, question_clients=1, domain_test_sets=True
    )
    data.setup(num_clients=3, seed=0)
    kinds = data.post_types
    assert kinds[data.clients[0].train.numpy()].tolist() == ["question", "question"]  # the user with most questions
    assert all(set(kinds[c.train.numpy()]) == {"answer"} for c in data.clients[1:])
    assert len(data.extra_tests["questions"][1]) == 1 and len(data.extra_tests["answers"][1]) == 2
    with pytest.raises(ConfigError, match="no posts of their pool's kind"):
        StackOverflowData(data_dir=str(tmp_path), vocab_size=3, question_clients=3).setup(num_clients=3, seed=0)
