"""Paper recipes: each family runs a round on tiny files in the real formats, through its own recipe."""

import gzip
import json

import pytest
import yaml
from conftest import ROOT, read_summary, run_cli
from test_vision_data import write_cifar10

from fl_lightning.report.runs import load_run, measured_value
from fl_lightning.report.tables import build_table
from fl_lightning.run.recipes import base_files, load_recipe

TINY_POPULATION = json.dumps(
    {
        "num_clients": 6,
        "tiers": [{"name": "strong", "roles": ["aux", "target"], "count": 2}, {"name": "weak", "roles": ["aux"]}],
    }
)


def _pools(num_clients, high, high_roles=("small", "large"), low_roles=("small",)):
    """A two-tier population (high-capacity clients first) as the JSON the CLI takes."""
    return json.dumps(
        {
            "num_clients": num_clients,
            "tiers": [
                {"name": "high", "roles": list(high_roles), "count": high},
                {"name": "low", "roles": list(low_roles)},
            ],
        }
    )


def test_flagship_ondevice_kd_cifar10_runs_a_round_and_keeps_the_paper_reference(tmp_path):
    write_cifar10(tmp_path, per_batch=40, test=20)
    out = tmp_path / "run"
    code = run_cli(
        "fit",
        "--config",
        str(ROOT / "recipes/ondevice_kd_cifar10.yaml"),
        "--output_dir",
        str(out),
        "--rounds",
        "1",
        "--data.init_args.data_dir",
        str(tmp_path),
        "--data.init_args.download",
        "false",
        "--data.init_args.partitioner.init_args.min_partition_size",
        "4",
        "--population",
        TINY_POPULATION,
        "--sampler.init_args.num_per_round",
        "3",
        "--training.local_steps",
        "2",
        "--training.batch_size",
        "8",
        "--runtime.progress",
        "false",
    )
    assert code == 0
    summary = read_summary(out)
    assert set(summary["final"]) >= {"aux/test_acc", "target/test_acc"}
    assert summary["reference"].pop("setup")["local_steps"] == 30  # the set-up numbers travel too (Table 4's tau)
    assert summary["reference"] == {
        "paper": "paper-001 (Lim et al., on-device KD)",
        "table": "Table 4",
        "row": "CIFAR-10",
        "column": "Proposed",
        "metrics": {"target/test_acc": 0.6243},
        "stds": {"target/test_acc": 0.001},
    }
    # downlink: 3 sampled clients get the auxiliary model, the 2 strong clients both models
    aux = sum(v.numel() * 4 for k, v in _resnet20(0.25).items() if "num_batches" not in k) + 8 * _bn_layers(0.25)
    target = sum(v.numel() * 4 for k, v in _resnet20(1.0).items() if "num_batches" not in k) + 8 * _bn_layers(1.0)
    assert summary["comm"]["downlink_bytes"] == 5 * aux + 2 * target
    assert summary["comm"]["uplink_bytes"] == 3 * aux + 2 * target


def _resnet20(width):
    from fl_lightning.models import resnet20

    return resnet20(width=width).state_dict()


def _bn_layers(width):
    return sum(1 for k in _resnet20(width) if k.endswith("num_batches_tracked"))  # one int64 each


def _tiny_mnist(root):
    import numpy as np
    from test_vision_data import write_idx

    raw = root / "MNIST" / "raw"
    raw.mkdir(parents=True)
    rng = np.random.default_rng(0)
    write_idx(raw / "train-images-idx3-ubyte.gz", rng.integers(0, 256, (60, 28, 28)))
    write_idx(raw / "train-labels-idx1-ubyte.gz", np.arange(60) % 10)
    write_idx(raw / "t10k-images-idx3-ubyte.gz", rng.integers(0, 256, (20, 28, 28)))
    write_idx(raw / "t10k-labels-idx1-ubyte.gz", np.arange(20) % 10)


def _run_fedhe_family(tmp_path, recipe):
    return _tiny_run(tmp_path, recipe, "--rounds", "3", "--eval_every", "3", "--training.batch_size", "4")


def test_fedhe_mnist_heterogeneous_recipe_uploads_class_logits_only(tmp_path):
    _tiny_mnist(tmp_path)
    summary = _run_fedhe_family(tmp_path, "fedhe_mnist_heterogeneous")
    assert summary["comm"]["uplink_bytes"] == 3 * 10 * 11 * 4  # one client per round, C x (C + 1) numbers
    assert summary["reference"]["metrics"] == {"personal/test_acc": 0.985} and "personal/test_acc" in summary["final"]


