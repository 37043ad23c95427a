"""Digits inputs as pixels / 16 (``normalize: none``) or standardised per pixel (``pixel``, the default).

Runs paper 001's weak-only and strong-only digits baselines at the settings of an independent plain
PyTorch implementation (20 clients, Dirichlet 0.1, MLPs of 32 / 128 hidden units, SGD 0.05 momentum 0.9,
60 rounds; weak-only samples 4 clients per round, strong-only trains the 4 strong clients), then
strong-only with larger steps (lr 0.3, 0.5), and prints per run the final accuracy, the share of test
examples given the most predicted class and how many hidden units of the final model are alive (positive
on at least one test input). The numbers in docs/reference/datasets_and_models.md ("Digits inputs") come from here.

    python benchmarks/probes/digits_normalize.py --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = [
    "--data.init_args.partitioner",
    "{class_path: fl_lightning.data.DirichletPartitioner, init_args: {alpha: 0.1, min_partition_size: 2}}",
    "--models",
    "{aux: {builder: digits_mlp, args: {hidden: 32}}, target: {builder: digits_mlp, args: {hidden: 128}}}",
    "--runtime.progress",
    "false",
]
RUNS = [  # (label, recipe, role, extra arguments)
    ("weak-only, lr 0.05", "digits_weak_only", "aux", ["--sampler.init_args.num_per_round", "4"]),
    ("strong-only, lr 0.05", "digits_strong_only", "target", []),
    ("strong-only, lr 0.3", "digits_strong_only", "target", ["--training.optimizer.init_args.lr", "0.3"]),
    ("strong-only, lr 0.5", "digits_strong_only", "target", ["--training.optimizer.init_args.lr", "0.5"]),
]


def alive_units(out: Path, role: str, normalize: str, seed: int) -> int:
    """Hidden units of the final global model that are positive on at least one test input."""
    from fl_lightning.data import DigitsData
    from fl_lightning.models import ModelSpec
    from fl_lightning.run.checkpoint import load_checkpoint

    weights = load_checkpoint(out / "checkpoints" / "last.ckpt")["strategy"]["global_weights"][role]
    hidden = weights["features.1.weight"].shape[0]
    model = ModelSpec("digits_mlp", {"hidden": hidden}).build(num_classes=10, in_channels=1)
    model.load_state_dict(weights)
    data = DigitsData(normalize=normalize)  # the test set and, with every example on a client, the same statistics
    data.setup(20, seed)
    with torch.no_grad():
        return int((model.features(data.test_x) > 0).any(0).sum())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = parser.parse_args()
    from fl_lightning.cli.commands import fit_from_argv

    print("| run | normalize | seed | test acc | top class share | alive hidden units |")
    print("|---|---|---|---|---|---|")
    for label, recipe, role, extra in RUNS:
        for normalize in ("none", "pixel"):
            for seed in args.seeds:
                with tempfile.TemporaryDirectory() as tmp:
                    out = Path(tmp) / "run"
                    argv = ["--config", str(ROOT / "recipes" / f"{recipe}.yaml"), "--seed", str(seed)]
                    argv += ["--output_dir", str(out), "--data.init_args.normalize", normalize, *SETTINGS, *extra]
                    final = fit_from_argv(argv)["final"]
                    acc, share = final[f"{role}/test_acc"], final[f"{role}/test_top_class_share"]
                    loss = final[f"{role}/test_loss"]
                    alive = "NaN weights" if math.isnan(loss) else alive_units(out, role, normalize, seed)
                print(f"| {label} | {normalize} | {seed} | {acc:.3f} | {share:.3f} | {alive} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
