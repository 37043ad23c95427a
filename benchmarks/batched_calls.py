"""How the batched executor splits a round of the flagship into steps: calls per round by clients per call.

Counts, for ``--rounds`` rounds of ``recipes/ondevice_kd_cifar10.yaml`` (random-pixel CIFAR-10 in the real
format, the recipe's partition, ``optimizer_state: shared_per_phase``), the group steps (vmapped calls) by
role and by number of clients, how many of them held every client of their group, and the share of
client-steps that ran in such a full call. ``--mode lockstep`` (the default, ``runtime.lockstep``) pads every
client's batch so that each step of a group is one call of all its clients; ``--mode by_shape`` groups
clients only while their batches share a shape (a client smaller than a batch, or at the end of a pass over
its data, steps alone or with a few others). The step itself is replaced by a stub, so it runs in about a
minute on a CPU: the split depends on the partition and the batch size, not on the arithmetic.

    python benchmarks/batched_calls.py --rounds 2 --json
    python benchmarks/batched_calls.py --rounds 2 --json --mode by_shape
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from gpu_flagship import write_random_cifar10


def count_calls(rounds: int, mode: str = "lockstep") -> dict:
    from fl_lightning.cli.commands import fit_from_argv
    from fl_lightning.client.batched import fits, group_training

    calls: collections.Counter = collections.Counter()
    groups: list[tuple[str, int, int]] = []  # (role, clients of the group, fits of that role in the same wave)

    def stub(self, members, batch, step, padded=None):  # what a step would train, recorded instead of computed
        consecutive = members[-1] - members[0] + 1 == len(members)
        active = len(members) if padded is None else sum(padded.real[k] > 0 for k in members)
        calls[(self.role, len(members), self.clients, consecutive, active)] += 1

    def run(self, requests):  # a wave of paused fits: each group's size against its role's fits in the wave
        wave = collections.Counter(r.role for r in requests)
        start = len(groups)
        real_run(self, requests)
        groups[start:] = [(role, size, wave[role]) for role, size, _ in groups[start:]]

    def init(self, loop, group, *args, **kwargs):
        groups.append((group[0].role, len(group), 0))
        real_init(self, loop, group, *args, **kwargs)

    training = group_training.GroupTraining
    real_step, real_run, real_init = training._step, fits.BatchedFit.run, training.__init__
    training._step, fits.BatchedFit.run, training.__init__ = stub, run, init
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_random_cifar10(Path(tmp) / "data", 10_000)
            argv = ["--config", str(ROOT / "recipes" / "ondevice_kd_cifar10.yaml"), "--rounds", str(rounds)]
            argv += ["--eval_every", "1000", "--checkpoint_every", "1000", "--runtime.progress", "false"]
            argv += ["--output_dir", str(Path(tmp) / "out"), "--data.init_args.data_dir", str(Path(tmp) / "data")]
            argv += ["--data.init_args.download", "false", "--runtime.executor", "batched"]
            argv += ["--runtime.lockstep", str(mode == "lockstep").lower()]
            argv += ["--training.optimizer_state", "shared_per_phase", "--runtime.accelerator", "cpu"]
            summary = fit_from_argv(argv)
    finally:
        training._step, fits.BatchedFit.run, training.__init__ = real_step, real_run, real_init
    by_size: collections.Counter = collections.Counter()
    for (role, members, _, _, _), n in calls.items():
        by_size[f"{role}/{members}"] += n
    client_steps = sum(active * n for (*_, active), n in calls.items())
    full = sum(active * n for (_, members, clients, _, active), n in calls.items() if members == clients)
    return {
        "mode": mode,
        "rounds": rounds,
        "calls_per_round": sum(calls.values()) / rounds,
        "one_client_calls_per_round": sum(n for k, n in calls.items() if k[1] == 1) / rounds,
        "all_clients_calls_per_round": sum(n for k, n in calls.items() if k[1] == k[2]) / rounds,
        "gathered_calls_per_round": sum(n for k, n in calls.items() if not k[3]) / rounds,
        "client_steps_per_round": client_steps / rounds,
        "full_group_client_step_share": full / client_steps if client_steps else None,
        "groups_per_round": len(groups) / rounds,
        "groups_holding_every_fit_of_their_role": sum(size == wave for _, size, wave in groups) / rounds,
        "group_sizes": dict(sorted(collections.Counter(f"{role}/{size}" for role, size, _ in groups).items())),
        "calls_by_role_and_clients": dict(
            sorted(by_size.items(), key=lambda kv: (kv[0].split("/")[0], int(kv[0].split("/")[1])))
        ),
        "executor": summary.get("executor"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--mode", choices=["lockstep", "by_shape"], default="lockstep")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print(json.dumps(count_calls(args.rounds, args.mode), indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
