"""fl-lightning next to a minimal PyTorch loop (and pfl-research, when installed) on pfl-research's own benchmark.

The workload is pfl-research's published CIFAR-10 image-classification benchmark (apple/pfl-research,
``benchmarks/image_classification/configs/baseline.yaml``): its ``simple_cnn`` with dropout
(``benchmarks/model/pytorch/cnn.py``: conv 3->32 3x3, ReLU, conv 32->64 3x3, ReLU, max-pool 2, dropout 0.25,
flatten, linear 12544->128, ReLU, dropout 0.5, linear 128->10, Glorot-uniform weights; 1,626,442 parameters),
CIFAR-10 split IID over 1,000 clients of 50 images, 50 clients a round, local SGD at learning rate 0.1 in batches
of 10 for one epoch (5 steps), FedAvg with the server's learning rate 1.0 (the plain mean; every client has 50
images, so weighting by images or by client is the same). The images are random pixels in CIFAR-10's pickle
layout, written by this script: a timing workload, no accuracy is claimed on it.

Each side runs in its own process with one thread, the sides alternate ``--repeats`` times, and each reports its
median seconds per steady round (rounds 2 .. N-1: the first pays first-call costs, the last evaluates), wall and
CPU (the process's own time: on a machine shared with other work it moves far less than the wall time; on an
idle one the two agree); the table gives the best of the repeats:

- ``minimal``: the loop a user would write: one seed, one optimizer, load the global weights, 5 SGD steps over a
  fresh permutation of the client's 50 images, a float32 sum of the clients' weights, the mean. The same model,
  initial weights, data and clients each round as fl-lightning.
- ``fl-lightning``: ``flrun fit`` of the same recipe, ``runtime.executor`` sequential (and ``batched`` with
  ``--executor sequential batched``).
- ``pfl-research``: pfl's own simulation (``SimulatedBackend``, ``FederatedAveraging``, ``PyTorchModel``) of the
  model above on the same arrays, when ``import pfl`` works; skipped with a line saying so otherwise. pfl keeps
  images channels-last, as its benchmark does, and its model starts with the transpose its benchmark has.

    python benchmarks/peer_pfl.py                              # 1,000 clients, 50 a round, 6 rounds, 3 alternations
    python benchmarks/peer_pfl.py --clients_per_round 200      # the cost as the cohort grows
    python benchmarks/peer_pfl.py --executor sequential batched --json
    python benchmarks/peer_pfl.py --tiny                       # seconds: 20 clients, 4 a round, to check it runs
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]  # also when a test loads this file as a module

from gpu_flagship import write_random_cifar10

from fl_lightning.models import FeatureClassifier, register_model
from fl_lightning.tracking.loggers import RunLogger

EXAMPLES_PER_CLIENT, BATCH, LOCAL_LR, SEED = 50, 10, 0.1, 0


def simple_cnn(num_classes: int = 10, in_channels: int = 3, image_size: int = 32) -> FeatureClassifier:
    """pfl-research's ``simple_cnn`` (its PyTorch benchmark model) on NCHW images, as fl-lightning's loaders give."""
    pooled = (image_size - 4) // 2  # two unpadded 3x3 convolutions, then a 2x2 max-pool
    features = nn.Sequential(
        nn.Conv2d(in_channels, 32, kernel_size=3),
        nn.ReLU(),
        nn.Conv2d(32, 64, kernel_size=3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(pooled * pooled * 64, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
    )
    head = nn.Linear(128, num_classes)
    for module in [*features, head]:
        if isinstance(module, (nn.Conv2d, nn.Linear)):  # pfl-research's Glorot-uniform weights (as its TF2 model)
            nn.init.xavier_uniform_(module.weight)
    return FeatureClassifier(features, head, feature_dim=128, num_classes=num_classes)


def recipe(data_dir: Path, clients: int, per_round: int, rounds: int, executor: str) -> str:
    """The workload as a recipe (``flrun fit --config``)."""
    return f"""
