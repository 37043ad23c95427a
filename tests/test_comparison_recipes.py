"""The comparison tables' baseline recipes (papers 000, 001, 003, 004) run a round on tiny files in the real
formats through their own recipes; what they send is checked against the formulas of the papers' tables."""

import json

import pytest
from conftest import ROOT, marked_beyond, read_summary, run_cli
from test_paper_recipes import _bn_layers, _resnet20, _tiny_mnist, _tiny_run
from test_vision_data import write_cifar10

from fl_lightning.report.runs import KIB_PER_CLIENT_ROUND, load_run, measured_value


def _params(builder, **args):
    from fl_lightning.models import registered_models

    return sum(p.numel() for p in registered_models()[builder](**args).parameters())


HEADER = 500 * 10 + 10  # paper 004's prediction header on CIFAR-10: 500-d representation, 10 classes
PAPER_004_TINY = ("--training.local_epochs", "1", "--training.batch_size", "8")


@pytest.mark.parametrize(
    "method, uplink, downlink",
    [
        # LG-FedAvg: the heads both ways, the paper's 39.14 KB per client and round
        ("lg_fedavg", 10 * HEADER * 4, 10 * HEADER * 4),
        # FD: each client's 2 labels' logits and the labels up (S x (C + 1) numbers), no teacher yet in round 1
        ("fd", 10 * 2 * 11 * 4, 0),
        # FedProto: S = 2 class prototypes with their labels up, no global prototype yet in round 1
        ("fedproto", 10 * 2 * 501 * 4, 0),
        # FML: the meme model (CNN-5) both ways
        ("fml", 10 * _params("fedgh_cnn5", num_classes=10) * 4, 10 * _params("fedgh_cnn5", num_classes=10) * 4),
    ],
)
def test_paper_004_table_3_baselines_run_a_round_and_send_what_the_paper_counts(tmp_path, method, uplink, downlink):
    write_cifar10(tmp_path, per_batch=20, test=10)
    summary = _tiny_run(tmp_path, f"{method}_cifar10_heterogeneous", *PAPER_004_TINY)
    assert summary["reference"]["table"] == "Table 3" and "personal/test_acc" in summary["final"]
    assert (summary["comm"]["uplink_bytes"], summary["comm"]["downlink_bytes"]) == (uplink, downlink)
    # the communication column: KiB down and up per client (10, every round) and round (1)
    kib = measured_value(load_run(tmp_path / f"{method}_cifar10_heterogeneous"), KIB_PER_CLIENT_ROUND)
    assert kib == (uplink + downlink) / 1024 / 10
    if method == "lg_fedavg":
        assert round(kib, 2) == summary["reference"]["metrics"][KIB_PER_CLIENT_ROUND] == 39.14
    # Rounds (90%) and CO: this one-round run's accuracy decides whether round 1 reaches the target
    run = load_run(tmp_path / f"{method}_cifar10_heterogeneous")
    reached = summary["final"]["personal/test_acc"] >= 0.9
    assert measured_value(run, "rounds_to/personal/test_acc@0.9") == (1 if reached else None)
    assert measured_value(run, "comm/kib_to/personal/test_acc@0.9") == ((uplink + downlink) / 1024 if reached else None)
    assert measured_value(run, "rounds_to/personal/test_acc@0.0") == 1  # any accuracy reaches 0
    assert measured_value(run, "comm/kib_to/personal/test_acc@0.0") == (uplink + downlink) / 1024


def test_rounds_and_traffic_to_a_target_come_from_the_first_logged_round_reaching_it(tmp_path):
    """Paper 004's Rounds (X) and CO, derived from a metrics.csv written by hand."""
    (tmp_path / "summary.json").write_text(json.dumps({"final": {}, "best": {}}))
    rows = [
        "round,personal/test_acc,comm/uplink_bytes,comm/downlink_bytes",
        "1,0.5,1024,2048",
        "2,",
        "3,0.91,3072,6144",
    ]
    rows.append("4,0.95,4096,8192")
    (tmp_path / "metrics.csv").write_text("\n".join(rows) + "\n")
    run = load_run(tmp_path)
    assert measured_value(run, "rounds_to/personal/test_acc@0.9") == 3  # round 2 logged no accuracy
    assert measured_value(run, "comm/kib_to/personal/test_acc@0.9") == (3072 + 6144) / 1024
    assert measured_value(run, "rounds_to/personal/test_acc@0.5") == 1  # reaching means at least the target
    assert measured_value(run, "rounds_to/personal/test_acc@0.99") is None  # never reached
    assert measured_value(run, "rounds_to/personal/test_acc@high") is None  # not a number


