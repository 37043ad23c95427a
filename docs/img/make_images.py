"""Makes the pictures of the docs, and records what each was made from in docs/img/images.json.

    python docs/img/make_images.py                # both pictures (needs Chromium: apt-get install -y chromium)
    python docs/img/make_images.py report.png     # one of them

Each picture is a screenshot, by headless Chromium, of a report built from digits runs made by this script in
a fresh folder laid out as the root of a clone (the repository's recipes/ and sweeps/), so no path in it is a
machine's:

- ``report.png``: the HTML report of the tutorial's runs, steps 1 to 5 of docs/tutorial.md (its commands, as
  written there), with the sweep tuned on a validation split (``global/val_acc``);
- ``report_table.png``: paper 001's Table 5 (``flrun report --table``) over digits runs of its methods, each
  given the CIFAR-10 row's cell with ``--reference`` (20 rounds, 2 seeds: a look at the table, not a
  reproduction).

docs/img/images.json holds, per picture, the SHA-256 of the PNG, of the report code that rendered it
(``sources``) and of the results it shows (``results``: every run's metrics and every sweep trial, times
left out), the latter per vector instruction set of PyTorch's CPU kernels (``AVX2``, ``AVX512``: the same
commands give other last digits on another set, so other results). tests/test_docs_images.py recomputes the
first two in the default suite; the slow suite recomputes the results from the same commands (the tutorial's
page test for report.png) and compares them with those of its CPU's set. A failing check means: run this
script and commit what it writes. A remade picture keeps the other sets' results only where its own set's are
unchanged; on a CPU of another set, ``--results_only`` adds that set's results without remaking the picture,
run on code known to give the recorded ones (as ``benchmarks/digits_fingerprint.py --write`` is):

    python docs/img/make_images.py --results_only    # needs no Chromium
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
IMAGES = ROOT / "docs" / "img"
RECORD = IMAGES / "images.json"

# docs/tutorial.md, steps 1 to 5, as written there (tests/test_docs_images.py checks that the page shows them)
TUTORIAL = [
    "flrun fit --config recipes/quickstart.yaml --output_dir runs/tutorial/quickstart",
    "flrun fit --config recipes/quickstart.yaml --data.init_args.partitioner.init_args.alpha 0.1 "
    "--output_dir runs/tutorial/alpha0.1",
    "flrun fit --config recipes/digits_ondevice_kd.yaml --output_dir runs/tutorial/ondevice_kd",
    "flrun fit --config recipes/digits_strong_only.yaml --output_dir runs/tutorial/strong_only",
    "flrun sweep --config sweeps/digits_quickstart.yaml",
    "flrun report runs/tutorial runs/sweeps/digits_quickstart --output runs/tutorial/report.html",
]
PAPER = "paper-001 (Lim et al., on-device KD)"
# Table 5's CIFAR-10 row: (folder, digits recipe, column, the run's metric for it, the paper's number)
TABLE_CELLS = [
    ("fedavg", "digits_weak_only.yaml", "FedAvg (homo)", "aux/test_acc", 0.5747),
    ("moon", "digits_moon.yaml", "MOON (homo)", "small/test_acc", 0.5838),
    ("feddf", "digits_feddf.yaml", "FedDF (homo)", "small/test_acc", 0.4162),
    ("dsfl", "digits_dsfl.yaml", "DS-FL (hetero)", "personal/strong/test_acc", 0.2595),
    ("fedmd", "digits_fedmd.yaml", "FedMD (hetero)", "personal/strong/test_acc", 0.6113),
    ("fedgems", "digits_fedgems.yaml", "FedGEM (hetero)", "server/test_acc", 0.3427),
    ("kd", "digits_ondevice_kd.yaml", "Proposed (hetero)", "target/test_acc", 0.6243),
]


def table_commands() -> list[list[str]]:
    """The runs of report_table.png (2 seeds x Table 5's methods, 20 rounds each) and the table's report."""
    runs = []
    for seed in (0, 1):
        for folder, recipe, column, metric, paper in TABLE_CELLS:
            cell = {"paper": PAPER, "table": "Table 5", "row": "CIFAR-10", "column": column, "metrics": {metric: paper}}
            fit = f"flrun fit --config recipes/{recipe} --rounds 20 --seed {seed} --output_dir runs/table_demo/{folder}"
            runs.append([*f"{fit}/seed{seed}".split(), "--reference", json.dumps(cell)])
    report = "flrun report runs/table_demo --table paper-001/table-5 --output runs/table_demo/table5.html"
    return [*runs, report.split()]


# per picture: its commands, the folders whose results it shows, the page it screenshots, the window's width
PICTURES = {
    "report.png": (
        [c.split() for c in TUTORIAL],
        ["runs/tutorial", "runs/sweeps/digits_quickstart"],
        "runs/tutorial/report.html",
        1280,
    ),  # fmt: skip
    "report_table.png": (table_commands(), ["runs/table_demo"], "runs/table_demo/table5.html", 1440),
}


def clone_root(folder: Path) -> Path:
    """``folder`` laid out as a clone's root, as the commands expect it."""
    for name in ("recipes", "sweeps"):
        shutil.copytree(ROOT / name, folder / name)
    return folder


def run_commands(commands: list[list[str]], folder: Path) -> None:
    env = {
        **os.environ,
        "WANDB_MODE": "offline",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    for argv in commands:
        print("$", " ".join(argv), flush=True)
        done = subprocess.run(argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            raise SystemExit(f"{done.stdout[-3000:]}\nmake_images.py: `{' '.join(argv)}` failed ({done.returncode}).")


def results_digest(folder: Path, roots: list[str]) -> str:
    """SHA-256 of the results under ``roots``: each run's metrics.csv and each sweep's trials.csv, without the
    columns that measure time, numbers to 4 decimals (as the reports show them). Same runs, same digest."""
    digest = hashlib.sha256()
    for root in roots:
        for path in sorted((folder / root).rglob("*.csv")):
            if path.name not in ("metrics.csv", "trials.csv"):
                continue
            digest.update(str(path.relative_to(folder)).encode() + b"\n")
            for row in csv.DictReader(path.open()):
                kept = {k: _rounded(v) for k, v in row.items() if not _timing(k)}
                digest.update(json.dumps(kept, sort_keys=True).encode() + b"\n")
    return digest.hexdigest()


def _timing(column: str) -> bool:
    return column.startswith("time/") or column in ("seconds", "output_dir", "error")


def _rounded(value: str) -> str:
    try:
        return f"{float(value):.4f}"
    except ValueError:
        return value


def sources_digest() -> str:
    """SHA-256 of what renders the reports (fl_lightning/report/ but its W&B Report builder) and of this script."""
    report = ROOT / "fl_lightning" / "report"
    files = [p for p in sorted(report.rglob("*")) if p.is_file() and p.suffix in (".py", ".j2", ".css")]
    files = [p for p in files if p.name != "wandb_report.py"] + [Path(__file__).resolve()]
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(ROOT)).encode() + b"\n" + path.read_bytes())
    return digest.hexdigest()


def kernels() -> str:
    """The vector instruction set of PyTorch's CPU kernels on this machine (``AVX2``, ``AVX512``, ...)."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def screenshot(html: Path, png: Path, width: int) -> None:
    """The whole page at ``width`` pixels, reduced to 3/4 and 64 colours."""
    from PIL import Image, ImageChops

    browser = next(
        (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None
    )
    if browser is None:
        raise SystemExit("make_images.py needs Chromium for its screenshots: apt-get install -y chromium (Debian).")
    raw = html.with_suffix(".raw.png")
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--hide-scrollbars", f"--screenshot={raw}",
                    f"--window-size={width},12000", html.as_uri()], check=True, capture_output=True)  # fmt: skip
    image = Image.open(raw).convert("RGB")
    content = ImageChops.difference(image, Image.new("RGB", image.size, "white")).getbbox()
    image = image.crop((0, 0, width, min(image.height, content[3] + 24)))  # the page, without the window's rest
    small = image.resize((width * 3 // 4, image.height * 3 // 4), Image.LANCZOS)
    small.quantize(64).save(png, optimize=True)


def make(name: str, picture: bool = True) -> str:
    """Runs the picture's commands in a fresh folder, screenshots its page unless ``picture`` is false, and
    returns the digest of the results."""
    commands, roots, page, width = PICTURES[name]
    with tempfile.TemporaryDirectory(prefix="fl-lightning-") as tmp:
        folder = clone_root(Path(tmp))
        run_commands(commands, folder)
        if picture:
            screenshot(folder / page, IMAGES / name, width)
        return results_digest(folder, roots)


def record_picture(name: str, previous: dict) -> dict:
    """The record of the picture made anew; ``previous`` is its last record. Other instruction sets' results
    are kept when this CPU's are those recorded for it (the code gives the numbers it gave), else dropped."""
    results = make(name)
    others = previous.get("results_sha256", {})
    if others.get(kernels()) != results:
        others = {}
    return {
        "command": f"python docs/img/make_images.py {name}",
        "png_sha256": file_digest(IMAGES / name),
        "sources_sha256": sources_digest(),
        "kernels": kernels(),  # the set the picture's runs used
        "results_sha256": {**others, kernels(): results},
    }


def record_results(name: str, record: dict) -> dict:
    """``record`` with this CPU's results of the picture's commands added; the picture stays as it is. Run on
    code known to give the recorded results (the commit that made the picture, or main before a change)."""
    return {**record, "results_sha256": {**record["results_sha256"], kernels(): make(name, picture=False)}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pictures", nargs="*", metavar="PICTURE", help=f"one of {', '.join(PICTURES)} (default: all)")
    parser.add_argument(
        "--results_only",
        action="store_true",
        help="record the results this CPU's kernels give (another instruction set), not the picture",
    )
    args = parser.parse_args(argv)
    unknown = [name for name in args.pictures if name not in PICTURES]
    if unknown:
        parser.error(f"no picture {unknown[0]}; the pictures are {', '.join(PICTURES)}.")
    record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
    for name in args.pictures or list(PICTURES):
        if args.results_only:
            if name not in record:
                parser.error(
                    f"docs/img/{name} is not recorded yet; make it first: python docs/img/make_images.py {name}"
                )
            record[name] = record_results(name, record[name])
            done = f"{kernels()} kernels' results"
        else:
            record[name], done = record_picture(name, record.get(name, {})), "made"
        RECORD.write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        print(f"{IMAGES / name}: {done}; recorded in {RECORD.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