rounds: {rounds}
eval_every: {rounds}
checkpoint_every: {rounds}
seed: {SEED}
data:
  class_path: fl_lightning.data.Cifar10Data
  init_args:
    data_dir: {data_dir}
    partitioner: {{class_path: fl_lightning.data.IidPartitioner}}
models:
  global: {{builder: peer_simple_cnn}}
population:
  num_clients: {clients}
  tiers: [{{name: all, roles: [global]}}]
sampler:
  class_path: fl_lightning.federation.sampling.UniformSampler
  init_args: {{num_per_round: {per_round}}}
strategy:
  class_path: fl_lightning.strategies.FedAvg
  init_args: {{weighted: false}}
training:
  optimizer: {{class_path: torch.optim.SGD, init_args: {{lr: {LOCAL_LR}}}}}
  local_epochs: 1
  batch_size: {BATCH}
runtime: {{accelerator: cpu, num_threads: 1, progress: false, executor: {executor}}}
"""


def steady(per_round: list[float]) -> float:
    """Median seconds of the steady rounds: not the first (first calls), not the last (it evaluates)."""
    return statistics.median(per_round[1:-1] or per_round[-1:])


class Clock(RunLogger):
    """Wall and CPU time (this process's, which a busy machine inflates less) at the end of each round; as a run
    logger it notes fl-lightning's rounds."""

    def __init__(self):
        self.stamps = [(time.perf_counter(), time.process_time())]

    def start(self, output_dir, name, config, state):
        self.stamps = [(time.perf_counter(), time.process_time())]

    def log_metrics(self, metrics, step):
        self.tick()

    def tick(self) -> None:
        self.stamps.append((time.perf_counter(), time.process_time()))

    def result(self) -> dict:
        wall, cpu = (np.diff([stamp[i] for stamp in self.stamps]).tolist() for i in (0, 1))
        return {"round_s": wall, "s_per_round": steady(wall), "cpu_round_s": cpu, "cpu_s_per_round": steady(cpu)}


def run_framework(data_dir: Path, clients: int, per_round: int, rounds: int, executor: str) -> dict:
    from fl_lightning.cli.commands import fit_from_argv

    register_model("peer_simple_cnn")(simple_cnn)  # in this worker process only: the recipe names it
    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "peer_pfl.yaml"
        config.write_text(recipe(data_dir, clients, per_round, rounds, executor))
        summary = fit_from_argv(["--config", str(config), "--output_dir", str(Path(tmp) / "run")], [clock])
    return {**clock.result(), "fits": summary.get("executor")}


def sampled(clients: int, per_round: int, rounds: int) -> list[list[int]]:
    """fl-lightning's clients of each round (its sampler with the orchestrator's seeded stream)."""
    from fl_lightning.federation.population import Population
    from fl_lightning.federation.sampling import UniformSampler
    from fl_lightning.federation.seeding import Owner, Stream, derive_seed

    population, sampler = Population(num_clients=clients).build(SEED), UniformSampler(num_per_round=per_round)
    schedule = []
    for rnd in range(1, rounds + 1):
        rng = np.random.default_rng(derive_seed(SEED, rnd, Owner.SERVER, Stream.SAMPLER))
        schedule.append([c.id for c in sampler.sample(rnd, population, rng)])
    return schedule


def run_minimal(data_dir: Path, clients: int, per_round: int, rounds: int) -> dict:
    """The loop a user would write, on fl-lightning's data, initial weights and clients."""
    from fl_lightning.client.loop import role_seed
    from fl_lightning.data import Cifar10Data, IidPartitioner

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)  # as fl-lightning's runtime.flush_denormal default
    data = Cifar10Data(data_dir=str(data_dir), partitioner=IidPartitioner())
    data.setup(clients, SEED)
    x, y = data.x, data.y
    train = [data.clients[c].train for c in range(clients)]
    torch.manual_seed(role_seed(SEED, "global"))  # the same initial weights as fl-lightning's "global" role
    model = simple_cnn()
    optimizer = torch.optim.SGD(model.parameters(), lr=LOCAL_LR)  # plain SGD: no state to reset per client
    generator = torch.Generator().manual_seed(SEED)
    global_state = {k: v.clone() for k, v in model.state_dict().items()}
    clock = Clock()
    for chosen in sampled(clients, per_round, rounds):
        sums = None
        for cid in chosen:
            model.load_state_dict(global_state)
            model.train()
            order = train[cid][torch.randperm(len(train[cid]), generator=generator)]
            for batch in order.split(BATCH):
                optimizer.zero_grad()
                F.cross_entropy(model(x[batch]), y[batch]).backward()
                optimizer.step()
            with torch.no_grad():
                if sums is None:
                    sums = {k: v.clone() for k, v in model.state_dict().items()}
                else:
                    for k, v in model.state_dict().items():
                        sums[k].add_(v)
        global_state = {k: v / len(chosen) for k, v in sums.items()}
        clock.tick()
    return clock.result()


