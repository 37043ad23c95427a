"""The privacy-utility table on digits: each method's final accuracy at epsilon 1, 2, 4, 8 and without privacy.

    python benchmarks/privacy_table.py --out benchmarks/results/privacy_table.md   # every method, seeds 0 1 2
    python benchmarks/privacy_table.py --methods fedavg fd --epsilons 8 inf --seeds 0 --rounds 2  # a quick look

Each method runs its digits recipe with a ``privacy`` section whose ``target_epsilon`` is the column's epsilon
(``delta`` 1e-3, below 1 / clients for every recipe here): the run calibrates its noise multiplier over its
planned rounds, so a cell is the accuracy a whole run reaches within that budget. ``inf`` runs without the
section. Methods whose server sums or averages the uploads get central noise (``where: server``) with each
client joining a round with probability 0.5 (``PoissonSampler``, the sampler that gives amplification by
subsampling), in every column, ``inf`` included, so that privacy is the only difference along a row; the others
get local noise (``where: client``) with their recipe's sampler. DS-FL runs with votes on 50 open examples and
the plurality reply, PATE's noisy argmax. The clip bounds are fixed per method (the table prints them), not
tuned: a bound near the typical norm of a method's uploads would do better.

A cell is the final value of the recipe's monitored metric, the mean and sample standard deviation over the
seeds, with the noise multiplier the runs calibrated (``z``); a method that privacy refuses shows why. The
digits federations have 10 to 20 clients, 5 to 10 a round: the noise a small epsilon needs is then far larger
than the signal of a round's few uploads (DP-FedAvg's regime is hundreds of clients a round), so expect the
small epsilons to cost most of the accuracy.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
EPSILONS = ["1", "2", "4", "8", "inf"]
DELTA = "1e-3"
POISSON = ["--sampler", "PoissonSampler", "--sampler.rate", "0.5"]

# key -> (label, recipe, what a client sends, where, clip, further flags)
METHODS: dict[str, tuple[str, str, str, str, float, list[str]]] = {
    "fedavg": ("FedAvg", "quickstart", "weight change", "server", 0.5, POISSON),
    "fedproto": ("FedProto", "digits_fedproto", "prototype table", "server", 5.0, POISSON),
    "fd": ("FD", "digits_fd", "per-class logit table", "server", 5.0, POISSON),
    "dsfl": (
        "DS-FL (votes)",
        "digits_dsfl",
        "votes on 50 open examples",
        "server",
        math.sqrt(50),  # 50 one-hot rows: the votes pass unscaled
        [*POISSON, "--strategy.upload", "votes", "--strategy.aggregation", "plurality", "--strategy.open_size", "50"],
    ),
    "fedtgp": ("FedTGP", "digits_fedtgp", "prototype table", "client", 5.0, []),
    "fedgh": ("FedGH", "digits_fedgh", "class representations", "client", 5.0, []),
    "ondevice_kd": ("OnDeviceKD", "digits_ondevice_kd", "weight changes of two models", "client", 1.0, []),
}


def run_cell(key: str, epsilon: str, seed: int, rounds: int | None, folder: Path) -> tuple[float, float | None]:
    """One run: the final monitored metric and the calibrated noise multiplier (None without privacy)."""
    from fl_lightning.run.arguments import fit_from_argv

    _, recipe, _, where, clip, flags = METHODS[key]
    argv = ["--config", str(ROOT / "recipes" / f"{recipe}.yaml"), "--seed", str(seed), *flags]
    argv += ["--output_dir", str(folder / f"{key}_eps{epsilon}_seed{seed}"), "--runtime.progress", "false"]
    if rounds is not None:
        argv += ["--rounds", str(rounds), "--eval_every", str(rounds)]
    if epsilon != "inf":
        argv += ["--privacy.where", where, "--privacy.clip", repr(clip), "--privacy.target_epsilon", epsilon]
        argv += ["--privacy.delta", DELTA]
    summary = fit_from_argv(argv)
    privacy = summary.get("privacy")
    return float(summary["final"][summary["monitor"]]), None if privacy is None else privacy["noise_multiplier"]


def cell(key: str, epsilon: str, seeds: list[int], rounds: int | None, folder: Path) -> str:
    """A table cell: mean and std over the seeds, and the noise multiplier; why privacy refuses the method."""
    from fl_lightning.federation.errors import ConfigError

    try:
        runs = [run_cell(key, epsilon, seed, rounds, folder) for seed in seeds]
    except ConfigError as err:
        return f"refused: {err}"
    values = [value for value, _ in runs]
    text = f"{np.mean(values):.3f}" + (f" ± {np.std(values, ddof=1):.3f}" if len(values) > 1 else "")
    z = runs[0][1]
    return text if z is None else f"{text} (z {z:.3g})"


def table(methods: list[str], epsilons: list[str], seeds: list[int], rounds: int | None, folder: Path) -> str:
    head = ["method", "uploads", "noise", "clip", *(f"ε = {e}" if e != "inf" else "no privacy" for e in epsilons)]
    lines = [
        f"Final accuracy on digits, seeds {' '.join(map(str, seeds))}, rounds {rounds or 'recipe'}, delta {DELTA}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for key in methods:
        label, _, payload, where, clip, _ = METHODS[key]
        cells = [cell(key, epsilon, seeds, rounds, folder) for epsilon in epsilons]
        lines.append("| " + " | ".join([label, payload, where, f"{clip:.3g}", *cells]) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--epsilons", nargs="+", choices=EPSILONS, default=EPSILONS)
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every run (the recipe's by default)")
    parser.add_argument("--out", type=Path, default=None, help="the Markdown file to write (printed when not given)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        text = table(args.methods, args.epsilons, args.seeds, args.rounds, Path(folder))
    if args.out is None:
        sys.stdout.write(text)
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
