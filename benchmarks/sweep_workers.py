"""A trial's time in a sweep of one worker process against one of two, on the same trials.

    python benchmarks/sweep_workers.py             # 8 trials of the quickstart (20 rounds), 1 then 2 workers
    python benchmarks/sweep_workers.py --json      # the same, one JSON object

Every trial runs the same recipe with the same parameters (a search space of one point, no pruning), so each
trial is the same work and its ``seconds`` (trials.csv: the trial's own run) compare between the two
sweeps: with as many cores as workers, a trial of the two-worker sweep should take what one of the one-worker
sweep takes, and the sweep half the time. Run it on an otherwise idle machine with at least two cores; each
trial uses one torch thread (``runtime.num_threads``' default).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SWEEP = """\
base: {root}/recipes/quickstart.yaml
metric: global/test_acc
direction: maximize
n_trials: {trials}
overrides: {{rounds: 20, eval_every: 5, runtime.progress: false}}
sampler: {{name: random, seed: 0}}
pruner: {{name: none}}
parameters:
  training.optimizer.init_args.lr: {{type: categorical, choices: [0.05]}}
"""


def one_sweep(folder: Path, trials: int, workers: int) -> dict:
    sweep = folder / f"workers{workers}.yaml"
    sweep.write_text(SWEEP.format(root=ROOT, trials=trials))
    out = folder / f"out{workers}"
    command = [sys.executable, "-m", "fl_lightning", "sweep", "--config", str(sweep), "--output_dir", str(out)]
    env = {**os.environ, "WANDB_MODE": "offline"}
    start = time.perf_counter()
    subprocess.run([*command, "--n_jobs", str(workers)], cwd=folder, env=env, check=True, capture_output=True)
    wall = time.perf_counter() - start
    with (out / "trials.csv").open() as rows:
        seconds = [float(row["seconds"]) for row in csv.DictReader(rows) if row["state"] == "COMPLETE"]
    assert len(seconds) == trials, f"{len(seconds)} of {trials} trials completed"
    return {"workers": workers, "wall_s": wall, "trial_s_mean": statistics.mean(seconds), "trial_s": seconds}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="sweep-workers-") as tmp:
        one, two = (one_sweep(Path(tmp), args.trials, workers) for workers in (1, 2))
    result = {
        "trials": args.trials,
        "cores": os.cpu_count(),
        "one_worker": one,
        "two_workers": two,
        "trial_time_ratio": two["trial_s_mean"] / one["trial_s_mean"],
        "wall_ratio": two["wall_s"] / one["wall_s"],
    }
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for side in (one, two):
        print(f"{side['workers']} worker(s): sweep {side['wall_s']:.1f} s, trial mean {side['trial_s_mean']:.2f} s")
    ratios = f"trial time {result['trial_time_ratio']:.2f}x, sweep wall time {result['wall_ratio']:.2f}x"
    print(f"two workers / one: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