def run_pfl(data_dir: Path, clients: int, per_round: int, rounds: int) -> dict:
    """pfl-research's own simulation of the workload (its PyTorch backend), on the same arrays, channels-last."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByUser
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    from fl_lightning.data import Cifar10Data, IidPartitioner

    torch.set_num_threads(1)
    data = Cifar10Data(data_dir=str(data_dir), partitioner=IidPartitioner())
    data.setup(clients, SEED)
    images = data.x.permute(0, 2, 3, 1).contiguous()  # NHWC, as pfl-research's CIFAR-10 arrays
    users = {c: data.clients[c].train for c in range(clients)}
    torch.manual_seed(SEED)
    cnn = simple_cnn()
    network = nn.Sequential(_ChannelsFirst(), *cnn.features, cnn.head)
    network.loss = lambda inputs, targets, eval=False: F.cross_entropy(network.train(not eval)(inputs), targets)
    network.metrics = lambda inputs, targets, eval=True: {}
    model = PyTorchModel(
        model=network,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD([p for p in network.parameters() if p.requires_grad], 1.0),
    )
    dataset = FederatedDataset(
        lambda user: Dataset((images[users[user]], data.y[users[user]]), user_id=user),
        get_user_sampler("random", list(users)),
    )
    clock = _pfl_clock(TrainingProcessCallback, Metrics)
    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds, evaluation_frequency=rounds, train_cohort_size=per_round, val_cohort_size=0
        ),
        # its benchmark's weight_by_samples: false
        backend=SimulatedBackend(training_data=dataset, val_data=None, postprocessors=[WeightByUser()]),
        model=model,
        model_train_params=NNTrainHyperParams(local_learning_rate=LOCAL_LR, local_num_epochs=1, local_batch_size=BATCH),
        model_eval_params=NNEvalHyperParams(local_batch_size=1000),
        callbacks=[clock],
    )
    return clock.clock.result()


class _ChannelsFirst(nn.Module):
    """pfl-research's ``Transpose2D``: its images are channels-last."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 3, 1, 2)


def _pfl_clock(base: type, metrics: type):
    """A pfl callback noting when each central iteration ends (pfl's classes exist only where it is installed)."""

    class PflClock(base):
        def on_train_begin(self, *, model):
            self.clock = Clock()
            return metrics()

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            self.clock.tick()
            return False, metrics()

    return PflClock()


def pfl_installed() -> bool:
    try:
        import pfl  # noqa: F401
    except ImportError:
        return False
    return True


