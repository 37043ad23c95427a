"""What a round, a checkpoint and the final evaluation cost as the population grows (issue 14).

For each method and population size N, one ``flrun fit`` run in its own process (so that peak memory,
max RSS, is that run's): the method's digits recipe with N clients drawing their examples with
replacement (``SampledPartitioner``: the same number of examples per client at every N, also for
populations larger than digits' 1,797 examples), 10 clients a round, a checkpoint after every round and
one evaluation, after the last round. FedHe's three architectures are a third of the population each
at every N (the recipe's fixed tier counts would change the mix with N).

    python benchmarks/population.py                                   # FedAvg and FedHe, N = 100 ... 100,000
    python benchmarks/population.py --method fedhe --clients 100 10000 --json

Per run: ``s_per_round`` (wall time of the rounds, checkpoints included, evaluation excluded, over the
rounds), ``checkpoint_s_per_round`` and ``checkpoint_bytes_per_round`` (bytes the run wrote for its
state per round: the checkpoint file plus the client-state files written since the previous one),
``final_eval_s`` (the last round's evaluation), ``clients_evaluated`` (the clients that evaluation
covered: with ``--untrained skip``, the default here, those that trained), ``setup_s`` (data,
partition and models, before the first round) and ``peak_rss_mb``. With ``--counts`` also
``python_calls_per_round`` (cProfile's count of the rounds' Python function calls, evaluations left out):
unlike the seconds it does not depend on how busy the machine is.

    python benchmarks/population.py --method fedhe --clients 100 10000 --json --counts
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
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"fedavg": "quickstart.yaml", "fedhe": "digits_fedhe.yaml"}
FEDHE_TIERS = [
    {"name": "cnn_small", "roles": ["cnn_small"], "fraction": 1 / 3},
    {"name": "cnn_large", "roles": ["cnn_large"], "fraction": 1 / 3},
    {"name": "mlp", "roles": ["mlp"]},
]


def recipe(method: str, clients: int, args: argparse.Namespace) -> dict:
    """The method's digits recipe at ``clients`` clients, every round checkpointed, one evaluation."""
    config = yaml.safe_load((ROOT / "recipes" / RECIPES[method]).read_text())
    if "base" in config:
        raise SystemExit(f"{RECIPES[method]} names a base recipe; population.py reads self-contained recipes only")
    partitioner = {"examples_per_client": args.examples_per_client, "alpha": args.alpha}
    config["data"]["init_args"]["partitioner"] = {
        "class_path": "fl_lightning.data.SampledPartitioner",
        "init_args": partitioner,
    }
    config["population"]["num_clients"] = clients
    if method == "fedhe":
        config["population"]["tiers"] = FEDHE_TIERS
    config["sampler"] = {
        "class_path": "fl_lightning.federation.sampling.UniformSampler",
        "init_args": {"num_per_round": 10},
    }
    config.update(rounds=args.rounds, eval_every=args.rounds, checkpoint_every=1)
    config["evaluation"] = {"untrained": args.untrained}
    if args.clients_per_batch != 1:  # left out at its default, so that the script also runs on older commits
        config["evaluation"]["clients_per_batch"] = args.clients_per_batch
    config.setdefault("runtime", {})["progress"] = False
    return config


