"""Every method's digits recipe learns: after a shortened run, its accuracy is at least 10 points above the same
run untrained (computed here, not assumed to be chance) and at or above the case's own floor; DS-FL's distillation
beats the same clients training alone."""

import pytest
from conftest import ROOT, read_summary, run_cli

from fl_lightning.run.orchestrator import FederationOrchestrator

pytestmark = pytest.mark.slow  # every method's digits run to an accuracy: minutes of CPU

MARGIN = 0.10  # accuracy points above the untrained run that count as learning


def fit(out, recipe: str, rounds: int, *extra: str) -> dict:
    """``flrun fit`` of a digits recipe for ``rounds`` rounds, evaluated after the last; its summary."""
    argv = ["--config", str(ROOT / "recipes" / f"{recipe}.yaml"), "--rounds", str(rounds), "--eval_every", str(rounds)]
    assert run_cli("fit", *argv, "--runtime.progress", "false", *extra, "--output_dir", str(out)) == 0
    return read_summary(out)


def untrained(monkeypatch, out, recipe: str, rounds: int, *extra: str) -> float:
    """The same run's monitored accuracy with no round trained: every round's training (the clients', the
    server's, any distillation) left out, the evaluation as the run makes it, from the models as built. A learning
    rate of 0 would leave the server-side training of FedGKT, FedDF, FedGEMS, ... in."""
    with monkeypatch.context() as patch:
        patch.setattr(FederationOrchestrator, "_train", lambda self, rnd: {})
        summary = fit(out, recipe, rounds, *extra)
    return summary["final"][summary["monitor"]]


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
    ("digits_fedsa", 10, "personal/test_acc", 0.8),  # 0.99 measured at round 10
    ("digits_fpl", 10, "mlp/test_acc", 0.7),  # 0.905 measured after the recipe's 20 rounds (0.872 without prototypes)
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
def test_method_learns_on_digits(tmp_path, monkeypatch, recipe, rounds, metric, minimum):
    summary = fit(tmp_path / recipe, recipe, rounds)
    baseline = untrained(monkeypatch, tmp_path / "untrained", recipe, rounds)
    assert summary["monitor"] == metric
    accuracy = summary["final"][metric]
    assert accuracy >= minimum and accuracy >= baseline + MARGIN, (accuracy, baseline, summary["final"])


def test_dsfl_beats_its_clients_training_alone(tmp_path, monkeypatch):
    """DS-FL at its paper's ERA temperature 0.1 (which sharpens the averaged open-set outputs) against the same run
    with no distillation step: the same clients, data, seeds and local steps, each training its own model alone.
    30 rounds: 0.628 against 0.413 measured, 0.106 untrained. At paper 001's T = 1 (the recipe's), ERA flattens
    the teacher and DS-FL stays below its clients alone (0.222 after 60 rounds), as paper 001 reports."""
    sharp = ["--strategy.init_args.era_temperature", "0.1"]
    dsfl = fit(tmp_path / "dsfl", "digits_dsfl", 30, *sharp)["final"]["personal/test_acc"]
    alone = fit(tmp_path / "alone", "digits_dsfl", 30, "--strategy.init_args.distill_steps", "0")
    baseline = untrained(monkeypatch, tmp_path / "untrained", "digits_dsfl", 30, *sharp)
    assert alone["comm"]["downlink_bytes"] > 0  # the same protocol ran, its distillation left out
    assert dsfl >= alone["final"]["personal/test_acc"] + MARGIN and dsfl >= baseline + MARGIN, (dsfl, alone, baseline)
