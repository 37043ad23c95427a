"""The flagship (paper 001 on CIFAR-10, ResNet20) on one GPU: seconds per round next to plain PyTorch.

Writes random-pixel CIFAR-10 in the real pickle format (no download needed), runs a few rounds of
``recipes/ondevice_kd_cifar10.yaml`` (or the ``--recipe`` named, e.g. ``fedavg_cifar10_table5``) per execution
mode (``--executor sequential graphs lockstep batched``; ``graphs``: sequential with ``runtime.cuda_graphs``;
``lockstep``: batched with ``runtime.lockstep``; the batched modes with ``optimizer_state: shared_per_phase``,
the order-free form of paper 001's shared momentum) and precision, and reports per run: seconds per steady round
(rounds 2 .. N-1; round N also evaluates), the first round's extra seconds, peak GPU memory, mean GPU
utilisation (NVML, sampled every 0.2 s) and the final test losses (a bf16 run whose loss explodes
shows here). In the same process it times plain-PyTorch ResNet20 SGD steps of 32 images for 20
clients x 30 steps, one client after another, the same replayed from a CUDA graph of the whole step
(on a GPU), and as one ``torch.func.vmap`` call over stacked weights: the anchors for what a round could cost,
priced per recipe (``anchor_s_per_round``: the recipe's steps per round at the anchors' rates).

    PYTHONPATH=. python benchmarks/gpu_flagship.py --rounds 4 --precision 32-true bf16-mixed --json

On a CPU, ``--tiny`` shrinks everything (data, clients, steps) to check that the script runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import pickle
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fl_lightning.tracking.loggers import RunLogger


def write_random_cifar10(root: Path, per_batch: int) -> None:
    """Five training batches and a test batch in CIFAR-10's python pickle layout, random pixels."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
            "labels": rng.integers(0, 10, per_batch).tolist(),
        }
        with (folder / name).open("wb") as f:
            pickle.dump(batch, f)


class RoundClock(RunLogger):
    """A run logger that notes when each round's metrics arrive (the end of the round)."""

    def __init__(self):
        self.stamps: list[float] = []

    def start(self, output_dir, name, config, state):
        self.stamps = [time.perf_counter()]

    def log_metrics(self, metrics, step):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.stamps.append(time.perf_counter())


