"""Which methods' local steps ``runtime.cuda_graphs`` replays, and why the others run eagerly.

Runs every digits recipe (one per method) for a few rounds with ``runtime.cuda_graphs`` on, with
:class:`~fl_lightning.client.graphs.trace.CheckedReruns` standing in for CUDA graphs on this CPU (it reruns
each "replayed" step and fails where a real graph would replay a stale value), and reports per recipe
the share of local steps replayed, the captures, and the reasons the other steps ran eagerly. The counts
are those a GPU run would make: the same ``StepGraphs`` decides, only the replay differs.

``--check`` also runs each recipe eagerly and compares the final metrics and checkpoint tensors bit for
bit (an Adam recipe's eager twin runs Adam with ``capturable: true``, as graphs do). ``--batched`` also
runs it with ``runtime.executor batched`` and reports how many of its fits ran as vmapped groups (the
rest ran alone: a client alone in its group, or a step the executor cannot batch).

    python benchmarks/probes/graph_coverage.py --check --batched --json   # one JSON object per recipe, then a table
    python benchmarks/probes/graph_coverage.py --check digits_fedhe.yaml digits_felo.yaml
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

CAPTURABLE = ["--training.optimizer.init_args.capturable", "true"]


def _run(recipe: str, out: Path, rounds: int, extra: list[str], graphs_on: bool) -> tuple[dict, dict]:
    import torch

    from fl_lightning.run.arguments import fit_from_argv

    argv = ["--config", str(ROOT / "recipes" / recipe), "--rounds", str(rounds), "--output_dir", str(out)]
    argv += ["--runtime.progress", "false", "--runtime.accelerator", "cpu", *extra]
    if graphs_on:
        argv += ["--runtime.cuda_graphs", "true"]
    fit_from_argv(argv)
    summary = json.loads((out / "summary.json").read_text())
    checkpoint = out / "checkpoints" / "last.ckpt"
    weights = torch.load(checkpoint, weights_only=True) if checkpoint.exists() else {}
    return summary, weights


def survey(recipe: str, rounds: int, check: bool, batched: bool = False) -> dict:
    import torch

    from fl_lightning.run.checkpoint import tensors_by_path
    from fl_lightning.run.recipes import load_recipe

    optimizer = load_recipe(ROOT / "recipes" / recipe)["training"].get("optimizer", {}).get("class_path", "")
    optimizer = optimizer.rsplit(".", 1)[-1] or "SGD"
    with tempfile.TemporaryDirectory() as tmp:
        summary, weights = _run(recipe, Path(tmp) / "graphs", rounds, [], graphs_on=True)
        row = {"recipe": recipe, "optimizer": optimizer}
        counts = summary["cuda_graphs"]
        steps = counts["graphed_steps"] + counts["eager_steps"]
        row.update(
            steps=steps,
            graphed_share=round(counts["graphed_steps"] / steps, 3) if steps else None,
            captures=counts["captures"],
            eager_reasons=counts["eager_reasons"],
            note=counts.get("note", ""),
        )
        if check:
            extra = CAPTURABLE if optimizer.startswith("Adam") else []
            eager, eager_weights = _run(recipe, Path(tmp) / "eager", rounds, extra, graphs_on=False)
            a, b = tensors_by_path(weights), tensors_by_path(eager_weights)
            differ = sorted(a.keys() ^ b.keys()) + [k for k in a.keys() & b.keys() if not torch.equal(a[k], b[k])]
            row["bit_for_bit"] = summary["final"] == eager["final"] and not differ
            if not row["bit_for_bit"]:
                row["differ"] = differ[:5] or [
                    k for k in eager["final"] if summary["final"].get(k) != eager["final"][k]
                ]
        if batched:
            counts = _run(recipe, Path(tmp) / "batched", rounds, ["--runtime.executor", "batched"], False)[0]
            counts = counts["executor"]
            if counts["mode"] == "batched":
                row.update(batched=f"{counts['batched_fits']} of {counts['batched_fits'] + counts['sequential_fits']}")
                reasons = counts.get("sequential_reasons", {})
                if reasons:  # why the others ran one at a time (summary.json's executor.sequential_reasons)
                    row["batched"] += " (" + "; ".join(f"{why}: {n}" for why, n in reasons.items()) + ")"
            else:
                row.update(batched=f"none: {counts['why']}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("recipes", nargs="*", help="recipe files in recipes/ (default: every digits_*.yaml)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="also run eagerly and compare bit for bit")
    parser.add_argument("--batched", action="store_true", help="also count the fits the batched executor batches")
    parser.add_argument("--json", action="store_true", help="print one JSON object per recipe")
    args = parser.parse_args()

    import torch

    from fl_lightning.client import graphs
    from fl_lightning.client.graphs.trace import CheckedReruns, capturable_adam_on_cpu

    torch.set_num_threads(1)
    graphs.backend_for = CheckedReruns  # the CPU stand-in for CUDA graphs
    recipes = args.recipes or sorted(p.name for p in (ROOT / "recipes").glob("digits_*.yaml"))
    rows = []
    for recipe in recipes:
        with capturable_adam_on_cpu():
            row = survey(recipe, args.rounds, args.check, args.batched)
        rows.append(row)
        if args.json:
            print(json.dumps(row), flush=True)
    extra_columns = " bit for bit |" * args.check + " fits batched |" * args.batched
    print(f"\n| recipe | optimizer | local steps | replayed | captures | eager, by reason |{extra_columns}")
    print(f"|---|---|---|---|---|---|{'---|' * (args.check + args.batched)}")
    for row in rows:
        share = "-" if row["graphed_share"] is None else f"{100 * row['graphed_share']:.0f} %"
        reasons = "; ".join(f"{reason}: {n}" for reason, n in row["eager_reasons"].items()) or row["note"] or "-"
        cells = [row["recipe"], row["optimizer"], row["steps"], share, row["captures"], reasons]
        if args.check:
            cells.append("yes" if row["bit_for_bit"] else "**no**")
        if args.batched:
            cells.append(row["batched"])
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
