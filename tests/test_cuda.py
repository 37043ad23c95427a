"""Every digits recipe on a CUDA device: runs only where a GPU is (benchmarks/gpu_check.sh runs it there).

The CPU suite cannot see a tensor left on the wrong device: FedHe and Felo indexed the server's class
knowledge (kept on the CPU) with labels on the GPU and failed in their first step on a GPU, which only a
run on a GPU showed. Each recipe runs 2 rounds with the GPU's default executor (batched) and must end with
finite metrics; the methods whose server keeps tensors also resume on the GPU (checkpoints load on the CPU,
so their server state must come back where a fresh run has it) and must equal the uninterrupted run.
"""

import json
import math
from pathlib import Path

import pytest
import torch

from fl_lightning.cli import fit_from_argv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("digits_*.yaml")) + ["quickstart.yaml"]
# server state that meets client uploads: weights and Adam moments, class banks, headers, low-rank updates
SERVER_STATE = ["fedadam", "periodic_codist", "merged_codist", "heterofl", "fedkd", "fedgh", "fedhe", "felo"]
SERVER_STATE += ["velo", "fd"]


def _argv(recipe: str, out: Path, rounds: int) -> list[str]:
    argv = ["--config", str(ROOT / "recipes" / recipe), "--rounds", str(rounds), "--eval_every", str(rounds)]
    return argv + ["--output_dir", str(out), "--runtime.progress", "false", "--runtime.accelerator", "cuda"]


@pytest.mark.parametrize("recipe", RECIPES)
def test_digits_recipe_runs_on_cuda(tmp_path, recipe):
    summary = fit_from_argv(_argv(recipe, tmp_path, 2))
    metrics = {k: v for k, v in summary["final"].items() if k.endswith(("test_acc", "test_loss"))}
    assert metrics, summary["final"]
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.parametrize("method", SERVER_STATE)
def test_a_run_resumed_on_cuda_equals_the_uninterrupted_one(tmp_path, method):
    recipe = f"digits_{method}.yaml"
    fit_from_argv(_argv(recipe, tmp_path / "full", 3))
    fit_from_argv([*_argv(recipe, tmp_path / "cut", 3), "--stop_after", "2"])
    fit_from_argv([*_argv(recipe, tmp_path / "cut", 3), "--resume", "auto"])
    full, resumed = (json.loads((tmp_path / run / "summary.json").read_text())["final"] for run in ("full", "cut"))
    assert full and resumed == full


@pytest.mark.parametrize("recipe", ["quickstart.yaml", "digits_ondevice_kd.yaml"])
def test_cuda_graphs_replay_the_steps_of_the_eager_run(tmp_path, recipe):
    """runtime.cuda_graphs on a real GPU: the captures succeed, most steps replay, and the run ends where the
    eager sequential run does (the replayed kernels are the eager step's; tolerance for cuDNN's choices)."""
    argv = [*_argv(recipe, tmp_path / "eager", 3), "--runtime.executor", "sequential"]
    eager = fit_from_argv(argv)
    argv = [*_argv(recipe, tmp_path / "graphs", 3), "--runtime.executor", "sequential", "--runtime.cuda_graphs", "true"]
    replayed = fit_from_argv(argv)
    counts = replayed["cuda_graphs"]
    assert counts["captures"] > 0 and not [r for r in counts["eager_reasons"] if "capture failed" in r], counts
    assert counts["graphed_steps"] > counts["eager_steps"], counts
    assert replayed["final"].keys() == eager["final"].keys()
    for key, value in eager["final"].items():
        assert replayed["final"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
