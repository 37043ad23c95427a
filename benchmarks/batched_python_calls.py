"""Python function calls per group step of the batched executor on the flagship's models (a proxy for the
per-step host overhead that bounds a GPU step of small models; it counts the same on any machine).

Runs ``gpu_flagship.py --tiny`` (ResNet20 and its 25 %-width auxiliary, random-pixel CIFAR-10, 10 clients)
batched for 3 rounds on the CPU and counts, with cProfile, the Python calls made inside the batched
training of the groups.

    python benchmarks/batched_python_calls.py --json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_flagship import run_flagship, write_random_cifar10


def count(rounds: int) -> dict:
    from fl_lightning.client import batched

    profile, steps = cProfile.Profile(), [0]
    real_run, real_step = batched._GroupTraining.run, batched._GroupTraining._step

    def run(self):
        profile.enable()
        try:
            return real_run(self)
        finally:
            profile.disable()

    def step(self, *args, **kwargs):
        steps[0] += 1
        return real_step(self, *args, **kwargs)

    batched._GroupTraining.run, batched._GroupTraining._step = run, step
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_random_cifar10(Path(tmp) / "data", 200)
            result = run_flagship(Path(tmp) / "data", "32-true", "batched", rounds, True, Path(tmp) / "out")
    finally:
        batched._GroupTraining.run, batched._GroupTraining._step = real_run, real_step
    calls = pstats.Stats(profile).total_calls
    return {"fits": result["fits"], "group_steps": steps[0], "python_calls": calls, "per_step": calls // steps[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print(json.dumps(count(args.rounds), indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
