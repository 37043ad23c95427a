"""Sequential vs batched executor on this machine: seconds per steady round, side by side in one process.

Runs digits recipes a few rounds with ``runtime.executor`` sequential and batched, alternating the two
(``--repeats`` times each) so that a noisy machine affects both alike, and prints the median seconds per
steady round (round 1 excluded: it pays first-call costs) and the ratio sequential / batched (> 1: batched
is faster). It is how ``runtime.executor: auto`` was chosen (docs/reference/measurements.md).

    python benchmarks/executor.py --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_flagship import RoundClock

WORKLOADS = {
    # name: recipe and overrides (a FedAvg CNN, a FedAvg MLP, the flagship's method with its per-phase state)
    "fedavg_cnn": ("quickstart.yaml", []),
    "fedavg_mlp": ("quickstart.yaml", ["--models", "{global: {builder: digits_mlp, args: {hidden: 64}}}"]),
    "ondevice_kd_cnn": ("digits_ondevice_kd.yaml", ["--training.optimizer_state", "shared_per_phase"]),
}


def seconds_per_round(recipe: str, extra: list[str], executor: str, rounds: int) -> tuple[float, dict | None]:
    from fl_lightning.cli.commands import fit_from_argv

    clock = RoundClock()
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--config", str(ROOT / "recipes" / recipe), "--rounds", str(rounds), "--eval_every", str(rounds)]
        argv += ["--runtime.progress", "false", "--runtime.executor", executor, "--output_dir", tmp, *extra]
        summary = fit_from_argv(argv, extra_loggers=[clock])
    per_round = np.diff(clock.stamps)[1:-1]  # steady rounds: not the first, not the last (it evaluates)
    return float(np.median(per_round)), summary.get("executor")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", nargs="*", choices=sorted(WORKLOADS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = []
    for name in args.only or WORKLOADS:
        recipe, extra = WORKLOADS[name]
        times: dict[str, list[float]] = {"sequential": [], "batched": []}
        fits = None
        for _ in range(args.repeats):
            for executor, seconds_list in times.items():
                seconds, counts = seconds_per_round(recipe, extra, executor, args.rounds)
                seconds_list.append(seconds)
                fits = counts or fits
        sequential, batched = (statistics.median(times[e]) for e in ("sequential", "batched"))
        results.append(
            {
                "workload": name,
                "s_per_round_sequential": sequential,
                "s_per_round_batched": batched,
                "sequential_over_batched": sequential / batched,
                "fits": fits,
            }
        )
    print(json.dumps(results, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
