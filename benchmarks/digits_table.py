"""The papers' comparison tables on digits, and every digits recipe's final accuracy, for docs/algorithms.md.

    python benchmarks/digits_table.py --write                     # every table, seeds 0 1 2, into the docs
    python benchmarks/digits_table.py --write --tables paper-004  # only the tables whose id starts so
    python benchmarks/digits_table.py --write --tables htfllib    # HtFLlib's methods with their cost columns
    python benchmarks/digits_table.py --check                     # re-runs a few rows, exit 1 on a difference
    python benchmarks/digits_table.py --write --rows digits_moon "MOON (homo)"  # re-measures these rows only
    python benchmarks/digits_table.py --rounds 2 --seeds 0 --rows digits_moon digits_feddf  # a quick look (prints)

Each paper's table runs the methods of its comparison table that exist, each on the digits recipe of
the paper's set-up (a method without its own digits recipe in that set-up runs the set-up's recipe with
its strategy swapped in: a variant recipe built on it with ``base:``). A cell is the final-round value,
mean and sample std over seeds, then every seed's value; the ranking line says whether the paper's own
method is above every other row, per metric that ranks (accuracies). Runs are deterministic on CPUs whose
PyTorch kernels use the same vector instructions (each block records the set it was measured with: AVX2,
AVX512; another set rounds sums in another order and gives other last digits), so on such a CPU
``--check`` re-runs the rows named by ``--rows`` (default: ``DEFAULT_CHECK``, in every block that has
them) with the seeds and rounds the docs record, and fails if a row's text differs (its values are
printed to the third decimal, the communication in KiB to the second). ``--write --rows`` re-measures the named
rows in every block that has them, with the seeds and rounds the block records, and redoes the ranking
lines from the rows as the docs then print them (each seed's value).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "algorithms.md"
KIB = "comm/kib_per_client_round"
GFLOPS = "compute/gflops_per_client_round"  # local training GFLOPs per client and round (client/flops.py)
COST = (KIB, GFLOPS)  # derived from a run's traffic and compute: less is better, never ranked
HTFL = ["personal/test_acc", KIB, GFLOPS]


def _strategy(name: str, **args) -> dict:
    return {"strategy": {"class_path": f"fl_lightning.strategies.{name}", "init_args": args}}


# id -> title, column labels, rows (label, recipe, overrides or None, one metric per column); the last row
# is the paper's own method, ranked against the others.
TABLES = {
    "paper-000/sec-v-d": (
        (
            "Paper 000 (FedHe), Sec. V-D, heterogeneous models, in `digits_fedhe`'s set-up (12 clients, three "
            "architectures, half of them per round, Dirichlet 0.5, 300 rounds of 3 batches). FedMD holds 10% of the "
            "pool as its labeled public set, aligns n = 10 examples per round (paper 000) and digests with a KL at "
            "T = 1 after 5 + 5 transfer epochs, as `digits_fedmd`."
        ),
        ["personal/test_acc"],
        [
            ("Private", "digits_fedhe", _strategy("Standalone"), ["personal/test_acc"]),
            (
                "FedMD",
                "digits_fedhe",
                {
                    "data": {"init_args": {"server_fraction": 0.1}},
                    **_strategy("FedMD", public_size=10, public_epochs=5, private_epochs=5, digest_loss="kl"),
                },
                ["personal/test_acc"],
            ),
            ("FedHe", "digits_fedhe", None, ["personal/test_acc"]),
        ],
    ),
    "paper-001/table-5": (
        (
            "Paper 001, Table 5, in its digits set-up (20 clients, 4 strong with the full CNN, 10 per round, "
            "Dirichlet 0.3, half of every client's data unlabeled, 60 rounds); the compared model: the small one "
            "for the homogeneous methods, the strong clients' full-size models for DS-FL and FedMD, FedGEM's "
            "full-size server model, the target for the proposed method."
        ),
        ["accuracy"],
        [
            ("FedAvg (homo)", "digits_weak_only", None, ["aux/test_acc"]),
            ("MOON (homo)", "digits_moon", None, ["small/test_acc"]),
            ("FedDF (homo)", "digits_feddf", None, ["small/test_acc"]),
            ("DS-FL (hetero)", "digits_dsfl", None, ["personal/strong/test_acc"]),
            ("FedMD (hetero)", "digits_fedmd", None, ["personal/strong/test_acc"]),
            ("FedGEM (hetero)", "digits_fedgems", None, ["server/test_acc"]),
            ("Proposed (hetero)", "digits_ondevice_kd", None, ["target/test_acc"]),
        ],
    ),
    "paper-002/table-1": (
        "Paper 002, Table 1, in its digits set-up (a small and a large pool, `digits_fedadam`).",
        ["large/test_acc", "small/test_acc"],
        [
            ("FedAdam", "digits_fedadam", None, ["large/test_acc", "small/test_acc"]),
            ("MergedCodist", "digits_merged_codist", None, ["large/test_acc", "small/test_acc"]),
            ("PeriodicCodist", "digits_periodic_codist", None, ["large/test_acc", "small/test_acc"]),
        ],
    ),
    "paper-003/table-3": (
        (
            "Paper 003, Table 3 (with Figure 4's FedMD and HeteroFL), in `digits_felo`'s set-up (12 clients, three "
            "architectures with 64-d features, half of them per round, Dirichlet 0.5, 60 rounds of 10 batches). "
            "FedMD holds 10% of the pool as its labeled public set (Sec. 4) with `digits_fedmd`'s digest; HeteroFL "
            "runs `digits_heterofl` (one CNN sliced at five rates, its own optimizer) and FedGKT `digits_fedgkt` "
            "(one small CNN per client, a server MLP on its features, every client every round as paper 003 "
            "runs it) on the same number of clients and rounds; as in the paper, HeteroFL reports its global "
            "model and FedGKT its server side, the others the mean over clients."
        ),
        ["accuracy"],
        [
            ("FedHe", "digits_felo", _strategy("FedHe", alpha=1.0, plus_one=True), ["personal/test_acc"]),
            (
                "FedMD",
                "digits_felo",
                {
                    "data": {"init_args": {"server_fraction": 0.1}},
                    **_strategy("FedMD", public_size=None, public_epochs=5, private_epochs=5, digest_loss="kl"),
                },
                ["personal/test_acc"],
            ),
            (
                "HeteroFL",
                "digits_heterofl",
                {
                    "rounds": 60,
                    "eval_every": 10,
                    "population": {"num_clients": 12, "tiers": [{"name": "all", "roles": ["a", "b", "c", "d", "e"]}]},
                    "sampler": {"init_args": {"fraction": 0.5}},
                },
                ["a/test_acc"],
            ),
            (
                "FedGKT",
                "digits_fedgkt",
                {"rounds": 60, "eval_every": 10, "population": {"num_clients": 12}},
                ["server/test_acc"],
            ),
            ("Felo", "digits_felo", None, ["personal/test_acc"]),
            ("Velo", "digits_velo", None, ["personal/test_acc"]),
        ],
    ),
    "paper-004/table-3": (
        (
            "Paper 004, Table 3, in `digits_fedgh`'s set-up (15 clients, three architectures with a 64-d "
            "representation, 2 classes each, all of them every round, 40 rounds; personal models on their local "
            "test splits), with the communication column (KiB down and up per client and round)."
        ),
        ["personal/test_acc", KIB],
        [
            ("Standalone", "digits_fedgh", _strategy("Standalone", split="test"), ["personal/test_acc", KIB]),
            ("FML", "digits_fml", None, ["personal/test_acc", KIB]),
            ("FedKD", "digits_fedkd", None, ["personal/test_acc", KIB]),
            ("LG-FedAvg", "digits_lg_fedavg", None, ["personal/test_acc", KIB]),
            ("FD", "digits_fedgh", _strategy("FD", lam=1.0, temperature=1.0, split="test"), ["personal/test_acc", KIB]),
            ("FedProto", "digits_fedproto", None, ["personal/test_acc", KIB]),
            ("FedGH", "digits_fedgh", None, ["personal/test_acc", KIB]),
        ],
    ),
    "htfllib/suite": (
        (
            "HtFLlib's methods (the suite of the FedKTL paper's comparison table; Local is `Standalone`, FedDistill "
            "is `FD`), in `digits_fedgh`'s set-up (15 clients, three architectures with a 64-d representation, 2 "
            "classes each, all of them every round, 40 rounds; personal models on their local test splits), with "
            "the trade-off columns: KiB down and up and local training GFLOPs (an estimate: each model's step "
            "counted once, times the steps), per client and round. FedKTL, the FedKTL paper's own method, is the "
            "ranked row."
        ),
        HTFL,
        [
            # one line per method: its own digits recipe when it is in digits_fedgh's set-up, else digits_fedgh
            # with its strategy swapped in; a row whose recipe or strategy does not exist yet is listed as such
            ("Local", "digits_fedgh", _strategy("Standalone", split="test"), HTFL),
            ("FD", "digits_fedgh", _strategy("FD", lam=1.0, temperature=1.0, split="test"), HTFL),
            ("FML", "digits_fml", None, HTFL),
            ("LG-FedAvg", "digits_lg_fedavg", None, HTFL),
            ("FedGen", "digits_fedgen", None, HTFL),
            ("FedProto", "digits_fedproto", None, HTFL),
            ("FedKD", "digits_fedkd", None, HTFL),
            ("FedGH", "digits_fedgh", None, HTFL),
            ("FedTGP", "digits_fedtgp", None, HTFL),
            ("FedMRL", "digits_fedmrl", None, HTFL),
            ("FedL2G", "digits_fedl2g", None, HTFL),
            ("FedPCL", "digits_fedpcl", None, HTFL),
            ("FedKTL", "digits_fedktl", None, HTFL),
        ],
    ),
}
ALL_RECIPES = "all-digits-recipes"
# checked by default: the papers' own methods of two tables and the recipe whose earlier table did not reproduce
DEFAULT_CHECK = ["Proposed (hetero)", "FedGH", "digits_fedhe"]


def kernels() -> str:
    """The vector instruction set of PyTorch's CPU kernels here (``AVX2``, ``AVX512``, ...): float sums round in
    another order on another set, so a block records the set it was measured with."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def begin_marker(table: str, seeds: list[int], rounds: int | None, measured_with: str) -> str:
    rounds_text = "recipe" if rounds is None else str(rounds)
    seeds_text = " ".join(map(str, seeds))
    return f"<!-- digits-table {table}: seeds {seeds_text}; rounds {rounds_text}; kernels {measured_with} -->"


