"""Runs every digits recipe with several seeds and prints mean and spread of its main accuracy.

    python benchmarks/digits_table.py --seeds 0 1 2 > table.md

The numbers in docs/algorithms.md come from this script (measured on CPU, not asserted anywhere).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
RECIPES = [
    "quickstart",
    "digits_fedhe",
    "digits_fedhe_async",
    "digits_weak_only",
    "digits_strong_only",
    "digits_ondevice_kd",
    "digits_fedadam",
    "digits_periodic_codist",
    "digits_merged_codist",
    "digits_felo",
    "digits_velo",
    "digits_fedgh",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--recipes", nargs="+", default=RECIPES)
    args = parser.parse_args()
    print("| recipe | metric | mean | std | per seed | wall s (mean) |")
    print("|---|---|---|---|---|---|")
    for recipe in args.recipes:
        results, walls, monitor, extra = [], [], None, {}
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "run"
                subprocess.run(
                    [
                        sys.executable,
                        "-m",
                        "fl_lightning",
                        "fit",
                        "--config",
                        str(ROOT / "recipes" / f"{recipe}.yaml"),
                        "--seed",
                        str(seed),
                        "--output_dir",
                        str(out),
                        "--runtime.progress",
                        "false",
                    ],
                    check=True,
                    capture_output=True,
                )
                summary = json.loads((out / "summary.json").read_text())
            monitor = summary["monitor"]
            results.append(summary["final"][monitor])
            walls.append(summary["wall_time_s"])
            for key, value in summary["final"].items():
                if key.endswith("test_acc") and key != monitor:
                    extra.setdefault(key, []).append(value)
        others = "; ".join(f"{k} {np.mean(v):.3f}" for k, v in extra.items())
        print(
            f"| {recipe} | {monitor} | {np.mean(results):.3f} | {np.std(results):.3f} | "
            f"{', '.join(f'{r:.3f}' for r in results)} | {np.mean(walls):.1f} |" + (f" {others}" if others else ""),
            flush=True,
        )


if __name__ == "__main__":
    main()