def test_fedkd_heterogeneous_recipe_sends_a_truncated_svd_of_the_mentee_update(tmp_path):
    write_cifar10(tmp_path, per_batch=20, test=10)
    summary = _tiny_run(tmp_path, "fedkd_cifar10_heterogeneous", *PAPER_004_TINY)
    mentee = _params("fedgh_cnn5", num_classes=10) * 4
    assert summary["comm"]["downlink_bytes"] == 10 * mentee  # round 1: the full mentee to everyone
    assert 0 < summary["comm"]["uplink_bytes"] < 10 * mentee
    assert summary["reference"]["metrics"] == {"personal/test_acc": 0.8016, KIB_PER_CLIENT_ROUND: None}


def test_paper_004_table_1_homogeneous_baseline_with_the_clients_own_model_as_meme(tmp_path):
    write_cifar10(tmp_path, per_batch=20, test=10)
    summary = _tiny_run(tmp_path, "fml_cifar10_n10_c100", *PAPER_004_TINY)
    assert summary["comm"]["uplink_bytes"] == 10 * _params("fedgh_cnn1") * 4  # N = 10, C = 100%: the meme is CNN-1
    assert summary["reference"]["column"] == "N=10, C=100%, CIFAR-10"


PAPER_001_TINY = (
    "--sampler.init_args.num_per_round",
    "3",
    "--training.local_steps",
    "2",
    "--training.batch_size",
    "8",
    "--data.init_args.partitioner.init_args.min_partition_size",
    "4",
)
HETERO = json.dumps(
    {
        "num_clients": 6,
        "tiers": [{"name": "strong", "roles": ["target"], "count": 2}, {"name": "weak", "roles": ["aux"]}],
    }
)
HOMO = json.dumps({"num_clients": 6, "tiers": [{"name": "all", "roles": ["aux"]}]})


def _aux_bytes():
    return sum(v.numel() * 4 for k, v in _resnet20(0.25).items() if "num_batches" not in k) + 8 * _bn_layers(0.25)


@pytest.mark.parametrize(
    "recipe, population, extra, metric",
    marked_beyond(
        3,
        [
            ("moon_cifar10", HOMO, (), "aux/test_acc"),
            ("feddf_cifar10", HOMO, ("--strategy.init_args.steps", "2"), "aux/test_acc"),
            ("dsfl_cifar10", HETERO, ("--strategy.init_args.distill_steps", "2"), "personal/strong/test_acc"),
            (
                "fedgems_cifar10",
                HETERO,
                ("--strategy.init_args.server_steps", "2", "--strategy.init_args.distill_steps", "2"),
                "server/test_acc",
            ),
            (
                "fedmd_cifar10",
                HETERO,
                ("--strategy.init_args.public_epochs", "1", "--strategy.init_args.private_epochs", "1")
                + ("--strategy.init_args.digest_steps", "2"),
                "personal/strong/test_acc",
            ),
        ],
    ),
    ids=lambda v: v if isinstance(v, str) and v.endswith("cifar10") else "",
)
def test_paper_001_table_5_baselines_run_a_round(tmp_path, recipe, population, extra, metric):
    write_cifar10(tmp_path, per_batch=40, test=20)  # 200 images: 20 for the server's public set
    summary = _tiny_run(tmp_path, recipe, "--population", population, *PAPER_001_TINY, *extra)
    assert metric in summary["final"] and summary["reference"]["table"] == "Table 5"
    assert next(iter(summary["reference"]["metrics"])) == metric
    uplink = summary["comm"]["uplink_bytes"]
    if recipe == "feddf_cifar10":
        assert uplink == 3 * _aux_bytes()  # FedAvg's traffic: the small model from each of 3 clients
    if recipe in ("dsfl_cifar10", "fedmd_cifar10", "fedgems_cifar10"):
        assert uplink == 3 * 20 * 10 * 4  # logits on the whole 20-example public set, C = 10
    if recipe == "moon_cifar10":  # the small model with MOON's projection head and its classifier, whole
        from fl_lightning.models import ModelSpec

        moon = ModelSpec("resnet20", {"width": 0.25}, projection_dim=256).build(num_classes=10, in_channels=3)
        assert uplink == 3 * sum(v.numel() * v.element_size() for v in moon.state_dict().values())