END_MARKER = "<!-- end of digits-table -->"
BLOCK = re.compile(
    r"<!-- digits-table (\S+): seeds ([\d ]+); rounds (\w+)(?:; kernels (\w+))? -->\n(.*?)" + re.escape(END_MARKER),
    re.DOTALL,
)


def other_kernels(table_id: str, measured_with: str | None) -> str | None:
    """Why a block cannot be checked or extended on this CPU (measured with other kernels), else None."""
    if measured_with == kernels():
        return None
    return (
        f"{table_id} was measured with {measured_with or 'unrecorded'} kernels and this CPU's PyTorch kernels are "
        f"{kernels()}, whose sums round to other last digits: check or extend it on a CPU with "
        f"{measured_with or 'its'} kernels, or write the whole table again here (--write --tables {table_id})."
    )


def run_once(recipe: str, overrides: dict | None, seed: int, rounds: int | None) -> tuple[dict, dict]:
    """One in-process run: its summary and its traffic and compute per client and round (the cost columns)."""
    from fl_lightning.cli.commands import fit_from_argv
    from fl_lightning.report.runs import load_run, measured_value

    with tempfile.TemporaryDirectory() as tmp:
        config = ROOT / "recipes" / f"{recipe}.yaml"
        if overrides:
            config = Path(tmp) / f"{recipe}_variant.yaml"
            config.write_text(json.dumps({"base": str(ROOT / "recipes" / f"{recipe}.yaml"), **overrides}))
        out = Path(tmp) / "run"
        argv = ["--config", str(config), "--seed", str(seed), "--output_dir", str(out), "--runtime.progress", "false"]
        if rounds is not None:
            argv += ["--rounds", str(rounds), "--eval_every", str(rounds)]
        summary = fit_from_argv(argv)
        run = load_run(out)
        return summary, {metric: measured_value(run, metric) for metric in COST}