class Utilisation:
    """Mean GPU utilisation over a block, sampled by NVML in a thread (None without a GPU or NVML)."""

    def __enter__(self):
        self.samples, self._stop = [], threading.Event()
        self._thread = None
        try:
            import pynvml
        except ImportError:
            return self
        try:
            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except pynvml.NVMLError:  # no GPU or no driver: utilisation stays unknown
            return self

        def sample():
            while not self._stop.wait(0.2):
                self.samples.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)

        self._thread = threading.Thread(target=sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return float(np.mean(self.samples)) if self.samples else None


# Local steps per round by role at the recipes' settings (the plain anchors price these): paper 001's 20 sampled
# clients x 30 auxiliary steps, its 20 strong clients x (30 CE + 30 KD) target steps; FedAvg's 20 x 60 steps.
ROUND_STEPS = {"ondevice_kd_cifar10": {0.25: 600, 1.0: 1200}, "fedavg_cifar10_table5": {0.25: 1200}}


def run_flagship(
    data_dir: Path, precision: str, executor: str, rounds: int, tiny: bool, out: Path, recipe="ondevice_kd_cifar10"
) -> dict:
    from fl_lightning.cli.commands import fit_from_argv

    argv = ["--config", str(ROOT / "recipes" / f"{recipe}.yaml"), "--rounds", str(rounds)]
    argv += ["--eval_every", str(rounds), "--checkpoint_every", str(rounds), "--runtime.progress", "false"]
    argv += ["--runtime.precision", precision, "--output_dir", str(out), "--data.init_args.data_dir", str(data_dir)]
    argv += ["--data.init_args.download", "false"]
    if executor == "graphs":  # the sequential loop, each step replayed from a CUDA graph (client/graphs.py)
        argv += ["--runtime.executor", "sequential", "--runtime.cuda_graphs", "true"]
    else:
        argv += ["--runtime.executor", "batched" if executor == "lockstep" else executor]
    if executor == "lockstep":  # every client of a group in every step, batches padded
        argv += ["--runtime.lockstep", "true"]
    if executor in ("batched", "lockstep"):  # paper 001's momentum goes client to client; shared_per_phase batches
        argv += ["--training.optimizer_state", "shared_per_phase"]
    if tiny:
        tiers = "[{name: strong, roles: [aux, target], count: 2}, {name: weak, roles: [aux]}]"
        argv += [
            "--population.num_clients",
            "10",
            "--population.tiers",
            tiers,
            "--sampler.init_args.num_per_round",
            "4",
        ]
        argv += ["--training.local_steps", "2", "--runtime.accelerator", "cpu"]
    else:
        argv += ["--runtime.accelerator", "cuda"]
    clock = RoundClock()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with Utilisation() as util, _cpu_stand_in(executor == "graphs" and tiny):
        summary = fit_from_argv(argv, extra_loggers=[clock])
    per_round = np.diff(clock.stamps).tolist()
    steady = per_round[1:-1] or per_round[-1:]
    return {
        "recipe": recipe,
        "precision": precision,
        "executor": executor,
        "fits": summary.get("executor") or summary.get("cuda_graphs"),
        "rounds": rounds,
        "round_s": per_round,
        "s_per_steady_round": statistics.median(steady),
        "first_round_extra_s": per_round[0] - statistics.median(steady),
        "peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None,
        "gpu_util_mean_pct": util.mean,
        "final": {k: v for k, v in summary["final"].items() if "loss" in k or "acc" in k},
    }


@contextlib.contextmanager
def _cpu_stand_in(wanted: bool):
    """On a CPU dry run, CUDA graphs' stand-in that checks each replay against its capture (unless a caller,
    such as batched_python_calls.py, has put its own backend in place)."""
    from fl_lightning.client import graphs
    from fl_lightning.client.graphs.trace import CheckedReruns

    original = graphs.backend_for
    if wanted and original.__module__.startswith(graphs.__name__):  # the package's own, not a caller's
        graphs.backend_for = CheckedReruns
    try:
        yield
    finally:
        graphs.backend_for = original


def plain_pytorch(
    clients: int, steps: int, batch: int, width: float, device: str, compile_modes: tuple[str, ...] = ()
) -> dict:
    """Steps/s of plain ResNet20 SGD: clients one after another, all clients as one vmapped step, and that step
    compiled in each of ``compile_modes`` (``default``, ``reduce-overhead``: CUDA graphs, ``max-autotune``)."""
    from torch.func import functional_call, grad, stack_module_state, vmap

    from fl_lightning.models import ModelSpec

    torch.manual_seed(0)
    x = torch.randn(clients, steps, batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (clients, steps, batch), device=device)
    model = ModelSpec("resnet20", {"width": width}).build(num_classes=10, in_channels=3).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    for _ in range(3):  # warm-up
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x[0, 0]), y[0, 0]).backward()
        optimizer.step()
    sync()
    start = time.perf_counter()
    for c in range(clients):
        for s in range(steps):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x[c, s]), y[c, s]).backward()
            optimizer.step()
    sync()
    sequential = clients * steps / (time.perf_counter() - start)
    graphed = _graphed_sequential(model, optimizer, x, y, sync) if device == "cuda" else None

    models = [ModelSpec("resnet20", {"width": width}).build(num_classes=10, in_channels=3).to(device)]
    models = models * clients
    for m in models:
        torch.func.replace_all_batch_norm_modules_(m)  # batch statistics only: no in-place buffer updates
    params, buffers = stack_module_state(models)
    base = models[0]

    def loss_fn(p, b, xb, yb):
        return torch.nn.functional.cross_entropy(functional_call(base, (p, b), (xb,)), yb)

    step_grads = vmap(grad(loss_fn))
    momentum = {k: torch.zeros_like(v) for k, v in params.items()}

    def vmapped_step(s):
        grads = step_grads(params, buffers, x[:, s], y[:, s])
        with torch.no_grad():
            for k in params:
                momentum[k].mul_(0.9).add_(grads[k])
                params[k].sub_(0.01 * momentum[k])

    for s in range(3):
        vmapped_step(s)
    sync()
    start = time.perf_counter()
    for s in range(steps):
        vmapped_step(s)
    sync()
    vmapped = clients * steps / (time.perf_counter() - start)
    result = {"width": width, "sequential_steps_per_s": sequential, "vmapped_steps_per_s": vmapped}
    result["graphed_sequential_steps_per_s"] = graphed

    # the same vmapped steps as one function of (weights, momenta, batch) -> (weights, momenta), compiled:
    # what torch.compile (and with "reduce-overhead", CUDA graphs) would add to the batched executor's step
    def functional_step(p, m, xb, yb):
        grads = step_grads(p, buffers, xb, yb)
        new_m = {k: m[k] * 0.9 + grads[k] for k in p}
        return {k: p[k] - 0.01 * new_m[k] for k in p}, new_m

    for mode in compile_modes:
        torch._dynamo.reset()
        compiled = torch.compile(functional_step, mode=None if mode == "default" else mode)
        p = {k: v.detach().clone() for k, v in params.items()}
        m = {k: torch.zeros_like(v) for k, v in p.items()}
        start = time.perf_counter()
        for s in range(3):  # compiles (and records the graphs) on the first calls
            p, m = compiled(p, m, x[:, s], y[:, s])
        sync()
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        for s in range(steps):
            p, m = compiled(p, m, x[:, s], y[:, s])
        sync()
        result[f"compiled_{mode}"] = {
            "steps_per_s": clients * steps / (time.perf_counter() - start),
            "compile_s": compile_s,
        }
    return result


