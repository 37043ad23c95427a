"""benchmarks/overhead.py's minimal loop and benchmarks/population.py (issue 14 items 4 and 5)."""

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


@pytest.mark.slow  # runs the population benchmark
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