def test_moon_on_google_speech_runs_the_cell_the_paper_leaves_empty(tmp_path):
    from test_paper_recipes import _speech_files

    from fl_lightning.models import ModelSpec

    _speech_files(tmp_path)  # two words: two classes
    population = json.dumps({"num_clients": 4, "tiers": [{"name": "all", "roles": ["aux"]}]})
    tiny = ("--sampler.init_args.num_per_round", "2", "--training.local_steps", "1", "--training.batch_size", "4")
    summary = _tiny_run(
        tmp_path, "moon_speech", "--population", population, *tiny,
        "--data.init_args.partitioner.init_args.min_partition_size", "1",
    )  # fmt: skip
    assert summary["reference"]["column"] == "MOON (homo)" and summary["reference"]["metrics"] == {"aux/test_acc": None}
    assert "aux/test_acc" in summary["final"]
    # 2 clients send the 25% speech CNN with MOON's projection head (Linear(D, D), ReLU, Linear(D, 256)) and
    # its classifier on the 256-d projection, whole state dicts, and get the same back
    moon = ModelSpec("speech_cnn", {"width": 0.25}, projection_dim=256).build(num_classes=2, in_channels=1)
    model_bytes = sum(v.numel() * v.element_size() for v in moon.state_dict().values())
    assert summary["comm"]["uplink_bytes"] == summary["comm"]["downlink_bytes"] == 2 * model_bytes


def test_feddf_large_runs_on_the_strong_clients_only(tmp_path):
    write_cifar10(tmp_path, per_batch=40, test=20)
    summary = _tiny_run(
        tmp_path, "feddf_large_cifar10", "--population", HETERO, "--strategy.init_args.steps", "2", *PAPER_001_TINY[2:]
    )
    target = sum(v.numel() * 4 for k, v in _resnet20(1.0).items() if "num_batches" not in k) + 8 * _bn_layers(1.0)
    assert summary["comm"]["uplink_bytes"] == 2 * target and summary["reference"]["row"] == "FedDF(large)"


@pytest.mark.slow  # FedMD's transfer learning and a round on tiny CIFAR; its MNIST recipe has a fast test
def test_fedmd_of_paper_000_aligns_n_public_examples_per_round(tmp_path):
    _tiny_mnist(tmp_path)  # 60 training images: 6 for the public set
    summary = _tiny_run(
        tmp_path,
        "fedmd_mnist_heterogeneous",
        "--rounds",
        "3",
        "--eval_every",
        "3",
        "--training.batch_size",
        "4",
        "--strategy.init_args.public_size",
        "4",
        "--strategy.init_args.public_epochs",
        "1",
        "--strategy.init_args.private_epochs",
        "1",
    )
    # one client per round uploads n x C logits and gets the consensus back with the n positions (int32)
    assert summary["comm"]["uplink_bytes"] == 3 * 4 * 10 * 4
    assert summary["comm"]["downlink_bytes"] == 3 * (4 * 10 * 4 + 4 * 4)
    assert summary["reference"]["row"] == "FedMD" and summary["reference"]["metrics"] == {"personal/test_acc": 0.98}


def test_a_base_only_recipe_is_its_base_run_under_another_cell():
    from fl_lightning.run.recipes import load_recipe

    for alias, base in (("fedavg_cifar10_table5", "weak_only_cifar10"), ("dsfl_cifar10_table2", "dsfl_cifar10")):
        merged = load_recipe(ROOT / f"recipes/{alias}.yaml")
        same = load_recipe(ROOT / f"recipes/{base}.yaml")
        assert merged.pop("reference") != same.pop("reference") and merged == same


@pytest.mark.slow  # a FedMD round with its transfer-learning phase
def test_the_fedmd_cells_of_paper_003_carry_no_number(tmp_path):
    write_cifar10(tmp_path, per_batch=20, test=10)
    depths = [10, 14, 18, 22, 26]
    population = json.dumps(
        {"num_clients": 5, "tiers": [{"name": f"resnet{d}", "roles": [f"resnet{d}"], "count": 1} for d in depths]}
    )
    out = tmp_path / "run"
    argv = ["fit", "--config", str(ROOT / "recipes/fedmd_cifar10_iid_previous.yaml"), "--output_dir", str(out)]
    argv += ["--rounds", "1", "--data.init_args.data_dir", str(tmp_path), "--data.init_args.download", "false"]
    argv += ["--population", population, "--sampler.init_args.fraction", "1.0", "--training.batch_size", "4"]
    argv += ["--training.local_steps", "1", "--strategy.init_args.public_size", "4", "--runtime.progress", "false"]
    argv += ["--strategy.init_args.public_epochs", "1", "--strategy.init_args.private_epochs", "1"]
    assert run_cli(*argv) == 0
    summary = read_summary(out)
    assert summary["reference"]["metrics"] == {"personal/test_acc": None} and "personal/test_acc" in summary["final"]
    assert summary["comm"]["uplink_bytes"] == 5 * 4 * 10 * 4  # 5 clients, n = 4 public examples, C = 10