def test_fedmd_mnist_recipe_sends_paper_000s_logits_and_not_the_public_images(tmp_path):
    """Paper 000's Tables III-IV count FedMD's traffic per client and round as n x 10 logits plus the n public
    images a client obtains (n x 794 numbers on MNIST, n = 10); here every client holds the public set from
    the start, so a round sends the n x 10 logits up and the consensus (n x 10) and the n positions down."""
    _tiny_mnist(tmp_path)
    fast = ["--strategy.init_args.public_epochs", "1", "--strategy.init_args.private_epochs", "1"]
    summary = _tiny_run(tmp_path, "fedmd_mnist_homogeneous", "--rounds", "2", "--eval_every", "2", *fast)
    n, c, rounds = 10, 10, 2  # one client per round (paper 000's loop)
    assert summary["comm"]["uplink_bytes"] == rounds * n * c * 4
    assert summary["comm"]["downlink_bytes"] == rounds * (n * c * 4 + n * 4)


def test_private_baseline_sends_nothing(tmp_path):
    _tiny_mnist(tmp_path)
    summary = _run_fedhe_family(tmp_path, "private_mnist_homogeneous")
    assert summary["comm"]["uplink_bytes"] == summary["comm"]["downlink_bytes"] == 0


def write_fed_cifar100(root, clients=4, per_client=6):
    """TFF's Federated CIFAR-100 h5 files: ``clients`` natural clients of ``per_client`` images (client i's
    labels all i), and a test client of 4."""
    import numpy as np
    from test_benchmark_data import write_tff

    folder = root / "fed_cifar100"
    folder.mkdir()
    rng = np.random.default_rng(0)

    def image(n):
        return rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)

    write_tff(
        folder / "fed_cifar100_train.h5",
        {str(i): (image(per_client), np.full(per_client, i, dtype=np.int64)) for i in range(clients)},
        ("image", "label"),
    )
    write_tff(folder / "fed_cifar100_test.h5", {"0": (image(4), np.arange(4, dtype=np.int64))}, ("image", "label"))


def test_codistillation_cifar100_recipe_with_cifar10_as_out_of_domain_server_set(tmp_path):
    write_fed_cifar100(tmp_path)
    write_cifar10(tmp_path, per_batch=4, test=2)
    population = _pools(4, 2)
    out = tmp_path / "run"
    assert (
        run_cli(
            "fit",
            "--config",
            str(ROOT / "recipes/periodic_codist_cifar100_ph4700_outdomain.yaml"),
            "--output_dir",
            str(out),
            "--rounds",
            "2",
            "--eval_every",
            "1",
            "--data.init_args.data_dir",
            str(tmp_path),
            "--data.init_args.download",
            "false",
            "--data.init_args.server_dataset.init_args.data_dir",
            str(tmp_path),
            "--data.init_args.server_dataset.init_args.download",
            "false",
            "--population",
            population,
            "--strategy.init_args.period",
            "1",
            "--strategy.init_args.clients_per_round",
            "{small: 3, large: 1}",
            "--strategy.init_args.distillation.init_args.steps",
            "2",
            "--runtime.progress",
            "false",
        )
        == 0
    )
    summary = read_summary(out)
    assert summary["reference"]["metrics"] == {"small/test_acc": 0.3402, "large/test_acc": 0.3053}
    rows = (out / "metrics.csv").read_text().splitlines()
    assert "server/codistilled" in rows[0] and len(rows) == 3
    small = sum(p.numel() for p in _model("codist_cnn_small").parameters()) * 4
    large = sum(p.numel() for p in _model("codist_cnn_large").parameters()) * 4
    assert summary["comm"]["uplink_bytes"] == 2 * (3 * small + 1 * large)  # one cohort per pool and round


def _model(name):
    from fl_lightning.models import registered_models

    return registered_models()[name]()


def _tiny_run(tmp_path, recipe, *overrides):
    out = tmp_path / recipe
    assert (
        run_cli(
            "fit",
            "--config",
            str(ROOT / f"recipes/{recipe}.yaml"),
            "--output_dir",
            str(out),
            "--rounds",
            "1",
            "--data.init_args.data_dir",
            str(tmp_path),
            "--data.init_args.download",
            "false",
            "--runtime.progress",
            "false",
            *overrides,
        )
        == 0
    )
    return read_summary(out)