def _graphed_sequential(model, optimizer, x: torch.Tensor, y: torch.Tensor, sync) -> float:
    """Steps/s of the same sequential steps, each replayed from one CUDA graph of a whole step (forward,
    backward, SGD), as torch's documentation captures a whole network: the ceiling of runtime.cuda_graphs."""
    clients, steps = x.shape[:2]
    static_x, static_y = x[0, 0].clone(), y[0, 0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream before the capture, as torch asks
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(static_x), static_y).backward()
            optimizer.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        torch.nn.functional.cross_entropy(model(static_x), static_y).backward()
        optimizer.step()
    sync()
    start = time.perf_counter()
    for c in range(clients):
        for s in range(steps):
            static_x.copy_(x[c, s])
            static_y.copy_(y[c, s])
            graph.replay()
    sync()
    return clients * steps / (time.perf_counter() - start)


def plain_split(split: dict[str, float], sequential_rates: dict[float, float], device: str, calls: int = 5) -> dict:
    """Seconds a round of plain-PyTorch steps would take split as the batched executor must split the flagship.

    ``split``: group steps per round by ``role/clients`` (``benchmarks/batched_calls.py``). A one-client step
    costs one plain step (``sequential_rates``: steps/s by width); an m-client step costs one vmapped SGD step
    of m ResNet20s on batches of 32, timed here. The target's KD steps also run the teacher's forward, which
    this leaves out: a lower bound for the batched executor on this partition, where the lockstep anchor
    (all clients in every call) is out of reach."""
    widths = {"aux": 0.25, "target": 1.0}
    seconds, per_call = 0.0, {}
    for key, count in split.items():
        role, m = key.split("/")[0], int(key.split("/")[1])
        width = widths[role]
        per_call[key] = 1 / sequential_rates[width] if m == 1 else _vmapped_call_seconds(width, m, device, calls)
        seconds += count * per_call[key]
    return {"s_per_round": seconds, "calls_per_round": sum(split.values()), "s_per_call": per_call}


def _vmapped_call_seconds(width: float, m: int, device: str, calls: int) -> float:
    """Seconds of one vmapped SGD step (momentum 0.9) of m ResNet20s on batches of 32."""
    from torch.func import functional_call, grad, stack_module_state, vmap

    from fl_lightning.models import ModelSpec

    models = [ModelSpec("resnet20", {"width": width}).build(num_classes=10, in_channels=3).to(device)] * m
    for model in models:
        torch.func.replace_all_batch_norm_modules_(model)
    params, buffers = stack_module_state(models)
    x, y = torch.randn(m, 32, 3, 32, 32, device=device), torch.randint(0, 10, (m, 32), device=device)

    def loss_fn(p, b, xb, yb):
        return torch.nn.functional.cross_entropy(functional_call(models[0], (p, b), (xb,)), yb)

    step_grads, momentum = vmap(grad(loss_fn)), {k: torch.zeros_like(v) for k, v in params.items()}

    def step():
        grads = step_grads(params, buffers, x, y)
        with torch.no_grad():
            for k in params:
                momentum[k].mul_(0.9).add_(grads[k])
                params[k].sub_(0.01 * momentum[k])

    for _ in range(2):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls


