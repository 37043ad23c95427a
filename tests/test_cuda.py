"""Every digits recipe on a CUDA device: runs only where a GPU is (benchmarks/gpu_check.sh runs it there).

The CPU suite cannot see a tensor left on the wrong device: FedHe and Felo indexed the server's class
knowledge (kept on the CPU) with labels on the GPU and failed in their first step on a GPU, which only a
run on a GPU showed. Each recipe runs 2 rounds with both executors and must end with finite metrics.
"""

import math
from pathlib import Path

import pytest
import torch

from fl_lightning.cli import fit_from_argv

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

ROOT = Path(__file__).resolve().parents[1]
RECIPES = sorted(p.name for p in (ROOT / "recipes").glob("digits_*.yaml")) + ["quickstart.yaml"]


@pytest.mark.parametrize("executor", ["sequential", "batched"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_digits_recipe_runs_on_cuda(tmp_path, recipe, executor):
    argv = ["--config", str(ROOT / "recipes" / recipe), "--rounds", "2", "--eval_every", "2"]
    argv += ["--output_dir", str(tmp_path), "--runtime.progress", "false", "--runtime.accelerator", "cuda"]
    summary = fit_from_argv([*argv, "--runtime.executor", executor])
    metrics = {k: v for k, v in summary["final"].items() if k.endswith(("test_acc", "test_loss"))}
    assert metrics, summary["final"]
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert (tmp_path / "checkpoints" / "last.ckpt").is_file()