@pytest.mark.slow  # ResNets on a CPU: half a minute
def test_velo_extreme_resnets_recipe_runs_a_round(tmp_path):
    write_cifar10(tmp_path, per_batch=20, test=10)
    depths = [10, 18, 26, 34, 50]
    population = json.dumps(
        {"num_clients": 5, "tiers": [{"name": f"resnet{d}", "roles": [f"resnet{d}"], "count": 1} for d in depths]}
    )
    summary = _tiny_run(
        tmp_path,
        "velo_cifar10_noniid_extreme",
        "--population",
        population,
        "--data.init_args.partitioner.init_args.min_partition_size",
        "2",
        "--sampler.init_args.fraction",
        "1.0",
        "--training.local_steps",
        "1",
        "--training.batch_size",
        "4",
        "--strategy.init_args.warmup_rounds",
        "0",
    )
    assert {f"resnet{d}/test_acc" for d in depths} <= set(summary["final"])
    # every client sends its weights plus C x (D + C + 1) class-knowledge numbers with D = 512
    assert summary["comm"]["by_payload"]["uplink"]["class_knowledge"] == 5 * 10 * (512 + 10 + 1) * 4


def test_fedgh_heterogeneous_cnn_recipe_runs_a_round(tmp_path):
    write_cifar10(tmp_path, per_batch=20, test=10)
    summary = _tiny_run(
        tmp_path, "fedgh_cifar10_heterogeneous", "--training.local_epochs", "1", "--training.batch_size", "8"
    )
    assert summary["reference"]["metrics"] == {
        "personal/test_acc": 0.976,
        "comm/kib_per_client_round": 23.45,
        "rounds_to/personal/test_acc@0.9": 2,
        "comm/kib_to/personal/test_acc@0.9": 468.91,
    }
    assert summary["comm"]["downlink_bytes"] == 10 * (500 * 10 + 10) * 4  # the header to all 10 clients
    assert summary["comm"]["uplink_bytes"] == 10 * 2 * (500 + 1) * 4  # 2 classes per client, S (D + 1) numbers
    # Table 3's CO/c/r: 23.48 KiB per client and round measured (the header down, two LARs with labels up)
    kib = measured_value(load_run(tmp_path / "fedgh_cifar10_heterogeneous"), "comm/kib_per_client_round")
    assert kib == ((500 * 10 + 10) + 2 * (500 + 1)) * 4 / 1024


KD_POPULATION = json.dumps(
    {
        "num_clients": 4,
        "tiers": [{"name": "strong", "roles": ["aux", "target"], "count": 1}, {"name": "weak", "roles": ["aux"]}],
    }
)
KD_TINY = (
    "--population",
    KD_POPULATION,
    "--sampler.init_args.num_per_round",
    "2",
    "--training.local_steps",
    "1",
    "--training.batch_size",
    "4",
    "--data.init_args.partitioner.init_args.min_partition_size",
    "1",
)


def _femnist_files(root, writers=4, per_writer=12):
    import numpy as np

    folder = root / "femnist" / "all_data"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    users = [f"w{i}" for i in range(writers)]
    blob = {
        "users": users,
        "num_samples": [per_writer] * writers,
        "user_data": {
            u: {"x": rng.random((per_writer, 784)).round(2).tolist(), "y": (np.arange(per_writer) % 62).tolist()}
            for u in users
        },
    }
    (folder / "all_data_0.json").write_text(json.dumps(blob))
    return ()


def _imdb_files(root):
    import pandas as pd

    folder = root / "imdb"
    folder.mkdir()
    words = ["good", "bad", "movie", "plot", "great", "awful"]
    texts = [" ".join(words[(i + j) % 6] for j in range(5)) for i in range(24)]
    for split, n in (("train", 24), ("test", 6), ("unsupervised", 8)):
        pd.DataFrame(
            {"text": texts[:n], "label": [i % 2 for i in range(n)] if split != "unsupervised" else [-1] * n}
        ).to_parquet(folder / f"{split}-00000-of-00001.parquet")
    return ("--data.init_args.vocab_size", "20", "--data.init_args.max_length", "8")


