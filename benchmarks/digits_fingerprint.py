"""Bit-exact fingerprints of the digits recipes: refactors must not change a single number.

Runs every ``recipes/digits_*.yaml`` and the quickstart for a few rounds with a fixed seed and records
the evaluation metrics (full float precision), the communication counts and a SHA-256 of every tensor
of the strategy's server state and the clients' states in the final checkpoint.

    python benchmarks/digits_fingerprint.py --write benchmarks/digits_fingerprint.json   # record
    python benchmarks/digits_fingerprint.py --check benchmarks/digits_fingerprint.json   # compare

``--check`` exits 1 and names every recipe whose fingerprint changed. A change that is meant to alter
numbers (a fidelity fix) re-records the file in the same commit and says so in the message; with
``--only``, ``--write`` re-records those recipes' entries and keeps the others of the file:

    python benchmarks/digits_fingerprint.py --only digits_fd --write benchmarks/digits_fingerprint.json

Bits depend on the CPU's vector instruction set: PyTorch's CPU kernels pick AVX2, AVX-512 or other code
paths at run time (``torch.backends.cpu.get_cpu_capability()``), and their sums round in different orders,
so the same code and seed give the same metrics to many digits but not the same last bits on another
instruction set. The file therefore keeps one set of fingerprints per instruction set; ``--check`` compares
with the set of this machine's and says so when there is none (record one with ``--write`` on code
known to be unchanged, e.g. the main branch, before checking a change).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def instruction_set() -> str:
    """The vector instruction set PyTorch's CPU kernels use here (e.g. ``AVX2``, ``AVX512``)."""
    return torch.backends.cpu.get_cpu_capability()


def _tensor_digest(obj, digest) -> None:
    """Feeds every tensor of a nested container into ``digest`` in a deterministic order."""
    if isinstance(obj, torch.Tensor):
        digest.update(obj.detach().cpu().contiguous().numpy().tobytes())
    elif isinstance(obj, dict):
        for key in sorted(obj, key=str):
            digest.update(str(key).encode())
            _tensor_digest(obj[key], digest)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            _tensor_digest(item, digest)
    elif isinstance(obj, (int, float, str, bool)) or obj is None:
        digest.update(repr(obj).encode())
    elif callable(getattr(obj, "state_dict", None)):  # banks, server optimizers, modules
        _tensor_digest(obj.state_dict(), digest)
    else:
        raise TypeError(f"cannot fingerprint a {type(obj).__name__}")


def fingerprint(recipe: Path, rounds: int) -> dict:
    from fl_lightning.cli.commands import fit_from_argv
    from fl_lightning.run.checkpoint import load_checkpoint
    from fl_lightning.run.client_store import load_client_states

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        argv = ["--config", str(recipe), "--rounds", str(rounds), "--eval_every", "1"]
        argv += ["--output_dir", str(out), "--runtime.progress", "false", "--seed", "0"]
        summary = fit_from_argv(argv)
        checkpoint = load_checkpoint(out / "checkpoints" / "last.ckpt")  # weights_only, checksum verified
        client_states = load_client_states(checkpoint)  # the files it names, each SHA-256 verified
    server, clients = hashlib.sha256(), hashlib.sha256()
    _tensor_digest(checkpoint["strategy"], server)
    _tensor_digest(client_states, clients)
    return {
        "final": summary["final"],
        "comm": {k: v for k, v in summary["comm"].items() if k.endswith("bytes")},
        "server_state_sha256": server.hexdigest(),
        "client_states_sha256": clients.hexdigest(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", type=Path, help="record fingerprints to this JSON file")
    parser.add_argument("--check", type=Path, help="compare against this JSON file; exit 1 on any difference")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", nargs="*", help="recipe stems to run (default: all digits recipes)")
    args = parser.parse_args()
    recipes = sorted((ROOT / "recipes").glob("digits_*.yaml")) + [ROOT / "recipes" / "quickstart.yaml"]
    if args.only:
        recipes = [r for r in recipes if r.stem in args.only]
    isa = instruction_set()
    expected = None
    if args.check:
        recorded = json.loads(args.check.read_text())
        expected = recorded.get("by_instruction_set", {}).get(isa)
        if expected is None or expected["rounds"] != args.rounds:
            sys.exit(
                f"{args.check} holds no {args.rounds}-round fingerprints for this CPU's instruction set ({isa}; "
                f"recorded: {', '.join(recorded.get('by_instruction_set', {})) or 'none'}): record them with "
                f"--write on unchanged code first (bits differ between instruction sets)."
            )
    results = {r.stem: fingerprint(r, args.rounds) for r in recipes}
    if args.write:
        previous = json.loads(args.write.read_text()) if args.write.is_file() else {}
        sets = previous.get("by_instruction_set", {})
        entries = results
        if args.only and isa in sets:  # re-record these entries only
            if sets[isa]["rounds"] != args.rounds:
                sys.exit(
                    f"{args.write} records {sets[isa]['rounds']} rounds; --only entries must use the same --rounds."
                )
            entries = {**sets[isa]["recipes"], **results}
        sets[isa] = {"rounds": args.rounds, "recipes": entries}
        args.write.write_text(json.dumps({"by_instruction_set": sets}, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(results)} fingerprints for {isa} to {args.write}")
    if expected is not None:
        changed = [name for name, got in results.items() if expected["recipes"].get(name) != got]
        for name in changed:
            print(f"CHANGED {name}:\n  expected {expected['recipes'].get(name)}\n  got      {results[name]}")
        print(f"{len(results) - len(changed)} of {len(results)} recipes bit-identical ({isa})")
        return 1 if changed else 0
    if not (args.write or args.check):
        print(json.dumps(results, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
