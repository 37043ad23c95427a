"""Seconds per steady round of one process against two ranks (``flrun fit --runtime.devices 2``), same numbers.

The workload is ``benchmarks/overhead.py``'s digits CNN FedAvg case run through ``flrun fit``: 20 clients
with a Dirichlet(0.5) split, 10 per round, 20 local SGD steps (lr 0.05, momentum 0.9) of 16 examples, one
CPU thread per process. As in overhead.py the global model is evaluated once, after the last round: a
steady round is the difference of a ``--rounds`` and a ``--warmup`` run's round-loop seconds (summary.json
``wall_time_s``, which starts at the first round: imports, data and process start-up are excluded) over
their difference in rounds; the last round's evaluation and checkpoint are in both and cancel.
``evaluating_every_round`` repeats it with an evaluation after every round (timed from ``metrics.csv``'s
``time/elapsed_s``, the first ``--warmup`` rounds left out): the evaluation runs on every rank, a serial
part. ``identical`` compares the 1- and 2-rank runs' ``metrics.csv`` (elapsed seconds aside) and final
weights bit for bit.

    python benchmarks/ranks.py            # a table
    python benchmarks/ranks.py --json     # one JSON object: s_per_round_1, s_per_round_2, identical, ...
    python benchmarks/ranks.py --personal --json   # Standalone: 20 personal models evaluated every round

``--personal`` runs the same clients and training as Standalone (each client its own digits CNN) with
every client's model evaluated on the global test set after every round, the evaluation a personalized
method pays (each rank evaluates its share of the clients and the ranks exchange the scores); it reports
``evaluating_every_round`` only. ``--eval_batch_size 45`` splits the 360 test examples into 8 batches, which
ranks share when they evaluate a global model (a CIFAR test set is 20 batches of 512). ``--root DIR`` runs the
fl-lightning tree at DIR (e.g. an earlier commit from ``git archive``) with this script's workload.

On CPU each rank takes one core: run it on an otherwise idle machine with at least two cores (on a
shared one the times only bound the idle ones from above).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import yaml

from fl_lightning.run.checkpoint import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]

WORKLOAD = {
    "seed": 0,
    "data": {
        "class_path": "fl_lightning.data.DigitsData",
        "init_args": {
            "partitioner": {
                "class_path": "fl_lightning.data.DirichletPartitioner",
                "init_args": {"alpha": 0.5, "min_partition_size": 10},
            }
        },
    },
    "models": {"global": {"builder": "digits_cnn", "args": {}}},
    "population": {"num_clients": 20},
    "sampler": {"class_path": "fl_lightning.federation.sampling.UniformSampler", "init_args": {"num_per_round": 10}},
    "strategy": {"class_path": "fl_lightning.strategies.FedAvg"},
    "training": {
        "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.05, "momentum": 0.9}},
        "local_steps": 20,
        "batch_size": 16,
    },
    "runtime": {"accelerator": "cpu", "num_threads": 1, "progress": False},
}


def run(recipe: Path, output: Path, rounds: int, devices: int, eval_every: int = 1, root: Path = ROOT) -> None:
    command = [sys.executable, "-m", "fl_lightning", "fit", "--config", str(recipe), "--output_dir", str(output)]
    command += ["--rounds", str(rounds), "--checkpoint_every", str(rounds), "--runtime.devices", str(devices)]
    command += ["--eval_every", str(eval_every)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(command, cwd=root, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")


def rows(output: Path) -> list[dict[str, str]]:
    with open(output / "metrics.csv") as f:
        return list(csv.DictReader(f))


def steady_seconds(output: Path, warmup: int) -> float:
    """Seconds per round after the first ``warmup`` rounds, from the rounds' elapsed times."""
    elapsed = [float(row["time/elapsed_s"]) for row in rows(output)]
    return (elapsed[-1] - elapsed[warmup - 1]) / (len(elapsed) - warmup)


def wall_seconds(output: Path) -> float:
    """The run's round-loop seconds (summary.json: from the first round's start, imports and data excluded)."""
    return float(json.loads((output / "summary.json").read_text())["wall_time_s"])


