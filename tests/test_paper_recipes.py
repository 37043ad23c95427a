"""Paper recipes: each family runs a round on tiny files in the real formats, through its own recipe."""

import json

from conftest import ROOT, read_summary, run_cli
from test_vision_data import write_cifar10

TINY_POPULATION = json.dumps(
    {
        "num_clients": 6,
        "tiers": [{"name": "strong", "roles": ["aux", "target"], "count": 2}, {"name": "weak", "roles": ["aux"]}],
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
    assert summary["reference"] == {
        "paper": "paper-001 (Lim et al., on-device KD)",
        "table": "Table 4",
        "row": "CIFAR-10",
        "column": "Proposed",
        "metric": "target/test_acc",
        "value": 0.6243,
        "std": 0.001,
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
    out = tmp_path / recipe
    assert (
        run_cli(
            "fit",
            "--config",
            str(ROOT / f"recipes/{recipe}.yaml"),
            "--output_dir",
            str(out),
            "--rounds",
            "3",
            "--eval_every",
            "3",
            "--data.init_args.data_dir",
            str(tmp_path),
            "--data.init_args.download",
            "false",
            "--training.batch_size",
            "4",
            "--runtime.progress",
            "false",
        )
        == 0
    )
    return read_summary(out)


def test_fedhe_mnist_heterogeneous_recipe_uploads_class_logits_only(tmp_path):
    _tiny_mnist(tmp_path)
    summary = _run_fedhe_family(tmp_path, "fedhe_mnist_heterogeneous")
    assert summary["comm"]["uplink_bytes"] == 3 * 10 * 11 * 4  # one client per round, C x (C + 1) numbers
    assert summary["reference"]["value"] == 0.985 and "personal/test_acc" in summary["final"]


def test_private_baseline_sends_nothing(tmp_path):
    _tiny_mnist(tmp_path)
    summary = _run_fedhe_family(tmp_path, "private_mnist_homogeneous")
    assert summary["comm"]["uplink_bytes"] == summary["comm"]["downlink_bytes"] == 0


def test_codistillation_cifar100_recipe_with_cifar10_as_out_of_domain_server_set(tmp_path):
    import numpy as np

    from test_benchmark_data import write_tff

    root = tmp_path / "fed_cifar100"
    root.mkdir()
    rng = np.random.default_rng(0)
    image = lambda n: rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)  # noqa: E731
    write_tff(
        root / "fed_cifar100_train.h5",
        {str(i): (image(6), np.full(6, i, dtype=np.int64)) for i in range(4)},
        ("image", "label"),
    )
    write_tff(root / "fed_cifar100_test.h5", {"0": (image(4), np.arange(4, dtype=np.int64))}, ("image", "label"))
    write_cifar10(tmp_path, per_batch=4, test=2)
    population = json.dumps(
        {
            "num_clients": 4,
            "tiers": [{"name": "high", "roles": ["small", "large"], "count": 2}, {"name": "low", "roles": ["small"]}],
        }
    )
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
    assert summary["reference"]["value"] == 0.976
    assert summary["comm"]["downlink_bytes"] == 10 * (500 * 10 + 10) * 4  # the header to all 10 clients
    assert summary["comm"]["uplink_bytes"] == 10 * 2 * (500 + 1) * 4  # 2 classes per client, S (D + 1) numbers
