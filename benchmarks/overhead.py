"""Overhead of fl-lightning against hand-written PyTorch loops doing the same FedAvg work.

Two hand-written loops, each timed in its own process (so peak memory, max RSS, is measured per side):

- ``minimal``: the loop a user would write. One seed at the start, one torch generator for the batch
  order, float32 sample-weighted averaging, no loss bookkeeping. It is fed the same work as
  fl-lightning: the same model and initial weights, the same clients each round (drawn before the clock
  starts) and batches of the same sizes: each pass over a client's examples is a fresh permutation
  whose last batch may be partial, as fl-lightning's ``batch_stream`` (which every recipe uses) does, so
  both sides train on the same number of examples (checked). The batch order differs, so losses differ.
- ``mirror``: the earlier baseline, which repeats fl-lightning's own per-(round, client) seeding,
  float64 averaging and per-step loss bookkeeping, so both sides take bit-identical steps (the script
  fails unless the per-round mean losses agree). It isolates the framework's plumbing (ledger, payloads,
  strategy hooks, files) but hides the cost of the work the framework chooses to do.

    python benchmarks/overhead.py                       # digits MLP, digits CNN and ResNet20: a table
    python benchmarks/overhead.py --model resnet20 --rounds 2
    python benchmarks/overhead.py --counts             # calls per step instead of seconds (busy machines)
    python benchmarks/overhead.py --counts --per_fit --model resnet20   # per step and per client fit apart

The ResNet20 case feeds random 32x32 images (a timing workload only: no accuracy is claimed on it).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import resource
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F

from fl_lightning.client.loop import LocalLoop, LocalTraining, role_seed
from fl_lightning.data import DataArrays, DigitsData, DirichletPartitioner, FederatedData
from fl_lightning.federation.population import Population
from fl_lightning.federation.sampling import UniformSampler
from fl_lightning.federation.seeding import SERVER_STREAM, derive_seed
from fl_lightning.models import ModelSpec
from fl_lightning.run.options import RoundPlan, RunOutput
from fl_lightning.run.orchestrator import FederationOrchestrator
from fl_lightning.run.runtime import Runtime
from fl_lightning.strategies import FedAvg
from fl_lightning.tracking import RunFiles, RunLogger

CASES = {
    # name: (builder args, data, clients, clients per round, local steps, batch size)
    "digits_cnn": ({"builder": "digits_cnn", "args": {}}, "digits", 20, 10, 20, 16),
    "digits_mlp": ({"builder": "digits_mlp", "args": {}}, "digits", 20, 10, 20, 16),
    "resnet20": ({"builder": "resnet20", "args": {}}, "random32", 8, 4, 5, 32),
}


class Probe:
    """The measured part of a worker: its wall time, and with ``--counts`` (``Probe.counting``) the Python
    function calls (cProfile) and torch operator calls (torch.profiler, nested ones included) in it, which
    do not depend on how busy the machine is."""

    counting = False

    def start(self) -> Probe:
        self.result: dict = {}
        if Probe.counting:
            self.ops = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.ops.__enter__()
            self.python = cProfile.Profile()
            self.python.enable()
        self.began = time.perf_counter()
        return self

    def stop(self) -> None:
        self.result["time_s"] = time.perf_counter() - self.began
        if Probe.counting:
            self.python.disable()
            self.ops.__exit__(None, None, None)
            self.result["python_calls"] = sum(calls for _, calls, *_ in pstats.Stats(self.python).stats.values())
            self.result["torch_ops"] = sum(event.count for event in self.ops.key_averages())


class RandomImages(FederatedData):
    """Random 32x32 RGB tensors with random labels: a ResNet20-sized timing workload."""

    def load(self) -> DataArrays:
        g = torch.Generator().manual_seed(0)
        x, y = torch.randn(2000, 3, 32, 32, generator=g), torch.randint(0, 10, (2000,), generator=g)
        return DataArrays(x, y, x[:200], y[:200], num_classes=10)


def make_data(kind: str) -> FederatedData:
    partitioner = DirichletPartitioner(alpha=0.5, min_partition_size=10)
    return DigitsData(partitioner=partitioner) if kind == "digits" else RandomImages(partitioner=partitioner)


class LossRecorder(RunLogger):
    def __init__(self):
        self.losses = []

    def log_metrics(self, metrics, step):
        self.losses.append(metrics["train/loss"])


def run_framework(case: str, rounds: int, seed: int, threads: int) -> dict:
    spec, kind, num_clients, per_round, steps, batch = CASES[case]
    fabric = Runtime(accelerator="cpu", num_threads=threads, progress=False).apply()
    population = Population(num_clients=num_clients)
    clients = population.build(seed)
    data = make_data(kind)
    data.setup(num_clients, seed)
    training = LocalTraining(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), local_steps=steps, batch_size=batch
    )
    loop = LocalLoop(fabric, training, rounds)
    loop.build_slots({"global": ModelSpec(**spec)}, ["global"], seed, num_classes=10, in_channels=int(data.x.shape[1]))
    recorder = LossRecorder()
    with tempfile.TemporaryDirectory() as tmp:
        orchestrator = FederationOrchestrator(
            strategy=FedAvg(),
            clients=clients,
            sampler=UniformSampler(num_per_round=per_round),
            loop=loop,
            data=data,
            seed=seed,
            plan=RoundPlan(rounds, eval_every=rounds, checkpoint_every=rounds),
            output=RunOutput(RunFiles(tmp), [recorder], progress=False),
        )
        probe = Probe().start()
        summary = orchestrator.run_rounds()
        probe.stop()
    return {"losses": recorder.losses, **probe.result, "acc": summary["final"]["global/test_acc"]}


def examples_seen(num_examples: int, batch: int, steps: int) -> int:
    """Examples in ``steps`` batches of passes over ``num_examples`` whose last batch may be partial."""
    per_pass = -(-num_examples // batch)
    full, rest = divmod(steps, per_pass)
    return full * num_examples + min(rest * batch, num_examples)


def sampled_clients(case: str, rounds: int, seed: int, num_examples: list[int]) -> tuple[list[list[int]], int]:
    """fl-lightning's clients of every round, and the examples its steps see (``examples_seen`` each)."""
    _, _, num_clients, per_round, steps, batch = CASES[case]
    schedule = []
    for rnd in range(1, rounds + 1):
        rng = np.random.default_rng(derive_seed(seed, rnd, SERVER_STREAM, 2))
        schedule.append(np.sort(rng.choice(num_clients, per_round, replace=False)).tolist())
    return schedule, sum(examples_seen(num_examples[c], batch, steps) for chosen in schedule for c in chosen)