def measure(recipe, overrides, metrics, seeds, rounds) -> dict[str, list[float | None]]:
    values: dict[str, list[float | None]] = {m: [] for m in metrics}
    for seed in seeds:
        summary, derived = run_once(recipe, overrides, seed, rounds)
        for metric in metrics:
            values[metric].append(derived[metric] if metric in derived else summary["final"].get(metric))
        print(f"  {recipe} seed {seed}: " + ", ".join(f"{m} {values[m][-1]}" for m in metrics), file=sys.stderr)
    return values


def cell(values: list[float | None], metric: str) -> str:
    """``0.955 ± 0.012 (0.968, 0.959, 0.939)``: mean, sample std over seeds (none for one seed), each seed."""
    known = [v for v in values if v is not None]
    if not known:
        return "n/a"
    digits = 2 if metric == KIB else 3
    mean = f"{np.mean(known):.{digits}f}" + (f" ± {np.std(known, ddof=1):.{digits}f}" if len(known) > 1 else "")
    return f"{mean} ({', '.join('n/a' if v is None else f'{v:.{digits}f}' for v in values)})"


def _available(row) -> bool:
    from fl_lightning import strategies

    overrides = row[2] or {}
    name = overrides.get("strategy", {}).get("class_path", "").rsplit(".", 1)[-1]
    return (ROOT / "recipes" / f"{row[1]}.yaml").is_file() and (not name or hasattr(strategies, name))


