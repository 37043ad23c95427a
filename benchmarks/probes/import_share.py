"""Import share of a digits quickstart run: ``python -X importtime`` totals, which a shared CPU inflates less
than wall time, and the module count, which it does not change at all.

    python benchmarks/probes/import_share.py              # a table: median of --repeat fresh runs
    python benchmarks/probes/import_share.py --json       # one JSON object
    python benchmarks/probes/import_share.py --root DIR   # another checkout (e.g. `git archive` of an older commit)

Each run is ``flrun fit --config recipes/quickstart.yaml --rounds 2`` (a run imports nothing after its first
round: tests/test_startup.py). ``import_s`` sums the cumulative times of the top-level imports, whenever in
the run they happen (lazy imports inside functions included); ``packages`` gives the cumulative seconds of
the packages that dominate, where imported.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "torch",
    "torch._dynamo",
    "lightning",
    "lightning_fabric",
    "torchmetrics",
    "torchvision",
    "transformers",
    "scipy.signal",
    "sklearn",
    "pandas",
)
LINE = re.compile(r"import time:\s+\d+ \|\s+(\d+) \| ( *)(\S+)")  # indent 0: a top-level import


def parse_importtime(stderr: str) -> dict:
    """Top-level total seconds, module count and per-package cumulative seconds of ``-X importtime`` output."""
    rows = [(int(m.group(1)), len(m.group(2)), m.group(3)) for m in map(LINE.match, stderr.splitlines()) if m]
    packages = {}
    for cumulative_us, _, name in rows:
        if name in PACKAGES and name not in packages:  # a module is imported once: its first line is its import
            packages[name] = round(cumulative_us / 1e6, 3)
    return {
        "import_s": round(sum(us for us, indent, _ in rows if indent == 0) / 1e6, 3),
        "modules": len(rows),
        "packages": packages,
    }


def measure(root: Path, scratch: Path) -> dict:
    argv = [sys.executable, "-X", "importtime", "-m", "fl_lightning", "fit", "--config", "recipes/quickstart.yaml"]
    argv += ["--rounds", "2", "--runtime.progress", "false", "--output_dir", str(scratch)]
    env = dict(os.environ, WANDB_MODE="offline")
    # `python -m fl_lightning` from root imports root's package (the current directory comes first)
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"the run failed ({done.returncode}): {done.stderr[-500:]}")
    return parse_importtime(done.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh runs (the median counts)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [measure(args.root, Path(tmp) / f"run{i}") for i in range(args.repeat)]
    middle = sorted(runs, key=lambda run: run["import_s"])[len(runs) // 2]
    result = {
        "import_s_median": statistics.median(run["import_s"] for run in runs),
        "import_s_all": [run["import_s"] for run in runs],
        "modules": middle["modules"],
        "packages": middle["packages"],
        "load_average": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print(
        f"import share {result['import_s_median']:.2f} s (median of {result['import_s_all']}), "
        f"{result['modules']} modules"
    )
    for name, seconds in middle["packages"].items():
        print(f"  {seconds:6.2f} s  {name}")
    print(f"(1-minute load average {result['load_average'][0]:.2f} before, {result['load_average'][1]:.2f} after)")


if __name__ == "__main__":
    main()
