"""What fl-lightning does per client outside the SGD steps, piece by piece, at pfl-research's ``simple_cnn`` size.

Times, on the weights of the peer benchmark's model (1,626,442 float32 parameters, benchmarks/peer_pfl.py), one
thread, the pieces alternating for ``--repeats`` rounds: the non-finite check of an upload
(``run/robustness.all_finite``), the running float64 average (``WeightedAverage.add``), the upload copy
(``ModelWeights.part(copy=True)``), and as references what a minimal loop pays: ``isfinite().all()`` per tensor
and a float32 ``add_`` per tensor. Reports the median and the 10th percentile of the CPU time (process time,
which a shared machine inflates less than wall time) in milliseconds.

    python benchmarks/probes/per_client_cost.py
    PYTHONPATH=/other/checkout python benchmarks/probes/per_client_cost.py   # the same pieces of another tree
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from fl_lightning.federation.types import ModelWeights
from fl_lightning.knowledge import WeightedAverage
from fl_lightning.run.robustness import all_finite

# after fl_lightning: the model's module puts this checkout first on the path, and PYTHONPATH's tree must win
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from peer_pfl import simple_cnn


def pieces() -> dict:
    torch.manual_seed(0)
    state = {k: v.detach().clone() for k, v in simple_cnn().state_dict().items()}
    tensors, keys = list(state.values()), list(state)
    average = WeightedAverage()
    average.add(state, 50.0)
    sums = [t.clone() for t in tensors]
    return {
        "all_finite": lambda: all_finite(tensors),
        "WeightedAverage.add": lambda: average.add(state, 50.0),
        "upload copy": lambda: ModelWeights.part("global", state, keys, copy=True),
        "reference: isfinite().all() per tensor": lambda: all(bool(t.isfinite().all()) for t in tensors),
        "reference: float32 add_ per tensor": lambda: torch._foreach_add_(sums, tensors, alpha=50.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    timed = pieces()
    seconds: dict[str, list[float]] = {name: [] for name in timed}
    for _ in range(args.repeats):  # alternating, so that the machine's load falls on every piece alike
        for name, piece in timed.items():
            began = time.process_time()
            piece()
            seconds[name].append(time.process_time() - began)
    result = {
        name: {
            "median_ms": 1e3 * statistics.median(values),
            "p10_ms": 1e3 * statistics.quantiles(values, n=10)[0],
        }
        for name, values in seconds.items()
    }
    if args.json:
        print(json.dumps(result))
        return
    print("| piece | median ms | 10th percentile ms |\n|---|---|---|")
    for name, row in result.items():
        print(f"| {name} | {row['median_ms']:.3f} | {row['p10_ms']:.3f} |")


if __name__ == "__main__":
    main()
