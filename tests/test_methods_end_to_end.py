"""Every method's digits recipe learns: accuracy well above chance (0.1) after a shortened run."""

import pytest
from conftest import ROOT, read_summary, run_cli

pytestmark = pytest.mark.slow  # every method's digits run to an accuracy: minutes of CPU

# recipe, rounds (shortened from the recipe's), metric, minimum accuracy
CASES = [
    ("digits_fedhe", 100, "personal/test_acc", 0.5),
    ("digits_fedhe_async", 40, "personal/test_acc", 0.5),
    ("digits_ondevice_kd", 30, "target/test_acc", 0.7),
    ("digits_weak_only", 20, "aux/test_acc", 0.7),
    ("digits_strong_only", 20, "target/test_acc", 0.6),
    ("digits_periodic_codist", 15, "large/test_acc", 0.5),
    ("digits_merged_codist", 15, "large/test_acc", 0.5),
    ("digits_felo", 20, "personal/test_acc", 0.7),
    ("digits_velo", 20, "personal/test_acc", 0.7),
    ("digits_fedgh", 10, "personal/test_acc", 0.7),
    ("digits_fedgen", 10, "personal/test_acc", 0.7),  # 0.99 measured
    ("digits_fedproto", 10, "personal/test_acc", 0.7),  # 0.86 measured
    ("digits_fedtgp", 10, "personal/test_acc", 0.7),  # 0.83 measured
    ("digits_fedhkd", 5, "personal/test_acc", 0.7),  # 0.1 untrained
    ("digits_fedpac", 10, "personal/test_acc", 0.7),  # 0.1 untrained
    ("digits_lg_fedavg", 10, "personal/test_acc", 0.7),  # 0.87 measured
    ("digits_fml", 10, "personal/test_acc", 0.7),  # 0.86 measured
    ("digits_fedkd", 10, "personal/test_acc", 0.7),  # 0.91 measured
    ("digits_fedl2g", 20, "personal/test_acc", 0.7),  # 0.85 measured
    ("digits_fedmrl", 10, "personal/test_acc", 0.7),  # 0.98 measured
    ("digits_fd", 60, "personal/test_acc", 0.5),
    ("digits_feddf", 20, "small/test_acc", 0.7),  # 0.81 measured
    ("digits_moon", 40, "small/test_acc", 0.7),  # 0.928 measured (lr 0.02)
    ("digits_heterofl", 20, "a/test_acc", 0.8),  # 0.96 measured
    ("digits_fedntd", 20, "small/test_acc", 0.8),  # 0.94 measured after the recipe's 40 rounds; chance 0.1
    ("digits_ccvr", 20, "small/test_acc", 0.8),  # 0.964 measured after the recipe's 40 rounds (0.942 uncalibrated)
    ("digits_fedetf", 20, "small/test_acc", 0.8),  # 0.958 measured after the recipe's 40 rounds; personal 0.986
    ("digits_fednh", 20, "small/test_acc", 0.8),  # 0.961 measured after the recipe's 40 rounds
    (
        "digits_dsfl",
        60,
        "personal/test_acc",
        0.15,
    ),  # 0.228 measured at ERA's T = 1 (Tables 13-15): below Standalone, as in paper 001; chance 0.1
    ("digits_fedmd", 20, "personal/test_acc", 0.4),  # 0.66 measured
    ("digits_fedgems", 20, "server/test_acc", 0.75),  # 0.90 measured
    ("digits_fedgkt", 15, "server/test_acc", 0.5),  # 0.60 measured
    # 0.976 measured, 0.962 before any training (the nearest own prototype of random frozen features tells a
    # client's 2 classes apart); that the projection learns is tested under Dirichlet skew in test_fedpcl.py
    # the threshold is above what no training gives
    ("digits_fedpcl", 10, "personal/test_acc", 0.97),
    # 0.986 measured, 0.654 after round 1: the ETF classification learns with a random (noise) generator
    ("digits_fedktl", 10, "personal/test_acc", 0.9),
]


@pytest.mark.parametrize("recipe, rounds, metric, minimum", CASES, ids=[c[0] for c in CASES])
def test_method_learns_on_digits(tmp_path, recipe, rounds, metric, minimum):
    out = tmp_path / recipe
    assert (
        run_cli(
            "fit",
            "--config",
            str(ROOT / "recipes" / f"{recipe}.yaml"),
            "--output_dir",
            str(out),
            "--rounds",
            str(rounds),
            "--eval_every",
            str(rounds),
            "--runtime.progress",
            "false",
        )
        == 0
    )
    summary = read_summary(out)
    assert summary["monitor"] == metric
    assert summary["final"][metric] >= minimum, summary["final"]
