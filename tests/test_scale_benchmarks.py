"""The scale benchmarks run and print what they measure: benchmarks/overhead.py's minimal loop trains on the
examples fl_lightning's batches hold, benchmarks/population.py prints one JSON line per population, the peer
benchmark uses pfl-research's simple CNN and times each side, and the sweep-workers benchmark times the same trials
with one and two workers."""

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from fl_lightning.client.batches import batch_stream


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_minimal_loop_trains_on_the_examples_fl_lightnings_batches_hold():
    overhead = _module("overhead")
    # 50 examples in batches of 16: passes of 16 + 16 + 16 + 2; 20 steps are 5 passes, 6 steps 1.5 passes
    assert overhead.examples_seen(50, 16, 20) == 250 and overhead.examples_seen(50, 16, 6) == 50 + 32
    batches = batch_stream(torch.arange(50), None, torch.arange(50), 16, 6, torch.Generator().manual_seed(0))
    assert sum(len(b[0]) for b in batches) == 82
    result = overhead.run_minimal("digits_mlp", 2, 0, 1)  # raises unless it saw exactly that many examples
    schedule, expected = overhead.sampled_clients("digits_mlp", 2, 0, [50] * 20)
    assert len(schedule) == 2 and all(len(chosen) == 10 for chosen in schedule) and expected == 20 * 250
    assert result["examples"] > 0 and result["losses"] == [] and 0.1 < result["acc"] <= 1.0


@pytest.mark.full  # three profiled runs of the overhead benchmark
def test_counts_are_the_same_in_every_run_and_grow_with_the_steps():
    overhead = _module("overhead")
    overhead.Probe.counting = True
    try:
        one, again, two = (overhead.run_minimal("digits_mlp", rounds, 0, 1) for rounds in (1, 1, 2))
    finally:
        overhead.Probe.counting = False
    assert one["torch_ops"] == again["torch_ops"] and one["python_calls"] == again["python_calls"]
    # 10 clients x 20 steps a round: the second round's operators are about the first's (no setup inside)
    assert 1.9 < two["torch_ops"] / one["torch_ops"] < 2.1 and one["torch_ops"] > 200 * 50


@pytest.mark.full  # runs the population benchmark
def test_population_benchmark_prints_one_json_line_per_population():
    command = [sys.executable, str(ROOT / "benchmarks/population.py"), "--method", "fedhe", "--clients", "10", "30"]
    out = subprocess.run([*command, "--rounds", "2", "--json", "--counts"], capture_output=True, text=True, check=True)
    lines = [json.loads(line) for line in out.stdout.strip().splitlines()]
    assert [line["clients"] for line in lines] == [10, 30]
    for line in lines:
        assert line["method"] == "fedhe" and line["rounds"] == 2 and line["untrained"] == "skip"
        assert line["s_per_round"] > 0 and line["final_eval_s"] > 0 and line["peak_rss_mb"] > 100
        assert line["checkpoint_s_per_round"] > 0 and line["checkpoint_bytes_per_round"] > 10 * 4000
        assert 10 <= line["clients_evaluated"] <= 20  # the clients of 2 rounds of 10: those that trained
        assert line["python_calls_per_round"] > 10 * 3 * 20  # 10 clients x 3 steps, tens of calls each


def test_the_peer_benchmark_model_is_pfl_researchs_simple_cnn():
    peer = _module("peer_pfl")
    model = peer.simple_cnn()
    assert sum(p.numel() for p in model.parameters()) == 1_626_442  # pfl-research's 1.63 M
    kinds = [type(m).__name__ for m in [*model.features, model.head]]
    assert kinds == ["Conv2d", "ReLU", "Conv2d", "ReLU", "MaxPool2d", "Dropout", "Flatten", "Linear", "ReLU"] + [
        "Dropout",
        "Linear",
    ]
    assert [m.p for m in model.features if isinstance(m, torch.nn.Dropout)] == [0.25, 0.5]
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_the_peer_benchmarks_minimal_loop_times_each_round(tmp_path):
    peer = _module("peer_pfl")
    peer.write_random_cifar10(tmp_path, per_batch=10 * 50 // 5)  # 10 clients of 50 images
    result = peer.run_minimal(tmp_path, clients=10, per_round=2, rounds=3)
    assert len(result["round_s"]) == len(result["cpu_round_s"]) == 3
    assert result["s_per_round"] == result["round_s"][1] and result["cpu_s_per_round"] == result["cpu_round_s"][1]
    schedule = peer.sampled(10, 2, 3)
    assert [len(chosen) for chosen in schedule] == [2, 2, 2] and schedule != [schedule[0]] * 3


@pytest.mark.full  # runs both sides of the peer benchmark, each in its own process
def test_the_peer_benchmark_prints_each_sides_seconds_and_ratio():
    command = [sys.executable, str(ROOT / "benchmarks/peer_pfl.py"), "--tiny", "--executor", "sequential", "batched"]
    out = subprocess.run([*command, "--json"], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    sides = ["minimal", "fl-lightning-sequential", "fl-lightning-batched"]
    assert list(result["s_per_round"]) == sides + (["pfl-research"] if result["skipped"] is None else [])
    assert result["ratio_to_minimal"]["minimal"] == 1.0 and all(s > 0 for s in result["s_per_round"].values())
    assert result["cpu_ratio_to_minimal"]["minimal"] == 1.0 and all(s > 0 for s in result["cpu_s_per_round"].values())
    assert result["workload"] == {"clients": 20, "clients_per_round": 4, "rounds": 3, "repeats": 1} | {
        "torch": torch.__version__
    }
    # the model's dropout keeps every fit in the sequential loop, said up front
    fits = result["fits"]["fl-lightning-batched"]
    assert fits["batched_fits"] == 0 and fits["sequential_fits"] == 3 * 4, fits
    assert list(fits["sequential_reasons"]) == [
        "random layers (global: features.5 (Dropout), global: features.9 (Dropout)): one vmapped step cannot draw "
        "from each client's own stream"
    ]


@pytest.mark.full  # two sweeps, each starting worker processes
def test_the_sweep_workers_benchmark_times_the_same_trials_with_one_and_two_workers():
    command = [sys.executable, str(ROOT / "benchmarks/sweep_workers.py"), "--trials", "2", "--json"]
    result = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
    assert [len(result[side]["trial_s"]) for side in ("one_worker", "two_workers")] == [2, 2]
    assert result["trial_time_ratio"] == result["two_workers"]["trial_s_mean"] / result["one_worker"]["trial_s_mean"]