def anchor_seconds(recipe: str, anchors: list[dict]) -> dict[str, float | None]:
    """Seconds a round of ``recipe``'s steps takes at the plain anchors' rates: one client after another, replayed
    from CUDA graphs (GPU only), all clients as one vmapped step (``ROUND_STEPS``, the recipe's full settings)."""
    rates = {a["width"]: a for a in anchors}
    out = {}
    for mode in ("sequential", "graphed_sequential", "vmapped"):
        per_width = [rates[w].get(f"{mode}_steps_per_s") for w in ROUND_STEPS[recipe]]
        if all(per_width):
            out[mode] = sum(steps / rate for steps, rate in zip(ROUND_STEPS[recipe].values(), per_width))
        else:
            out[mode] = None
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--precision", nargs="+", default=["32-true", "bf16-mixed"])
    parser.add_argument(
        "--executor",
        nargs="+",
        default=["sequential", "batched"],
        choices=["sequential", "batched", "lockstep", "graphs"],
        help="graphs: sequential with runtime.cuda_graphs (on --tiny, the CPU stand-in that checks each replay); "
        "lockstep: batched with runtime.lockstep",
    )
    parser.add_argument(
        "--recipe", nargs="+", default=["ondevice_kd_cifar10"], choices=sorted(ROUND_STEPS), help="recipes/<name>.yaml"
    )
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run: small data, clients and steps")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--skip_plain", action="store_true")
    parser.add_argument(
        "--compile",
        nargs="+",
        default=[],
        metavar="MODE",
        help="also time the plain vmapped step under torch.compile in these modes (default, reduce-overhead)",
    )
    parser.add_argument("--skip_runs", action="store_true", help="time the plain-PyTorch anchors only")
    parser.add_argument(
        "--split",
        type=Path,
        help="benchmarks/batched_calls.py's JSON: also time plain PyTorch split into the same group steps",
    )
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    result = {"device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu", "torch": torch.__version__}
    # The anchors first and each result on stderr as it comes: a run cut short by a device's time limit
    # still leaves the figures it reached in the log.
    if not args.skip_plain:
        clients, steps = (2, 3) if args.tiny else (20, 30)
        result["plain_pytorch"] = []
        for width in (1.0, 0.25):
            result["plain_pytorch"].append(plain_pytorch(clients, steps, 32, width, device, tuple(args.compile)))
            print("# plain:", json.dumps(result["plain_pytorch"][-1]), file=sys.stderr, flush=True)
        if args.split is not None:
            recorded = json.loads(args.split.read_text())
            split = {k: n / recorded["rounds"] for k, n in recorded["calls_by_role_and_clients"].items()}
            if args.tiny:  # a smoke run: the two smallest group sizes of each role
                split = {k: n for k, n in split.items() if int(k.split("/")[1]) <= 2}
            rates = {p["width"]: p["sequential_steps_per_s"] for p in result["plain_pytorch"]}
            result["plain_split"] = plain_split(split, rates, device, calls=1 if args.tiny else 5)
            print("# plain split:", json.dumps(result["plain_split"]), file=sys.stderr, flush=True)
    result["runs"] = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        if not args.skip_runs:
            write_random_cifar10(data_dir, 200 if args.tiny else 10_000)
            for recipe in args.recipe:
                for executor in args.executor:
                    for precision in args.precision:
                        run_dir = Path(tmp) / f"run-{recipe}-{executor}-{precision}"
                        run = run_flagship(data_dir, precision, executor, args.rounds, args.tiny, run_dir, recipe)
                        result["runs"].append(run)
                        print("# run:", json.dumps(run), file=sys.stderr, flush=True)
    if "plain_pytorch" in result:
        result["anchor_s_per_round"] = {
            recipe: anchor_seconds(recipe, result["plain_pytorch"]) for recipe in args.recipe
        }
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