def test_fedgkt_of_paper_003_uploads_every_example_and_reports_the_server_side(tmp_path):
    write_cifar10(tmp_path, per_batch=20, test=10)  # 100 training images over 5 clients
    population = json.dumps({"num_clients": 5, "tiers": [{"name": "all", "roles": ["client"]}]})
    summary = _tiny_run(tmp_path, "fedgkt_cifar10_iid", "--population", population, "--training.local_steps", "1")
    assert "server/test_acc" in summary["final"] and summary["reference"]["row"] == "FedGKT"
    # every client, every training example: the ResNet-8's 16 x 32 x 32 stem map, 10 logits and an int32 label
    assert summary["comm"]["uplink_bytes"] == 100 * (16 * 32 * 32 + 10 + 1) * 4
    assert summary["comm"]["downlink_bytes"] == 0  # the server's logits go out with each client's next round
    config = (tmp_path / "fedgkt_cifar10_iid" / "config.yaml").read_text()
    assert "fedgkt_server_resnet" in config and "fedgkt_client_resnet8" in config


def _sliced_bytes(rate):
    """Bytes of a ResNet26 slice's parameters: what HeteroFL sends (batch-norm statistics stay home)."""
    from fl_lightning.models import registered_models

    return sum(p.numel() * 4 for p in registered_models()["cifar_resnet26"](rate=rate).parameters())


@pytest.mark.slow  # five ResNet26 slices; the slicing and its sizes have fast tests (test_heterofl.py)
def test_heterofl_of_paper_003_trains_width_slices_of_resnet26_and_evaluates_the_global_model(tmp_path):
    write_cifar10(tmp_path, per_batch=20, test=10)  # 100 training images over 5 clients
    population = json.dumps({"num_clients": 5, "tiers": [{"name": "all", "roles": ["a", "b", "c", "d", "e"]}]})
    tiny = ("--sampler.init_args.fraction", "1.0", "--training.local_epochs", "1", "--training.batch_size", "5")
    summary = _tiny_run(tmp_path, "heterofl_cifar10_iid", "--population", population, *tiny)
    assert summary["reference"]["row"] == "HeteroFL" and summary["reference"]["metrics"] == {"a/test_acc": None}
    assert summary["monitor"] == "a/test_acc" and "a/test_acc" in summary["final"]
    rates = {"a": 1.0, "b": 0.5, "c": 0.25, "d": 0.125, "e": 0.0625}
    uplink = dict(summary["comm"]["by_payload"]["uplink"])
    assert uplink.pop("label_split") == 5 * 10  # each client's label set: C booleans
    # every client sends the slice of its drawn rate, whole: 5 clients' slices in all
    drawn = {role: sent / _sliced_bytes(rates[role]) for role, sent in uplink.items()}
    assert all(n == int(n) for n in drawn.values()) and sum(drawn.values()) == 5, drawn
    assert summary["comm"]["by_payload"]["downlink"] == uplink  # the same slices went out


def test_best_metric_is_the_highest_value_over_the_evaluated_rounds(tmp_path):
    """HtFLlib's papers report the best round: ``best/<metric>`` reads it from metrics.csv."""
    (tmp_path / "summary.json").write_text(json.dumps({"final": {"personal/test_acc": 0.6}, "best": {}}))
    rows = ["round,personal/test_acc", "1,0.5", "2,", "3,0.7", "4,0.6"]
    (tmp_path / "metrics.csv").write_text("\n".join(rows) + "\n")
    run = load_run(tmp_path)
    assert measured_value(run, "best/personal/test_acc") == 0.7
    assert measured_value(run, "personal/test_acc") == 0.6  # the final round's, as every other cell
    assert measured_value(run, "best/global/test_acc") is None  # never logged