def comparison_row(row, seeds, rounds) -> tuple[str, dict]:
    """One method's Markdown row and its values per metric."""
    label, recipe, overrides, metrics = row
    values = measure(recipe, overrides, metrics, seeds, rounds)
    name = f"`{recipe}`" + (" with its " + " and ".join(sorted(overrides)) + " changed" if overrides else "")
    return f"| {label} | {name} | " + " | ".join(cell(values[m], m) for m in metrics) + " |", values


def comparison_table(table_id: str, seeds, rounds) -> str:
    """The Markdown of one paper's digits table: a row per available method and the ranking line."""
    title, columns, rows = TABLES[table_id]
    header = ["method", "recipe", *columns]
    lines = [title, "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    measured, missing = {}, []
    for row in rows:
        if not _available(row):
            missing.append(row[0])
            continue
        line, measured[row[0]] = comparison_row(row, seeds, rounds)
        lines.append(line)
    lines += ["", ranking_line(rows, measured)]
    if missing:
        lines.append(f"Not yet implemented: {', '.join(missing)}.")
    return "\n".join(lines)


def ranking_line(rows, measured: dict) -> str:
    """Whether the paper's own method (the last row) is above every other row, per accuracy column."""
    own, metrics = rows[-1][0], rows[-1][3]
    if own not in measured or len(measured) < 2:
        return "Ranking: not enough rows measured."
    parts = []
    for i, metric in enumerate(metrics):
        if metric in COST:  # less is better, and the papers claim no order on it
            continue
        means = {}
        for label, _, _, row_metrics in rows:
            known = [v for v in measured.get(label, {}).get(row_metrics[i], []) if v is not None]
            if known:
                means[label] = float(np.mean(known))
        column = f" ({metric})" if len(metrics) > 1 else ""
        if own not in means or len(means) < 2:
            parts.append(f"{own}{column}: not enough rows measured")
            continue
        rivals = [label for label, mean in means.items() if label != own and mean >= means[own]]
        verdict = "holds" if not rivals else f"fails ({', '.join(rivals)} as high or higher)"
        parts.append(f"{own} above every other row{column}: {verdict}")
    return "Ranking (means over seeds): " + "; ".join(parts) + "."


def digits_recipes() -> list[str]:
    return ["quickstart"] + sorted(p.stem for p in (ROOT / "recipes").glob("digits_*.yaml"))


def recipe_row(recipe: str, seeds, rounds) -> str:
    """A recipe's monitored metric (mean, std, per seed) and the means of its other accuracies."""
    results, monitor, extra = [], None, {}
    for seed in seeds:
        summary, _ = run_once(recipe, None, seed, rounds)
        monitor = summary["monitor"]
        results.append(summary["final"].get(monitor))
        for key, value in summary["final"].items():
            if key.endswith("test_acc") and key != monitor:
                extra.setdefault(key, []).append(value)
        print(f"  {recipe} seed {seed}: {monitor} {results[-1]}", file=sys.stderr)
    others = "; ".join(f"{k} {np.mean(v):.3f}" for k, v in extra.items())
    return f"| {recipe} | {monitor} | {cell(results, monitor)} | {others} |"


def recipes_table(seeds, rounds) -> str:
    lines = [
        "Every digits recipe as it stands (its monitored metric; other accuracies as means over seeds):",
        "",
        "| recipe | metric | final: mean ± std (per seed) | other accuracies (mean) |",
        "|---|---|---|---|",
    ]
    return "\n".join(lines + [recipe_row(recipe, seeds, rounds) for recipe in digits_recipes()])


def generate(table_id: str, seeds, rounds) -> str:
    return recipes_table(seeds, rounds) if table_id == ALL_RECIPES else comparison_table(table_id, seeds, rounds)


def regenerate_row(table_id: str, label: str, seeds, rounds) -> str | None:
    """The Markdown row ``label`` of ``table_id`` measured again, or None when the table has no such row."""
    if table_id == ALL_RECIPES:
        return recipe_row(label, seeds, rounds) if label in digits_recipes() else None
    for row in TABLES[table_id][2]:
        if row[0] == label and _available(row):
            return comparison_row(row, seeds, rounds)[0]
    return None


def blocks(text: str) -> dict[str, tuple[list[int], int | None, str | None, str, re.Match]]:
    """The generated blocks of the docs: table id -> seeds, rounds, kernels, content, match."""
    found = {}
    for match in BLOCK.finditer(text):
        rounds = None if match.group(3) == "recipe" else int(match.group(3))
        seeds = [int(s) for s in match.group(2).split()]
        found[match.group(1)] = (seeds, rounds, match.group(4), match.group(5), match)
    return found


def write(docs: Path, tables: list[str], seeds, rounds) -> None:
    text = docs.read_text()
    for table_id in tables:
        found = blocks(text)
        if table_id not in found:
            sys.exit(
                f"{docs} has no block for {table_id}: add '{begin_marker(table_id, seeds, rounds, kernels())}' and "
                f"'{END_MARKER}' lines where the table belongs."
            )
        match = found[table_id][4]
        marker = begin_marker(table_id, seeds, rounds, kernels())
        fresh = f"{marker}\n{generate(table_id, seeds, rounds)}\n{END_MARKER}"
        text = text[: match.start()] + fresh + text[match.end() :]
        docs.write_text(text)  # after every table, so an interrupted run keeps what it measured
        print(f"wrote {table_id} into {docs}", file=sys.stderr)


def _printed_values(cell_text: str) -> list[float | None]:
    """Each seed's value of a printed cell, ``0.955 ± 0.012 (0.968, 0.959, 0.939)`` -> [0.968, 0.959, 0.939]."""
    inner = cell_text[cell_text.find("(") + 1 : cell_text.rfind(")")] if "(" in cell_text else cell_text
    return [None if v.strip() == "n/a" else float(v) for v in inner.split(",")]


def _with_new_recipe_rows(lines: list[str], labels: list[str]) -> list[str]:
    """The every-recipe block's lines with a placeholder row for each recipe of ``labels`` it lacks, placed as
    :func:`digits_recipes` orders them (the caller measures it like any named row)."""
    order = digits_recipes()
    listed = {line.split(" | ")[0][2:] for line in lines if line.startswith("| ")}
    for recipe in (label for label in labels if label in order and label not in listed):
        rows = [i for i, line in enumerate(lines) if line.startswith("| ") and line.split(" | ")[0][2:] in order]
        after = [i for i in rows if order.index(lines[i].split(" | ")[0][2:]) < order.index(recipe)]
        at = (after[-1] + 1) if after else (rows[0] if rows else len(lines))
        lines = [*lines[:at], f"| {recipe} | not measured |", *lines[at:]]
    return lines


def write_rows(docs: Path, tables: list[str], labels: list[str]) -> int:
    """Re-measures the rows ``labels`` of the blocks of ``tables`` (their recorded seeds and rounds) and writes
    them into ``docs``, with each comparison table's ranking line redone from the rows as printed. A block
    measured with other CPU kernels is left as it is (its rows would mix two sets' digits) and said so."""
    written = 0
    for table_id in tables:
        found = blocks(docs.read_text())
        if table_id not in found:
            continue
        seeds, rounds, measured_with, content, match = found[table_id]
        if (why := other_kernels(table_id, measured_with)) is not None:
            print(why, file=sys.stderr)
            continue
        lines = content.splitlines()
        if table_id == ALL_RECIPES:  # a recipe added since the block was written gets its row, in name order
            lines = _with_new_recipe_rows(lines, labels)
        for i, line in enumerate(lines):
            label = line.split(" | ")[0][2:] if line.startswith("| ") else None
            if label in labels:
                fresh = regenerate_row(table_id, label, seeds, rounds)
                if fresh is not None:
                    lines[i], written = fresh, written + 1
        if table_id != ALL_RECIPES:
            rows = TABLES[table_id][2]
            measured = {}
            for line in lines:
                cells = [c.strip() for c in line.strip("|").split("|")] if line.startswith("| ") else []
                row = next((r for r in rows if cells and r[0] == cells[0]), None)
                if row is not None:
                    measured[row[0]] = {m: _printed_values(v) for m, v in zip(row[3], cells[2:])}
            lines = [ranking_line(rows, measured) if line.startswith("Ranking") else line for line in lines]
        text = docs.read_text()
        match = blocks(text)[table_id][4]
        marker = begin_marker(table_id, seeds, rounds, kernels())
        fresh_block = f"{marker}\n" + "\n".join(lines) + f"\n{END_MARKER}"
        docs.write_text(text[: match.start()] + fresh_block + text[match.end() :])
    print(f"re-measured {written} rows in {docs}", file=sys.stderr)
    return 0 if written else 1


def check(docs: Path, tables: list[str], labels: list[str]) -> int:
    """Re-runs the rows ``labels`` of the blocks of ``tables`` with the seeds and rounds each records; returns 1
    if any row differs from the docs (or none was found), 2 if the rows are in blocks measured with other CPU
    kernels only, else 0."""
    failures, checked, elsewhere = [], 0, []
    for table_id, (seeds, rounds, measured_with, content, _) in blocks(docs.read_text()).items():
        if table_id not in tables:
            continue
        rows = {line.split(" | ")[0][2:]: line for line in content.splitlines() if line.startswith("| ")}
        if any(label in rows for label in labels) and (why := other_kernels(table_id, measured_with)) is not None:
            elsewhere.append(why)
            continue
        for label in labels:
            if label not in rows:
                continue
            fresh = regenerate_row(table_id, label, seeds, rounds)
            checked += 1
            if fresh != rows[label]:
                failures.append(f"{table_id} {label}:\n  docs:  {rows[label]}\n  rerun: {fresh}")
    for why in elsewhere:
        print(why, file=sys.stderr)
    if not checked and elsewhere:
        return 2
    if not checked:
        print(f"no row of {labels} is in a generated block of {docs}; run --write first.", file=sys.stderr)
        return 1
    for failure in failures:
        print(failure, file=sys.stderr)
    print(f"{checked - len(failures)} of {checked} rows reproduce.", file=sys.stderr)
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--rounds", type=int, help="override every recipe's rounds (a quick look; recorded)")
    parser.add_argument("--tables", nargs="+", help="table ids or their prefixes (default: all)")
    parser.add_argument("--rows", nargs="+", help="only these methods / recipes (printed, or checked with --check)")
    parser.add_argument("--write", action="store_true", help="write the tables into --docs")
    parser.add_argument("--check", action="store_true", help="re-run --rows of the tables in --docs")
    parser.add_argument("--docs", type=Path, default=DOCS)
    args = parser.parse_args(argv)
    every = [*TABLES, ALL_RECIPES]
    tables = [t for t in every if not args.tables or any(t.startswith(p) for p in args.tables)]
    if args.check:
        return check(args.docs, tables, args.rows or DEFAULT_CHECK)
    if args.write:
        if args.rows:
            return write_rows(args.docs, tables, args.rows)
        write(args.docs, tables, args.seeds, args.rounds)
        return 0
    for table_id in tables:
        if args.rows:
            lines = [line for label in args.rows if (line := regenerate_row(table_id, label, args.seeds, args.rounds))]
            if lines:
                print("\n".join([f"{table_id}:", *lines]))
        else:
            print(f"{table_id}:\n{generate(table_id, args.seeds, args.rounds)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