def identical(one: Path, two: Path) -> bool:
    """The same metrics (elapsed seconds aside) and the same final server state, bit for bit."""

    def numbers(output: Path) -> list[dict[str, str]]:
        return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows(output)]

    if numbers(one) != numbers(two):
        return False
    first, second = (load_checkpoint(p / "checkpoints" / "last.ckpt")["strategy"] for p in (one, two))
    return _same(first, second)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=22, help="rounds of the long run (default 22)")
    parser.add_argument("--warmup", type=int, default=2, help="rounds of the short run, left out (default 2)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--personal", action="store_true", help="Standalone, every personal model evaluated each round")
    parser.add_argument("--root", type=Path, default=ROOT, help="the fl-lightning tree to run (default: this one)")
    parser.add_argument(
        "--eval_batch_size", type=int, default=512, help="test batch size (512: the 360 digits test examples in one)"
    )
    args = parser.parse_args()
    if not 1 <= args.warmup < args.rounds:
        parser.error("--warmup must be at least 1 and below --rounds")
    WORKLOAD["training"]["eval_batch_size"] = args.eval_batch_size
    if args.personal:
        print(
            json.dumps(personal(args.rounds, args.warmup, args.root.resolve())) if args.json else personal_table(args)
        )
        return
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        recipe = scratch / "digits_cnn_fedavg.yaml"
        recipe.write_text(yaml.safe_dump(WORKLOAD))
        # overhead.py's workload evaluates once, after the last round: a steady round is the difference of a
        # long and a short run's round-loop time over their difference in rounds (the final evaluation and
        # checkpoint, in both, cancel)
        steady = {}
        for devices in (1, 2):
            for rounds in (args.warmup, args.rounds):
                run(recipe, scratch / f"end{devices}_{rounds}", rounds, devices, rounds, args.root.resolve())
            long, short = (wall_seconds(scratch / f"end{devices}_{r}") for r in (args.rounds, args.warmup))
            steady[devices] = (long - short) / (args.rounds - args.warmup)
        # the same with an evaluation after every round (it runs on every rank: a serial part)
        for devices in (1, 2):
            run(recipe, scratch / f"devices{devices}", args.rounds, devices, root=args.root.resolve())
        one, two = (steady_seconds(scratch / f"devices{d}", args.warmup) for d in (1, 2))
        result = {
            "s_per_round_1": steady[1],
            "s_per_round_2": steady[2],
            "speedup": steady[1] / steady[2],
            "identical": identical(scratch / f"end1_{args.rounds}", scratch / f"end2_{args.rounds}")
            and identical(scratch / "devices1", scratch / "devices2"),
            "evaluating_every_round": {"s_per_round_1": one, "s_per_round_2": two, "speedup": one / two},
            "rounds": args.rounds,
            "warmup_rounds": args.warmup,
            "eval_batch_size": args.eval_batch_size,
            "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        }
    if args.json:
        print(json.dumps(result))
        return
    print(f"digits CNN FedAvg, {args.rounds} rounds, the first {args.warmup} left out, one CPU thread per rank")
    print(f"  1 process : {steady[1]:.3f} s per round ({one:.3f} evaluating every round)")
    print(f"  2 ranks   : {steady[2]:.3f} s per round ({result['speedup']:.2f}x; {two:.3f}, {one / two:.2f}x)")
    print(f"  identical : {result['identical']}")


def personal(rounds: int, warmup: int, root: Path) -> dict:
    """Standalone on the workload's clients, every client's model evaluated on the test set every round."""
    workload = {**WORKLOAD, "strategy": {"class_path": "fl_lightning.strategies.Standalone"}}
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        recipe = scratch / "digits_cnn_standalone.yaml"
        recipe.write_text(yaml.safe_dump(workload))
        for devices in (1, 2):
            run(recipe, scratch / f"devices{devices}", rounds, devices, root=root)
        one, two = (steady_seconds(scratch / f"devices{d}", warmup) for d in (1, 2))
        return {
            "workload": "standalone, 20 personal digits CNNs evaluated every round",
            "evaluating_every_round": {"s_per_round_1": one, "s_per_round_2": two, "speedup": one / two},
            "identical": identical(scratch / "devices1", scratch / "devices2"),
            "rounds": rounds,
            "warmup_rounds": warmup,
            "eval_batch_size": WORKLOAD["training"]["eval_batch_size"],
            "root": str(root),
        }


def personal_table(args: argparse.Namespace) -> str:
    result = personal(args.rounds, args.warmup, args.root.resolve())
    timed = result["evaluating_every_round"]
    return (
        f"{result['workload']}, {args.rounds} rounds, the first {args.warmup} left out, one CPU thread per rank\n"
        f"  1 process : {timed['s_per_round_1']:.3f} s per round\n"
        f"  2 ranks   : {timed['s_per_round_2']:.3f} s per round ({timed['speedup']:.2f}x)\n"
        f"  identical : {result['identical']}"
    )


if __name__ == "__main__":
    main()