def _speech_files(root):
    import numpy as np
    import soundfile

    folder = root / "speech_commands_v0.02"
    rng = np.random.default_rng(0)
    for word in ("go", "no"):
        (folder / word).mkdir(parents=True)
        for speaker in ("s1", "s2", "s3", "s4"):
            for k in range(2):
                soundfile.write(folder / word / f"{speaker}_nohash_{k}.wav", rng.uniform(-0.3, 0.3, 16000), 16000)
    (folder / "testing_list.txt").write_text("go/s4_nohash_1.wav\nno/s4_nohash_1.wav\n")
    return ()


def write_cifar100(root, train=40, test=8):
    """CIFAR-100's python pickles with ``train`` and ``test`` random images, labels cycling over the 100 classes."""
    import pickle

    import numpy as np

    folder = root / "cifar-100-python"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("test", test)):
        batch = {"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8), "fine_labels": (np.arange(n) % 100).tolist()}
        with (folder / split).open("wb") as f:
            pickle.dump(batch, f)


def _cifar100_files(root):
    write_cifar100(root)
    tiny_vit = {
        "builder": "vit_b16",
        "args": {
            "random_init": True,
            "num_classes": 100,
            "hidden": 8,
            "config": {
                "hidden_size": 16,
                "num_hidden_layers": 1,
                "num_attention_heads": 2,
                "intermediate_size": 32,
                "image_size": 32,
                "patch_size": 8,
            },
        },
    }
    # ResNet50 after one step on 4 random 32x32 images gives non-finite test losses, which the divergence
    # check stops (exit 2); its construction is tested in test_model_zoo, so the tiny run uses ResNet20
    models = {"aux": {"builder": "resnet20", "args": {"width": 0.25}}, "target": tiny_vit}
    # 40 images over 100 classes: a flatter Dirichlet so that no tiny client is empty
    return ("--models", json.dumps(models), "--data.init_args.partitioner.init_args.alpha", "10")


@pytest.mark.parametrize(
    "recipe, writer",
    [
        ("ondevice_kd_femnist", _femnist_files),
        ("weak_only_imdb", _imdb_files),
        ("ondevice_kd_imdb", _imdb_files),
        ("strong_only_speech", _speech_files),
        ("ondevice_kd_speech", _speech_files),
        ("ondevice_kd_cifar100", _cifar100_files),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_paper_001_recipe_families_run_a_round(tmp_path, recipe, writer):
    extra = writer(tmp_path)
    out = tmp_path / "run"
    tiny = list(KD_TINY)
    if recipe.startswith("strong_only"):  # its sampler takes every strong client (here one)
        i = tiny.index("--sampler.init_args.num_per_round")
        del tiny[i : i + 2]
    args = [
        "fit",
        "--config",
        str(ROOT / f"recipes/{recipe}.yaml"),
        "--output_dir",
        str(out),
        "--rounds",
        "1",
        "--data.init_args.data_dir",
        str(tmp_path),
        "--runtime.progress",
        "false",
        *tiny,
        *extra,
    ]
    if "download" in load_recipe(ROOT / f"recipes/{recipe}.yaml")["data"]["init_args"]:
        args += ["--data.init_args.download", "false"]
    assert run_cli(*args) == 0
    summary = read_summary(out)
    assert summary["reference"]["table"] == "Table 4"
    # the traffic by formula: in the round, each of the 2 sampled clients sends the auxiliary model and the strong
    # client the target model, their whole saved global states (but the ViT's frozen backbone stays home: only its
    # two output layers travel, 16 x 8 + 8 and 8 x 100 + 100 numbers); the strong client also gets the auxiliary
    # model, its teacher
    from fl_lightning.run.checkpoint import load_checkpoint

    saved = load_checkpoint(out / "checkpoints" / "last.ckpt")["strategy"]["global_weights"]
    size = {role: sum(v.numel() * v.element_size() for v in w.values()) for role, w in saved.items()}
    if recipe == "ondevice_kd_cifar100":
        size["target"] = (16 * 8 + 8 + 8 * 100 + 100) * 4
    uplink = 2 * size.get("aux", 0) + size.get("target", 0)
    assert summary["comm"]["uplink_bytes"] == uplink
    assert summary["comm"]["downlink_bytes"] == uplink + (size["aux"] if len(size) == 2 else 0)


def write_stackoverflow(root, users=8):
    """TFF's StackOverflow h5 files and word counts: ``users`` users of 6 posts (questions and answers
    alternating), a 30-word vocabulary, and a test user of 3 answers."""
    from test_benchmark_data import write_tff

    folder = root / "stackoverflow"
    folder.mkdir()
    (folder / "stackoverflow.word_count").write_text("".join(f"w{i} {100 - i}\n" for i in range(30)))
    kinds = [b"question", b"answer"] * 3
    posts = {f"u{i}": ([f"w{i % 27} w{i % 27 + 1} w{i % 27 + 2} w99".encode()] * 6, kinds) for i in range(users)}
    write_tff(folder / "stackoverflow_train.h5", posts, ("tokens", "type"))
    write_tff(folder / "stackoverflow_test.h5", {"t": ([b"w1 w2"] * 3, [b"answer"] * 3)}, ("tokens", "type"))
    (root / "c4").mkdir()  # the first C4 validation shard: the out-of-domain distillation texts
    with gzip.open(root / "c4" / "c4-validation.00000-of-00008.json.gz", "wt") as f:
        for k in range(12):
            f.write(json.dumps({"text": f"W{k % 10} w1 w2", "url": "x", "timestamp": "y"}) + "\n")


def test_stackoverflow_codistillation_recipe_runs_a_round(tmp_path):
    # 8 users: the recipe's pool draws 6 of them, the other two hold the in-domain server set
    write_stackoverflow(tmp_path, users=8)
    population = _pools(6, 2)
    out = tmp_path / "run"
    assert (
        run_cli(
            "fit",
            "--config",
            str(ROOT / "recipes/merged_codist_stackoverflow_ph296k_indomain.yaml"),
            "--output_dir",
            str(out),
            "--rounds",
            "1",
            "--data.init_args.data_dir",
            str(tmp_path),
            "--data.init_args.download",
            "false",
            "--data.init_args.vocab_size",
            "30",
            "--data.init_args.max_clients",
            "6",
            "--data.init_args.distillation_examples",
            "10",
            "--population",
            population,
            "--strategy.init_args.clients_per_round",
            "{small: 2, large: 1}",
            "--strategy.init_args.distillation.init_args.steps",
            "1",
            "--runtime.progress",
            "false",
            "--models",
            json.dumps(
                {
                    "small": {"builder": "stackoverflow_lstm_small", "args": {"vocab_size": 34}},
                    "large": {"builder": "stackoverflow_lstm_large", "args": {"vocab_size": 34}},
                }
            ),
        )
        == 0
    )
    summary = read_summary(out)
    assert summary["reference"]["table"] == "Table 1"
    # the large model's test accuracy, recomputed from its saved weights: next-word hits over the test posts'
    # non-padding targets
    import torch

    from fl_lightning.data import StackOverflowData
    from fl_lightning.models import registered_models
    from fl_lightning.run.checkpoint import load_checkpoint

    test = StackOverflowData(data_dir=str(tmp_path), download=False, vocab_size=30).load()
    large = registered_models()["stackoverflow_lstm_large"](vocab_size=34)
    large.load_state_dict(load_checkpoint(out / "checkpoints" / "last.ckpt")["strategy"]["global_weights"]["large"])
    with torch.no_grad():
        hits = large.eval()(test.test_x).argmax(-1) == test.test_y
    kept = test.test_y != -100
    assert summary["final"]["large/test_acc"] == (hits & kept).sum().item() / kept.sum().item()
    partition = json.loads((out / "partition.json").read_text())
    assert [c["train"] for c in partition["clients"]] == [6] * 6  # every pool user keeps its 6 posts
    assert partition["server_size"] == 10  # from the 12 posts of the two users outside the pool


def test_stackoverflow_domain_shift_recipe_reports_per_domain_accuracy(tmp_path):
    from test_benchmark_data import write_tff

    root = tmp_path / "stackoverflow"
    root.mkdir()
    (root / "stackoverflow.word_count").write_text("".join(f"w{i} {100 - i}\n" for i in range(20)))
    kinds = [b"question", b"answer"] * 4  # every user asks and answers, so both pools can be formed
    # 6 users: the pools draw 4 of them, the other two hold the server set
    posts = {f"u{i}": ([f"w{i + k} w{k}".encode() for k in range(8)], kinds) for i in range(6)}
    write_tff(root / "stackoverflow_train.h5", posts, ("tokens", "type"))
    write_tff(root / "stackoverflow_test.h5", {"t": ([b"w1 w2", b"w3"], [b"question", b"answer"])}, ("tokens", "type"))
    population = _pools(4, 2, high_roles=("large",))
    models = {
        "small": {"builder": "stackoverflow_lstm_small", "args": {"vocab_size": 24}},
        "large": {"builder": "stackoverflow_lstm_large", "args": {"vocab_size": 24}},
    }
    out = tmp_path / "run"
    assert (
        run_cli(
            "fit",
            "--config",
            str(ROOT / "recipes/merged_codist_stackoverflow_domain_shift.yaml"),
            "--output_dir",
            str(out),
            "--rounds",
            "1",
            "--data.init_args.data_dir",
            str(tmp_path),
            "--data.init_args.download",
            "false",
            "--data.init_args.vocab_size",
            "20",
            "--data.init_args.max_clients",
            "4",
            "--data.init_args.question_clients",
            "2",
            "--data.init_args.distillation_examples",
            "8",
            "--population",
            population,
            "--strategy.init_args.clients_per_round",
            "{small: 2, large: 2}",
            "--strategy.init_args.distillation.init_args.steps",
            "1",
            "--runtime.progress",
            "false",
            "--models",
            json.dumps(models),
        )
        == 0
    )
    summary = read_summary(out)
    for role in ("small", "large"):
        assert {f"{role}/test_acc", f"{role}/test_acc_questions", f"{role}/test_acc_answers"} <= set(summary["final"])
    assert summary["reference"]["metrics"]["small/test_acc_questions"] == 0.2765


def test_fedhe_cifar10_heterogeneous_recipe_runs_a_round(tmp_path):
    write_cifar10(tmp_path, per_batch=20, test=10)
    summary = _run_fedhe_family(tmp_path, "fedhe_cifar10_heterogeneous")
    assert summary["comm"]["uplink_bytes"] == 3 * 10 * 11 * 4  # as on MNIST: C x (C + 1) numbers per round
    assert {f"personal/model{k}/test_acc" for k in range(10)} <= set(summary["final"])


def write_cinic10(root, train=2, test=1):
    """CINIC-10's PNG folders with ``train`` and ``test`` random images per class."""
    import numpy as np
    from PIL import Image

    from fl_lightning.data import Cinic10Data

    rng = np.random.default_rng(0)
    for split, n in (("train", train), ("test", test)):
        for name in Cinic10Data.classes:
            folder = root / "CINIC-10" / split / name
            folder.mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(folder / f"{i}.png")


def test_felo_cinic10_homogeneous_recipe_runs_a_round(tmp_path):
    write_cinic10(tmp_path)
    summary = _tiny_run(
        tmp_path,
        "felo_cinic10_iid_homogeneous",
        "--training.local_steps",
        "1",
        "--training.batch_size",
        "2",
        "--strategy.init_args.warmup_rounds",
        "0",
    )
    assert summary["reference"]["metrics"] == {"personal/test_acc": 0.70697}
    # 20% of the 10 clients, each sending C x (D + C + 1) class-knowledge numbers with D = 512
    assert summary["comm"]["by_payload"]["uplink"]["class_knowledge"] == 2 * 10 * (512 + 10 + 1) * 4


def test_fedgh_cifar100_heterogeneous_recipe_runs_a_round(tmp_path):
    write_cifar100(tmp_path, train=200, test=50)
    summary = _tiny_run(
        tmp_path, "fedgh_cifar100_heterogeneous", "--training.local_epochs", "1", "--training.batch_size", "8"
    )
    assert {f"personal/cnn{k}/test_acc" for k in range(1, 6)} <= set(summary["final"])
    assert summary["comm"]["downlink_bytes"] == 10 * (500 * 100 + 100) * 4  # the header to all 10 clients


def _small_htfe8():
    """HtFE8's eight roles with HtFLlib's FedAvgCNN and ResNet4 standing in for the larger networks (the same
    features and head), on eight clients: one of each architecture."""
    roles = ["cnn", "googlenet", "mobilenet_v2", "resnet18", "resnet34", "resnet50", "resnet101", "resnet152"]
    models = {role: {"builder": "htfl_cnn" if role == "cnn" else "htfl_resnet4"} for role in roles}
    return "--models", json.dumps(models), "--population.num_clients", "8"


def test_htfl_pathological_recipe_pools_the_test_set_and_scores_correct_over_samples(tmp_path):
    write_cifar10(tmp_path, per_batch=40, test=40)
    summary = _tiny_run(tmp_path, "htfl_fedproto_cifar10_pat", "--eval_every", "1", *_small_htfe8())
    partition = json.loads((tmp_path / "htfl_fedproto_cifar10_pat/partition.json").read_text())
    clients = partition["clients"]
    # PFLlib's blocks: 8 clients x 2 classes, 2 holders a class, so clients 2j and 2j + 1 hold classes 2j and 2j + 1
    # (in unequal counts: at these sizes a client's few examples of one may all fall in its test split) and classes
    # 8 and 9 go to nobody
    held = [{k for k, n in enumerate(c["class_counts"]) if n} for c in clients]
    assert all(held[i] and held[i] <= {2 * (i // 2), 2 * (i // 2) + 1} for i in range(8))
    # the 200 training and 40 test images pooled (24 of each class), each client's share split 75 / 25, the global
    # test set the local test splits together
    assert sum(c["train"] + c["test"] for c in clients) == 8 * 24 and partition["test_size"] == sum(
        c["test"] for c in clients
    )
    assert all(c["test"] == round(0.25 * (c["train"] + c["test"])) for c in clients)
    run = load_run(tmp_path / "htfl_fedproto_cifar10_pat")
    assert measured_value(run, "best/personal/test_acc") == summary["final"]["personal/test_acc"]  # one round
    assert summary["reference"]["metrics"] == {"best/personal/test_acc": 0.8339}
    # the run fills its cell of the poster's main table, laid out as the paper: methods down, settings across
    table = build_table([str(tmp_path)], "htfl/main-table")
    [value] = table["cells"][("FedProto", "Pat, CIFAR-10")]["values"]
    assert (value["paper"], value["paper_std"], value["n"]) == (0.8339, 0.0015, 1)
    assert value["mean"] == summary["final"]["personal/test_acc"]
    assert table["columns"] == ["Pat, CIFAR-10", "Pat, CIFAR-100", "Prac, CIFAR-10", "Prac, CIFAR-100"]
    assert {"FedProto", "FedDistill", "LG-FedAvg", "FedGen", "FedKTL"} <= set(table["rows"]) and table["runs"] == 1


def test_htfl_practical_cifar100_recipe_sends_the_heads_of_its_cyclic_tiers(tmp_path):
    write_cifar100(tmp_path, train=400, test=80)
    summary = _tiny_run(
        tmp_path,
        "htfl_lg_fedavg_cifar100_prac",
        *_small_htfe8(),
        *("--data.init_args.partitioner.init_args.min_partition_size", "8"),
    )
    config = yaml.safe_load((tmp_path / "htfl_lg_fedavg_cifar100_prac/config.yaml").read_text())
    assert config["population"]["assignment"] == "cyclic" and config["training"]["drop_last"] is True
    assert summary["comm"]["uplink_bytes"] == summary["comm"]["downlink_bytes"] == 8 * (512 * 100 + 100) * 4


# The recipes the tests above run a round of: every base naming a data set must be in one's chain.
TINY_RUNS = (
    "ondevice_kd_cifar10",
    "fedhe_mnist_heterogeneous",
    "private_mnist_homogeneous",
    "periodic_codist_cifar100_ph4700_outdomain",
    "velo_cifar10_noniid_extreme",
    "fedgh_cifar10_heterogeneous",
    "ondevice_kd_femnist",
    "weak_only_imdb",
    "ondevice_kd_imdb",
    "strong_only_speech",
    "ondevice_kd_speech",
    "ondevice_kd_cifar100",
    "merged_codist_stackoverflow_ph296k_indomain",
    "merged_codist_stackoverflow_domain_shift",
    "fedhe_cifar10_heterogeneous",
    "felo_cinic10_iid_homogeneous",
    "fedgh_cifar100_heterogeneous",
    "htfl_fedproto_cifar10_pat",
    "htfl_lg_fedavg_cifar100_prac",
)


def test_every_data_set_base_runs_a_round_through_one_of_its_recipes():
    import yaml

    covered = {base for recipe in TINY_RUNS for base in base_files(ROOT / f"recipes/{recipe}.yaml")}
    data_set_bases = [
        base
        for base in sorted((ROOT / "recipes/_base").glob("*.yaml"))
        if "class_path" in (yaml.safe_load(base.read_text()).get("data") or {})
    ]
    assert len(data_set_bases) >= 12
    assert [base.name for base in data_set_bases if base.resolve() not in covered] == []