def run_minimal(case: str, rounds: int, seed: int, threads: int) -> dict:
    """The loop a user would write: seeded once, float32 averaging, no loss bookkeeping, the same batch sizes."""
    spec, kind, num_clients, _, steps, batch = CASES[case]
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    data = make_data(kind)
    data.setup(num_clients, seed)
    torch.manual_seed(role_seed(seed, "global"))  # the same initial weights as fl-lightning's "global" role
    model = ModelSpec(**spec).build(num_classes=10, in_channels=int(data.x.shape[1]))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    train = [data.clients[c].train for c in range(num_clients)]
    schedule, expected = sampled_clients(case, rounds, seed, [len(idx) for idx in train])
    x, y = data.x, data.y
    generator = torch.Generator().manual_seed(seed)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    seen = 0
    probe = Probe().start()
    for chosen in schedule:
        sums, total = None, 0
        for cid in chosen:
            model.load_state_dict(global_state)
            optimizer.state.clear()
            model.train()
            idx, done = train[cid], 0
            while done < steps:
                order = idx[torch.randperm(len(idx), generator=generator)]
                for s in range(0, len(idx), batch):
                    if done == steps:
                        break
                    b = order[s : s + batch]
                    optimizer.zero_grad()
                    F.cross_entropy(model(x[b]), y[b]).backward()
                    optimizer.step()
                    seen += len(b)
                    done += 1
            with torch.no_grad():
                state = model.state_dict()
                if sums is None:
                    sums = {k: v * len(idx) if v.is_floating_point() else v.clone() for k, v in state.items()}
                else:
                    for k, v in state.items():
                        if v.is_floating_point():
                            sums[k].add_(v, alpha=len(idx))
            total += len(idx)
        global_state = {k: v / total if v.is_floating_point() else v for k, v in sums.items()}
    model.load_state_dict(global_state)
    model.eval()
    with torch.no_grad():
        acc = (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
    probe.stop()
    if seen != expected:
        raise SystemExit(f"the minimal loop saw {seen} examples, fl-lightning's batches {expected}")
    return {"losses": [], **probe.result, "acc": acc, "examples": seen}


def run_hand_written(case: str, rounds: int, seed: int, threads: int) -> dict:
    """The mirror: fl-lightning's seeding, float64 average and loss bookkeeping written out by hand."""
    spec, kind, num_clients, per_round, steps, batch = CASES[case]
    torch.set_num_threads(threads)
    torch.set_flush_denormal(True)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False  # as fl-lightning's Runtime
    data = make_data(kind)
    data.setup(num_clients, seed)
    torch.manual_seed(role_seed(seed, "global"))
    model = ModelSpec(**spec).build(num_classes=10, in_channels=int(data.x.shape[1]))
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    probe = Probe().start()
    for rnd in range(1, rounds + 1):
        rng = np.random.default_rng(derive_seed(seed, rnd, SERVER_STREAM, 2))
        chosen = np.sort(rng.choice(num_clients, per_round, replace=False))
        sums, total_weight, round_losses = None, 0.0, []
        for cid in chosen:
            torch.default_generator.manual_seed(derive_seed(seed, rnd, int(cid), 0))
            generator = torch.Generator().manual_seed(derive_seed(seed, rnd, int(cid), 1))
            model.load_state_dict(global_state)
            optimizer.state.clear()
            model.train()
            idx = data.clients[cid].train
            loss_sum, done = torch.zeros(()), 0
            while done < steps:
                order = idx[torch.randperm(len(idx), generator=generator)]
                for s in range(0, len(idx), batch):
                    if done == steps:
                        break
                    chosen_idx = order[s : s + batch]
                    optimizer.zero_grad(set_to_none=True)
                    loss = F.cross_entropy(model(data.x[chosen_idx]), data.y[chosen_idx])
                    loss.backward()
                    optimizer.step()
                    loss_sum += loss.detach()
                    done += 1
            round_losses.append((loss_sum / steps).item())
            weight = float(len(idx))
            state = model.state_dict()
            if sums is None:
                sums = {k: v.detach().double() * weight for k, v in state.items()}
            else:
                for k, v in state.items():
                    sums[k].add_(v.detach().double(), alpha=weight)
            total_weight += weight
        global_state = {
            k: (s / total_weight).to(global_state[k].dtype)
            if global_state[k].is_floating_point()
            else (s / total_weight).round().to(global_state[k].dtype)
            for k, s in sums.items()
        }
        losses.append(float(np.mean(round_losses)))
    model.load_state_dict(global_state)
    model.eval()
    with torch.no_grad():
        acc = (model(data.test_x).argmax(1) == data.test_y).float().mean().item()
    probe.stop()
    return {"losses": losses, **probe.result, "acc": acc}


def measure(
    side: str, case: str, rounds: int, seed: int, threads: int, counts: bool = False, local_steps: int | None = None
) -> dict:
    command = [
        sys.executable,
        __file__,
        "--worker",
        side,
        "--model",
        case,
        "--rounds",
        str(rounds),
        "--seed",
        str(seed),
        "--threads",
        str(threads),
        *(["--counts"] if counts else []),
        *(["--local_steps", str(local_steps)] if local_steps else []),
    ]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=list(CASES), action="append")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default: 30 digits, 2 resnet20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per side; the best time counts")
    parser.add_argument(
        "--counts",
        action="store_true",
        help="instead of timing: Python function calls and torch operator calls per training step of each side "
        "(cProfile, torch.profiler), which a busy machine does not change",
    )
    parser.add_argument(
        "--per_fit",
        action="store_true",
        help="with --counts: run each side at the case's local steps and at 3x, and split the counts into per step "
        "(the difference) and per client fit (the rest: loading, uploading, checking and averaging its weights)",
    )
    parser.add_argument("--local_steps", type=int, help=argparse.SUPPRESS)  # set by --per_fit for its workers
    parser.add_argument("--worker", choices=list(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    Probe.counting = args.counts
    if args.counts and not args.worker:
        (print_counts_per_fit if args.per_fit else print_counts)(args)
        return
    if args.worker:
        if args.local_steps:
            spec, kind, clients, per_round, _, batch = CASES[args.model[0]]
            CASES[args.model[0]] = (spec, kind, clients, per_round, args.local_steps, batch)
        result = WORKERS[args.worker](args.model[0], args.rounds, args.seed, args.threads)
        result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(result))
        return
    print(
        "| model | rounds | minimal s | mirror s | fl-lightning s | fl / minimal | fl / mirror | mirror loss diff | "
        "acc minimal / fl | peak RSS minimal / fl (MB) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for case in args.model or ["digits_mlp", "digits_cnn", "resnet20"]:
        rounds = args.rounds or (2 if case == "resnet20" else 30)
        runs: dict[str, list[dict]] = {side: [] for side in ("minimal", "hand", "framework")}
        for _ in range(args.repeats):  # alternate so every side sees the same machine load
            for side, results in runs.items():
                results.append(measure(side, case, rounds, args.seed, args.threads))
        minimal, hand, framework = (runs[side] for side in ("minimal", "hand", "framework"))
        diff = max(abs(a - b) for a, b in zip(hand[0]["losses"], framework[0]["losses"]))
        t_min, t_hand, t_fl = (min(r["time_s"] for r in runs[side]) for side in ("minimal", "hand", "framework"))
        print(
            f"| {case} | {rounds} | {t_min:.3f} | {t_hand:.3f} | {t_fl:.3f} | {t_fl / t_min:.3f} | "
            f"{t_fl / t_hand:.3f} | {diff:.2e} | {minimal[0]['acc']:.3f} / {framework[0]['acc']:.3f} | "
            f"{minimal[0]['max_rss_mb']:.0f} / {framework[0]['max_rss_mb']:.0f} |",
            flush=True,
        )
        if diff > 1e-4:
            raise SystemExit(f"losses differ by {diff:.2e}: the mirror and fl-lightning did not run the same steps")


def print_counts(args: argparse.Namespace) -> None:
    """One run per side and model, each counted in its own process: calls per local training step."""
    print("| model | steps | Python calls per step minimal / mirror / fl | torch ops per step minimal / mirror / fl |")
    print("|---|---|---|---|")
    for case in args.model or ["digits_mlp", "digits_cnn", "resnet20"]:
        rounds = args.rounds or (2 if case == "resnet20" else 30)
        _, _, _, per_round, steps, _ = CASES[case]
        total = rounds * per_round * steps
        runs = {side: measure(side, case, rounds, args.seed, args.threads, counts=True) for side in WORKERS}
        python = " / ".join(f"{runs[side]['python_calls'] / total:.1f}" for side in ("minimal", "hand", "framework"))
        ops = " / ".join(f"{runs[side]['torch_ops'] / total:.1f}" for side in ("minimal", "hand", "framework"))
        print(f"| {case} | {total:,} | {python} | {ops} |", flush=True)


def print_counts_per_fit(args: argparse.Namespace) -> None:
    """Counts at the case's local steps and at three times as many: per step, and per client fit (with its share
    of the round and of the run's end: evaluation, checkpoint), the part a GPU pays as kernel launches once per
    client however long it trains. Digits runs 5 rounds and ResNet20 2 unless --rounds says otherwise."""
    print(
        "| model | per step: Python calls minimal / fl | torch ops minimal / fl | per client fit: Python calls "
        "minimal / fl | torch ops minimal / fl |"
    )
    print("|---|---|---|---|---|")
    for case in args.model or ["digits_cnn", "resnet20"]:
        # few rounds: the profiler keeps every event (30 digits rounds at 3x the steps took ~20 GB)
        rounds = args.rounds or (2 if case == "resnet20" else 5)
        _, _, _, per_round, steps, _ = CASES[case]
        fits = rounds * per_round
        runs = {
            (side, n): measure(side, case, rounds, args.seed, args.threads, counts=True, local_steps=n)
            for side in ("minimal", "framework")
            for n in (steps, 3 * steps)
        }
        cells = []
        for part in ("step", "fit"):
            for key in ("python_calls", "torch_ops"):
                values = []
                for side in ("minimal", "framework"):
                    per_step = (runs[side, 3 * steps][key] - runs[side, steps][key]) / (2 * steps * fits)
                    values.append(per_step if part == "step" else runs[side, steps][key] / fits - steps * per_step)
                cells.append(" / ".join(f"{v:,.0f}" for v in values))
        print(f"| {case} | {' | '.join(cells)} |", flush=True)


WORKERS = {"minimal": run_minimal, "hand": run_hand_written, "framework": run_framework}


if __name__ == "__main__":
    main()
