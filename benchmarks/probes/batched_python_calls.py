"""Python function calls per local step of the batched executor on the flagship's models, next to the
sequential loop's (a proxy for the per-step host overhead that bounds a GPU step of small models; it
counts the same on any machine).

Runs ``gpu_flagship.py --tiny`` (ResNet20 and its 25 %-width auxiliary, random-pixel CIFAR-10, 10 clients)
for 3 rounds of ``--local_steps`` steps on the CPU, once batched and once sequentially, and counts with
cProfile the Python calls made:

- ``per_step``: inside the batched training of the groups, per group step (set-up and first-step checks
  included, so few local steps overstate the cost of a step);
- ``per_shared_step`` / ``per_lone_step``: inside a group step after the first, of several clients (one
  vmapped call) / of one client (plain autograd on its rows), the step alone;
- ``per_sequential_step``: inside the sequential loop's ``run_steps``, per step (the same fits);
- ``per_replayed_step``: a third run, sequential with ``runtime.cuda_graphs``, counted inside its fits without
  the steps that ran eagerly (a key's first step, a fit's first step without momenta): what the host does
  around one replay, with each fit's key (a walk over the module and its teacher) and its ``module.train()``
  spread over its ``--local_steps`` steps. A counting stand-in replaces CUDA's
  ``graph.replay()`` (one call, as on a GPU).

    python benchmarks/probes/batched_python_calls.py --json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_flagship import run_flagship, write_random_cifar10


def _calls(profile: cProfile.Profile, steps: int) -> int | None:
    return pstats.Stats(profile).total_calls // steps if steps else None


def count(rounds: int, local_steps: int) -> dict:
    from fl_lightning.cli import commands as cli
    from fl_lightning.client import graphs, loop
    from fl_lightning.client.batched import group_training
    from fl_lightning.client.graphs import capture

    real_fit = cli.fit_from_argv

    def fit_with_more_steps(argv, **kwargs):  # the tiny flagship's 2 local steps -> local_steps
        at = argv.index("--training.local_steps")
        return real_fit([*argv[: at + 1], str(local_steps), *argv[at + 2 :]], **kwargs)

    profiles = {kind: cProfile.Profile() for kind in ("group", "shared", "lone", "sequential", "replayed")}
    steps = dict.fromkeys(profiles, 0)
    real_run, real_step = group_training.GroupTraining.run, group_training.GroupTraining._step
    real_run_steps = loop.LocalLoop.run_steps

    def run(self):
        profiles["group"].enable()
        try:
            return real_run(self)
        finally:
            profiles["group"].disable()

    def step(self, members, batch, index):
        steps["group"] += 1
        kind = None if index == 0 else "lone" if len(members) == 1 else "shared"
        if kind is None:
            return real_step(self, members, batch, index)
        steps[kind] += 1
        profiles["group"].disable()  # one profiler at a time
        profiles[kind].enable()
        try:
            return real_step(self, members, batch, index)
        finally:
            profiles[kind].disable()
            profiles["group"].enable()

    def run_steps(self, module, optimizer, batches, step_fn=None, clip=None, on_record=None):
        batches = list(batches)  # drawn before the count: the batched side's step receives its batch drawn too
        steps["sequential"] += len(batches)
        profiles["sequential"].enable()
        try:
            return real_run_steps(self, module, optimizer, batches, step_fn, clip, on_record)
        finally:
            profiles["sequential"].disable()

    real_graphed_fit, real_eager_step = graphs.StepGraphs.run_steps, capture._step
    real_run_and_capture, real_backend = graphs.StepGraphs._run_and_capture, graphs.backend_for

    def graphed_fit(self, module, optimizer, batches, step_fn, clip, on_record):
        batches = list(batches)
        profiles["replayed"].enable()
        try:
            return real_graphed_fit(self, module, optimizer, batches, step_fn, clip, on_record)
        finally:
            profiles["replayed"].disable()

    def uncounted(function):  # eager steps are not replays: left out of the count
        def call(*args, **kwargs):
            profiles["replayed"].disable()
            try:
                return function(*args, **kwargs)
            finally:
                profiles["replayed"].enable()

        return call

    group_training.GroupTraining.run, group_training.GroupTraining._step = run, step
    loop.LocalLoop.run_steps = run_steps
    cli.fit_from_argv = fit_with_more_steps
    graphs.StepGraphs.run_steps, capture._step = graphed_fit, uncounted(real_eager_step)
    graphs.StepGraphs._run_and_capture, graphs.backend_for = (
        uncounted(real_run_and_capture),
        lambda device: _CountingGraphs(device),
    )
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_random_cifar10(Path(tmp) / "data", 200)
            result = run_flagship(Path(tmp) / "data", "32-true", "batched", rounds, True, Path(tmp) / "out")
            run_flagship(Path(tmp) / "data", "32-true", "sequential", rounds, True, Path(tmp) / "out_sequential")
            graphed = run_flagship(Path(tmp) / "data", "32-true", "graphs", rounds, True, Path(tmp) / "out_graphs")
    finally:
        group_training.GroupTraining.run, group_training.GroupTraining._step = real_run, real_step
        loop.LocalLoop.run_steps = real_run_steps
        cli.fit_from_argv = real_fit
        graphs.StepGraphs.run_steps, capture._step = real_graphed_fit, real_eager_step
        graphs.StepGraphs._run_and_capture, graphs.backend_for = real_run_and_capture, real_backend
    group_calls = sum(pstats.Stats(profiles[kind]).total_calls for kind in ("group", "shared", "lone"))
    return {
        "fits": result["fits"],
        "group_steps": steps["group"],
        "python_calls": group_calls,
        "per_step": group_calls // steps["group"],
        "shared_steps": steps["shared"],
        "per_shared_step": _calls(profiles["shared"], steps["shared"]),
        "lone_steps": steps["lone"],
        "per_lone_step": _calls(profiles["lone"], steps["lone"]),
        "sequential_steps": steps["sequential"],
        "per_sequential_step": _calls(profiles["sequential"], steps["sequential"]),
        "graphs": graphed["fits"],
        "per_replayed_step": _calls(profiles["replayed"], graphed["fits"]["graphed_steps"]),
    }


class _CountingGraphs:
    """CUDA graphs' Python side without CUDA: a capture runs the step's Python once (it does on a GPU too),
    a replay is one call that hands back the capture's outputs (the numbers are not the point here)."""

    def __init__(self, device):
        self.device = device

    def warm_up(self):
        import contextlib

        return contextlib.nullcontext()

    def capture(self, body):
        outputs = body()
        return types.SimpleNamespace(replay=lambda: outputs)


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
