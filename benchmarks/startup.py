"""Wall time of the commands a newcomer types first, each the best of ``--repeat`` fresh processes.

    python benchmarks/startup.py              # a table
    python benchmarks/startup.py --json       # one JSON object, seconds per command
    python benchmarks/startup.py --root DIR   # another checkout (e.g. `git archive` of an older commit)

``import torch`` alone is measured next to them: it is the floor of every command that builds the parser
(jsonargparse resolves the torch types in ``flrun fit``'s signature). ``flrun models``, ``flrun fit --help``
once its text is stored, and the misspelled option below answer without building it. ``import lightning`` is what a run
would add if it imported all of Lightning (its torchmetrics import pulls in torchvision, transformers and
scipy); a run imports Fabric alone (``fl_lightning/fabric_loader.py``), and ``benchmarks/probes/import_share.py``
breaks a run's imports down. Run it
on an otherwise idle machine: on a shared one the numbers only bound the idle ones from above.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FLRUN = [sys.executable, "-m", "fl_lightning"]


def commands(scratch: Path) -> dict[str, list[str]]:
    quickstart = ["fit", "--config", "recipes/quickstart.yaml", "--runtime.progress", "false"]
    return {
        "python -c 'import torch'": [sys.executable, "-c", "import torch"],
        "python -c 'import lightning'": [sys.executable, "-c", "import lightning"],
        "flrun --help": [*FLRUN, "--help"],
        "flrun models": [*FLRUN, "models"],
        "flrun fit --help": [*FLRUN, "fit", "--help"],  # the help text stored by an earlier call
        "flrun fit --help (empty help cache: renders and stores it)": [*FLRUN, "fit", "--help"],
        # --roundz, not --round: older versions took --round as an abbreviation of --rounds and trained
        "flrun fit --config recipes/quickstart.yaml --roundz 10 (misspelled)": [
            *FLRUN,
            "fit",
            "--config",
            "recipes/quickstart.yaml",
            "--roundz",
            "10",
        ],
        "flrun fit --config recipes/quickstart.yaml --output_dir D --runtime.progress false": [
            *FLRUN,
            *quickstart,
            "--output_dir",
            str(scratch / "quickstart"),
        ],
    }


def best_time(
    argv: list[str], repeat: int, scratch: Path, root: Path, expected_code: int, fresh_cache: bool = False
) -> float:
    """The fastest of ``repeat`` runs, each in a fresh run directory (and, with ``fresh_cache``, an empty cache
    directory: ``flrun fit --help`` then renders its text); a run that fails is an error."""
    times = []
    for i in range(repeat):
        env = dict(os.environ, WANDB_MODE="offline")
        if fresh_cache:
            env["XDG_CACHE_HOME"] = str(scratch / f"cache{i}")
        if "--output_dir" in argv:  # a fresh run each time, not a refused start in an existing run
            argv = [*argv[:-1], str(scratch / f"quickstart{i}")]
        start = time.perf_counter()
        # `python -m fl_lightning` from root imports root's package (the current directory comes first)
        done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, check=False)
        times.append(time.perf_counter() - start)
        if done.returncode != expected_code:
            raise SystemExit(f"{' '.join(argv)} exited {done.returncode}, not {expected_code}: {done.stderr[-500:]}")
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3, help="fresh processes per command (the best counts)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to measure (default: this one)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        results = {
            name: round(
                best_time(
                    argv, args.repeat, scratch, args.root, 2 if "misspelled" in name else 0, "empty help cache" in name
                ),
                2,
            )
            for name, argv in commands(scratch).items()
        }
    if args.json:
        print(json.dumps(results, indent=2))
        return
    for name, seconds in results.items():
        print(f"{seconds:6.2f} s  {name}")
    load_after = os.getloadavg()[0]
    print(f"(best of {args.repeat} runs each; 1-minute load average {load_before:.2f} before, {load_after:.2f} after)")


if __name__ == "__main__":
    main()