def measure(side: str, args: argparse.Namespace, data_dir: Path) -> dict:
    """One side's run in a fresh process (its own peak memory, nothing warm from another side)."""
    command = [sys.executable, __file__, "--worker", side, "--data_dir", str(data_dir), "--rounds", str(args.rounds)]
    command += ["--clients", str(args.clients), "--clients_per_round", str(args.clients_per_round)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"the {side} side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker(args: argparse.Namespace) -> None:
    data_dir, shape = Path(args.data_dir), (args.clients, args.clients_per_round, args.rounds)
    if args.worker == "minimal":
        result = run_minimal(data_dir, *shape)
    elif args.worker == "pfl-research":
        result = run_pfl(data_dir, *shape)
    else:
        result = run_framework(data_dir, *shape, executor=args.worker.removeprefix("fl-lightning-"))
    result["max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="rounds per run (at least 3: two are not steady)")
    parser.add_argument("--clients", type=int, default=1000, help="clients of 50 images each")
    parser.add_argument("--clients_per_round", type=int, default=50)
    parser.add_argument("--executor", nargs="+", choices=["sequential", "batched"], default=["sequential"])
    parser.add_argument("--repeats", type=int, default=3, help="alternations of the sides")
    parser.add_argument("--tiny", action="store_true", help="20 clients, 4 a round, 3 rounds, 1 repeat")
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--data_dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    if args.tiny:
        args.clients, args.clients_per_round, args.rounds, args.repeats = 20, 4, 3, 1
    if args.rounds < 3 or not 1 <= args.clients_per_round <= args.clients:
        parser.error("--rounds must be at least 3 and --clients_per_round between 1 and --clients")
    sides = ["minimal", *(f"fl-lightning-{e}" for e in args.executor)]
    skipped = None if pfl_installed() else "pfl-research: skipped (import pfl failed; pip install pfl to compare)"
    sides += [] if skipped else ["pfl-research"]
    with tempfile.TemporaryDirectory() as tmp:
        # CIFAR-10's five training batches and its test batch, each a fifth of the clients' images
        write_random_cifar10(Path(tmp), per_batch=args.clients * EXAMPLES_PER_CLIENT // 5)
        runs: dict[str, list[dict]] = {side: [] for side in sides}
        for _ in range(args.repeats):  # alternated, so that the machine's load falls on every side alike
            for side in sides:
                runs[side].append(measure(side, args, Path(tmp)))
    report(args, runs, skipped)


def report(args: argparse.Namespace, runs: dict[str, list[dict]], skipped: str | None) -> None:
    best = {side: min(r["s_per_round"] for r in results) for side, results in runs.items()}
    cpu = {side: min(r["cpu_s_per_round"] for r in results) for side, results in runs.items()}
    result = {
        "workload": {
            "clients": args.clients,
            "clients_per_round": args.clients_per_round,
            "rounds": args.rounds,
            "repeats": args.repeats,
            "torch": torch.__version__,
        },
        "s_per_round": best,
        "ratio_to_minimal": {side: best[side] / best["minimal"] for side in runs},
        "cpu_s_per_round": cpu,
        "cpu_ratio_to_minimal": {side: cpu[side] / cpu["minimal"] for side in runs},
        "max_rss_mb": {side: max(r["max_rss_mb"] for r in results) for side, results in runs.items()},
        "fits": {side: results[-1].get("fits") for side, results in runs.items() if results[-1].get("fits")},
        "skipped": skipped,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"{args.clients} clients of 50, {args.clients_per_round} a round, {args.rounds} rounds, best of {args.repeats}"
    )
    print("| side | s per steady round | / minimal | CPU s per steady round | / minimal | peak RSS MB |")
    print("|---|---|---|---|---|---|")
    for side in runs:
        ratio, cpu_ratio = result["ratio_to_minimal"][side], result["cpu_ratio_to_minimal"][side]
        print(
            f"| {side} | {best[side]:.3f} | {ratio:.3f} | {cpu[side]:.3f} | {cpu_ratio:.3f} | "
            f"{result['max_rss_mb'][side]:.0f} |"
        )
    if skipped:
        print(skipped)


if __name__ == "__main__":
    main()
