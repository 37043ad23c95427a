"""Probe: the sequential loop with each role's model compiled (``torch.compile``), against the eager loop.

Not an option of the framework (benchmarks/results/log.md, "CUDA graphs and torch.compile"). Each role's
``features`` and ``head`` are compiled in place (``nn.Module.compile``, so parameter names and the
one-instance-per-role pool are unchanged, and the forward, ``features`` and ``head`` calls of every step
function go through the compiled code); the backward is compiled with them (AOTAutograd), the optimizer
step stays eager. Runs a recipe per mode in this process, one after another, and prints per mode the
first round's seconds (compilation), the median steady round (the rounds between the first and the
evaluating last one) and the final test metrics.

    python benchmarks/probes/compile_sequential.py --json                                   # digits quickstart, CPU
    python benchmarks/probes/compile_sequential.py --flagship --rounds 6 --json             # ResNet20 pair, CPU
    python benchmarks/probes/compile_sequential.py --flagship --accelerator cuda --modes eager default reduce-overhead
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_flagship import RoundClock, write_random_cifar10

from fl_lightning.client import loop as loop_module


def _compiling(mode: str):
    """``LocalLoop.build_slots`` that compiles each role's feature extractor and head after building them."""
    build = loop_module.LocalLoop.build_slots

    def build_and_compile(self, *args, **kwargs):
        build(self, *args, **kwargs)
        for slot in self.slots.values():
            slot.module.model.features.compile(mode=mode)
            slot.module.model.head.compile(mode=mode)

    return build_and_compile


def run(mode: str, args, data_dir: Path, out: Path) -> dict:
    from fl_lightning.cli.commands import fit_from_argv

    recipe = "ondevice_kd_cifar10.yaml" if args.flagship else "quickstart.yaml"
    argv = ["--config", str(ROOT / "recipes" / recipe), "--rounds", str(args.rounds), "--eval_every", str(args.rounds)]
    argv += ["--checkpoint_every", str(args.rounds), "--runtime.progress", "false", "--output_dir", str(out)]
    argv += ["--runtime.accelerator", args.accelerator, "--runtime.executor", "sequential"]
    if args.flagship:  # 10 clients, 4 a round, 2 of them strong: the CPU-sized flagship of gpu_flagship.py --tiny
        tiers = "[{name: strong, roles: [aux, target], count: 2}, {name: weak, roles: [aux]}]"
        argv += ["--data.init_args.data_dir", str(data_dir), "--data.init_args.download", "false"]
        if args.accelerator == "cpu":
            argv += ["--population.num_clients", "10", "--population.tiers", tiers]
            argv += ["--sampler.init_args.num_per_round", "4", "--training.local_steps", str(args.local_steps)]
    build = loop_module.LocalLoop.build_slots
    if mode != "eager":
        loop_module.LocalLoop.build_slots = _compiling(mode)
    clock = RoundClock()
    try:
        summary = fit_from_argv(argv, extra_loggers=[clock])
    finally:
        loop_module.LocalLoop.build_slots = build
        torch._dynamo.reset()  # the next mode compiles afresh
    rounds = np.diff(clock.stamps).tolist()
    return {
        "mode": mode,
        "first_round_s": rounds[0],
        "s_per_steady_round": statistics.median(rounds[1:-1] or rounds[-1:]),
        "final": summary["final"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", default=["eager", "default"])
    parser.add_argument("--flagship", action="store_true", help="the ResNet20 pair of the flagship recipe")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--local_steps", type=int, default=10, help="flagship on CPU: local steps")
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch._dynamo.config.recompile_limit = 64  # two roles, training and evaluation, short last batches
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.flagship:
            write_random_cifar10(Path(tmp) / "data", 400 if args.accelerator == "cpu" else 10_000)
        for mode in args.modes:
            results.append(run(mode, args, Path(tmp) / "data", Path(tmp) / mode))
            print(json.dumps(results[-1]) if args.json else results[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
