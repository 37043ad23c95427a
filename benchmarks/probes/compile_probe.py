"""Probe: the batched executor's vmapped gradient step under ``torch.compile``, against the eager executor.

Not an option of the framework (benchmarks/results/log.md, "CUDA graphs and torch.compile": tried, not kept).
This script swaps ``GroupTraining._gradients`` for a compiled version and runs the flagship recipe
(``recipes/ondevice_kd_cifar10.yaml``, random-pixel CIFAR-10 in the real pickle format, batched executor,
``shared_per_phase``) shrunk to ``--clients`` clients, 8 per round, with and without it. Per mode it prints
the seconds of each round, how many vmapped steps ran compiled or eagerly, the groups whose compilation
failed (and why), and the final test metrics.

    python benchmarks/probes/compile_probe.py --rounds 3 --local_steps 16 --per_batch 2000       # CPU
    python benchmarks/probes/compile_probe.py --accelerator cuda --mode default reduce-overhead  # a GPU session

What is compiled: one function from (the group's step function, stacked weights, buffers and batch) to
every client's gradients and (loss, record). Floats the step function closes over (on-device KD's ramped
KD weight) go in as 0-d tensors, so that a new round does not recompile; a group whose tracing fails
runs eagerly from then on.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from gpu_flagship import RoundClock, write_random_cifar10

from fl_lightning.client.batched import group_training, step_closures


class CompiledGradients:
    """``GroupTraining._gradients`` compiled (see the module docstring), with counts of what ran how."""

    def __init__(self, mode: str):
        self.function = torch.compile(_vmapped_gradients, mode=None if mode == "default" else mode, fullgraph=True)
        self.failed: dict[str, str] = {}
        self.counts = {"compiled_steps": 0, "eager_steps": 0}
        self.eager = group_training.GroupTraining._gradients

    def __call__(self, training, params, frozen, buffers, cells, batch, unbatched=False):
        step_fn = training.group[0].step_fn
        key = f"{training.role}/{getattr(step_fn, '__name__', 'step')}"
        if training.tensor_cells or key in self.failed or unbatched:  # a lone client's step runs without vmap
            self.counts["eager_steps"] += 1
            return self.eager(training, params, frozen, buffers, cells, batch, unbatched)
        values = step_closures.closure_values(step_fn)
        if any(type(v) is float for v in values):
            device = training.loop.fabric.device
            lifted = [torch.tensor(v, dtype=torch.float64, device=device) if type(v) is float else v for v in values]
            step_fn = step_closures.rebuild(step_fn, lifted)
        from torch._dynamo import config, exc

        try:
            with config.patch(recompile_limit=64, accumulated_recompile_limit=256):
                result = self.function(training, step_fn, params, frozen, buffers, batch, training.step_index)
        except exc.Unsupported as err:
            self.failed[key] = str(err).splitlines()[0] + " " + _detail(str(err))
            self.counts["eager_steps"] += 1
            return self.eager(training, params, frozen, buffers, cells, batch)
        self.counts["compiled_steps"] += 1
        return result


def _detail(message: str) -> str:
    marker = "raised exception "
    return message[message.find(marker) : message.find(marker) + 120] if marker in message else ""


def _vmapped_gradients(training, step_fn, params, frozen, buffers, batch, step):
    def loss(params, frozen, buffers, batch):
        store = training.store
        tensors = {**store.split("params", params), **store.split("frozen", frozen), **buffers}
        return training.loss_of(step_fn, tensors, batch, step)

    compute = torch.func.grad_and_value(loss, has_aux=True)
    return torch.func.vmap(compute, randomness="error")(params, frozen, buffers, batch)


def run(mode: str, args, data_dir: Path, out: Path) -> dict:
    from fl_lightning.cli.commands import fit_from_argv

    eager = group_training.GroupTraining._gradients
    probe = None
    if mode != "eager":
        probe = CompiledGradients(mode)
        group_training.GroupTraining._gradients = lambda self, *a, **k: probe(self, *a, **k)
    tiers = f"[{{name: strong, roles: [aux, target], count: {args.clients // 2}}}, {{name: weak, roles: [aux]}}]"
    argv = ["--config", str(ROOT / "recipes" / "ondevice_kd_cifar10.yaml"), "--rounds", str(args.rounds)]
    argv += ["--eval_every", str(args.rounds), "--checkpoint_every", str(args.rounds), "--runtime.progress", "false"]
    argv += ["--output_dir", str(out), "--data.init_args.data_dir", str(data_dir), "--data.init_args.download", "false"]
    argv += ["--runtime.executor", "batched", "--training.optimizer_state", "shared_per_phase"]
    argv += ["--population.num_clients", str(args.clients), "--population.tiers", tiers]
    argv += ["--sampler.init_args.num_per_round", str(min(8, args.clients))]
    argv += ["--training.local_steps", str(args.local_steps), "--runtime.accelerator", args.accelerator]
    clock = RoundClock()
    try:
        summary = fit_from_argv(argv, extra_loggers=[clock])
    finally:
        group_training.GroupTraining._gradients = eager
    return {
        "mode": mode,
        "round_s": [round(s, 2) for s in np.diff(clock.stamps)],
        "counts": probe.counts if probe else None,
        "failed": probe.failed if probe else None,
        "final": {k: round(v, 5) for k, v in summary["final"].items() if "loss" in k},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", nargs="+", default=["default"], help="torch.compile modes to probe")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--local_steps", type=int, default=16)
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--per_batch", type=int, default=2000, help="examples per CIFAR-10 batch file (6 files)")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()
    if args.accelerator == "cpu":
        torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        write_random_cifar10(data_dir, args.per_batch)
        for mode in ["eager", *args.mode]:
            start = time.perf_counter()
            result = run(mode, args, data_dir, Path(tmp) / f"run-{mode}")
            result["total_s"] = round(time.perf_counter() - start, 1)
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