def run_one(method: str, clients: int, args: argparse.Namespace) -> dict:
    """One run, timed from the inside (this process is the worker)."""
    import fl_lightning.run.fit as fit_module
    from fl_lightning.cli.commands import fit_from_argv
    from fl_lightning.run.orchestrator import FederationOrchestrator

    timings: dict = {"checkpoint_s": [], "checkpoint_bytes": [], "eval_s": []}
    profile = cProfile.Profile() if args.counts else None  # the rounds' Python calls, evaluations left out

    class TimedOrchestrator(FederationOrchestrator):
        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            state, strategy = self.state, self.strategy
            save, evaluate = state.save, strategy.evaluate
            written = [0]  # client-file bytes written up to the end of the previous checkpoint

            def timed_save(path, *rest):
                start = time.perf_counter()
                save(path, *rest)
                timings["checkpoint_s"].append(time.perf_counter() - start)
                store = state.client_states
                timings["checkpoint_bytes"].append(path.stat().st_size + store.bytes_written - written[0])
                written[0] = store.bytes_written

            def timed_evaluate(evaluator):
                if profile is not None:
                    profile.disable()
                start = time.perf_counter()
                metrics = evaluate(evaluator)
                timings["eval_s"].append(time.perf_counter() - start)
                if profile is not None:
                    profile.enable()
                return metrics

            state.save, strategy.evaluate = timed_save, timed_evaluate

        def run_rounds(self, checkpoint=None):
            timings["setup_s"] = time.perf_counter() - timings["started"]
            start = time.perf_counter()
            if profile is not None:
                profile.enable()
            rounds = getattr(super(), "run_rounds", None) or super().run  # `run` on commits before the rename
            summary = rounds(checkpoint)
            if profile is not None:
                profile.disable()
            timings["run_s"] = time.perf_counter() - start
            return summary

        run = run_rounds  # what fit() calls on commits before the rename

    fit_module.FederationOrchestrator = TimedOrchestrator
    try:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "recipe.yaml"
            path.write_text(yaml.safe_dump(recipe(method, clients, args)))
            timings["started"] = time.perf_counter()
            summary = fit_from_argv(["--config", str(path), "--output_dir", str(Path(tmp) / "run")])
    finally:
        fit_module.FederationOrchestrator = FederationOrchestrator
    rounds = summary["rounds"]
    counts = {}
    if profile is not None:
        calls = sum(ncalls for _, ncalls, *_ in pstats.Stats(profile).stats.values())
        counts["python_calls_per_round"] = calls / rounds
    return {
        "method": method,
        "clients": clients,
        "rounds": rounds,
        "clients_per_round": 10,
        "examples_per_client": args.examples_per_client,
        "s_per_round": (timings["run_s"] - sum(timings["eval_s"])) / rounds,
        "checkpoint_s_per_round": sum(timings["checkpoint_s"]) / rounds,
        "checkpoint_bytes_per_round": sum(timings["checkpoint_bytes"]) / rounds,
        "checkpoint_bytes_last_round": timings["checkpoint_bytes"][-1],
        "final_eval_s": timings["eval_s"][-1],
        "clients_evaluated": _clients_evaluated(summary["final"], clients),
        "untrained": args.untrained,
        "clients_per_batch": args.clients_per_batch,
        "setup_s": timings["setup_s"],
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        **counts,
        "final": summary["final"],
    }


def _clients_evaluated(final: dict, clients: int) -> int | None:
    """Clients the personalized evaluation covered (None for a method that evaluates a global model only)."""
    if "personal/clients_evaluated" in final:
        return int(final["personal/clients_evaluated"])
    return clients if any(key.startswith("personal/") for key in final) else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", choices=list(RECIPES), nargs="+", default=list(RECIPES))
    parser.add_argument("--clients", type=int, nargs="+", default=[100, 1_000, 10_000, 100_000])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--examples_per_client", type=int, default=50)
    parser.add_argument("--alpha", type=float, default=0.5, help="Dirichlet class proportions per client")
    parser.add_argument("--untrained", choices=["skip", "evaluate"], default="skip", help="evaluation.untrained")
    parser.add_argument(
        "--clients_per_batch", type=int, default=1, help="evaluation.clients_per_batch (1: one client at a time)"
    )
    parser.add_argument(
        "--counts",
        action="store_true",
        help="also count the rounds' Python function calls (cProfile; evaluations left out): python_calls_per_round",
    )
    parser.add_argument("--json", action="store_true", help="one JSON line per run instead of a table")
    parser.add_argument("--worker", nargs=2, metavar=("METHOD", "CLIENTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rounds < 1 or min(args.clients) < 10:
        raise SystemExit("--rounds must be at least 1 and every --clients at least 10 (10 clients train per round)")
    if args.worker:
        print(json.dumps(run_one(args.worker[0], int(args.worker[1]), args)))
        return
    if not args.json:
        print(
            "| method | clients | s/round | checkpoint s/round | checkpoint MB/round | final eval s "
            "| clients evaluated | setup s | peak RSS MB |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
    options = ["--rounds", str(args.rounds), "--examples_per_client", str(args.examples_per_client)]
    options += ["--alpha", str(args.alpha), "--untrained", args.untrained]
    options += ["--clients_per_batch", str(args.clients_per_batch), *(["--counts"] if args.counts else [])]
    for method in args.method:
        for clients in args.clients:
            command = [sys.executable, __file__, "--worker", method, str(clients), *options]
            out = subprocess.run(command, capture_output=True, text=True, check=False)
            if out.returncode != 0:
                raise SystemExit(f"{method} with {clients} clients failed:\n{out.stderr[-3000:]}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            if args.json:
                print(json.dumps({k: v for k, v in result.items() if k != "final"}), flush=True)
            else:
                print(
                    f"| {method} | {clients:,} | {result['s_per_round']:.3f} | {result['checkpoint_s_per_round']:.4f} "
                    f"| {result['checkpoint_bytes_per_round'] / 1e6:.3f} | {result['final_eval_s']:.3f} "
                    f"| {_count(result['clients_evaluated'])} | {result['setup_s']:.1f} "
                    f"| {result['peak_rss_mb']:.0f} |",
                    flush=True,
                )


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


if __name__ == "__main__":
    main()
