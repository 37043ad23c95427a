"""Python function calls per group step of the batched executor on the flagship's models (a proxy for the
per-step host overhead that bounds a GPU step of small models; it counts the same on any machine).

Runs ``gpu_flagship.py --tiny`` (ResNet20 and its 25 %-width auxiliary, random-pixel CIFAR-10, 10 clients)
batched for 3 rounds of ``--local_steps`` steps on the CPU and counts, with cProfile, the Python calls made
inside the batched training of the groups (a group's set-up and first-step checks included, so few local
steps overstate the cost of a step).

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


def count(rounds: int, local_steps: int) -> dict:
    from fl_lightning import cli
    from fl_lightning.client import batched

    real_fit = cli.fit_from_argv

    def fit_with_more_steps(argv, **kwargs):  # the tiny flagship's 2 local steps -> local_steps
        at = argv.index("--training.local_steps")
        return real_fit([*argv[: at + 1], str(local_steps), *argv[at + 2 :]], **kwargs)

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
    cli.fit_from_argv = fit_with_more_steps
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_random_cifar10(Path(tmp) / "data", 200)
            result = run_flagship(Path(tmp) / "data", "32-true", "batched", rounds, True, Path(tmp) / "out")
    finally:
        batched._GroupTraining.run, batched._GroupTraining._step = real_run, real_step
        cli.fit_from_argv = real_fit
    calls = pstats.Stats(profile).total_calls
    return {"fits": result["fits"], "group_steps": steps[0], "python_calls": calls, "per_step": calls // steps[0]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local_steps", type=int, default=10)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print(json.dumps(count(args.rounds, args.local_steps), indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
