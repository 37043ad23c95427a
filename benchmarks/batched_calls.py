"""How the batched executor splits a round of the flagship into steps: calls per round by clients per call.

Clients of a group step together only while their batches have one shape; a client smaller than a batch,
or at the end of a pass over its data, has a short batch and steps alone or with a few others. This
counts, for one round of ``recipes/ondevice_kd_cifar10.yaml`` (random-pixel CIFAR-10 in the real format,
the recipe's partition), the group steps by role and by number of clients, and how many of them were of
consecutive clients (views, no gather). The step itself is replaced by a stub, so it runs in about a
minute on a CPU: the split depends on the partition and the batch size, not on the arithmetic.

    python benchmarks/batched_calls.py --json
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


def count_calls(rounds: int) -> dict:
    from fl_lightning.cli.commands import fit_from_argv
    from fl_lightning.client.batched import group_training

    calls: collections.Counter = collections.Counter()

    def stub(self, members, batch, step):  # what a step would train, recorded instead of computed
        consecutive = members[-1] - members[0] + 1 == len(members)
        calls[(self.role, len(members), self.clients, consecutive)] += 1

    real = group_training.GroupTraining._step
    group_training.GroupTraining._step = stub
    try:
        with tempfile.TemporaryDirectory() as tmp:
            write_random_cifar10(Path(tmp) / "data", 10_000)
            argv = ["--config", str(ROOT / "recipes" / "ondevice_kd_cifar10.yaml"), "--rounds", str(rounds)]
            argv += ["--eval_every", "1000", "--checkpoint_every", "1000", "--runtime.progress", "false"]
            argv += ["--output_dir", str(Path(tmp) / "out"), "--data.init_args.data_dir", str(Path(tmp) / "data")]
            argv += ["--data.init_args.download", "false", "--runtime.executor", "batched"]
            argv += ["--training.optimizer_state", "shared_per_phase", "--runtime.accelerator", "cpu"]
            fit_from_argv(argv)
    finally:
        group_training.GroupTraining._step = real
    by_size: collections.Counter = collections.Counter()
    for (role, members, _, _), n in calls.items():
        by_size[f"{role}/{members}"] += n
    return {
        "rounds": rounds,
        "calls_per_round": sum(calls.values()) / rounds,
        "one_client_calls_per_round": sum(n for k, n in calls.items() if k[1] == 1) / rounds,
        "all_clients_calls_per_round": sum(n for k, n in calls.items() if k[1] == k[2]) / rounds,
        "gathered_calls_per_round": sum(n for k, n in calls.items() if not k[3]) / rounds,
        "calls_by_role_and_clients": dict(
            sorted(by_size.items(), key=lambda kv: (kv[0].split("/")[0], int(kv[0].split("/")[1])))
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print(json.dumps(count_calls(args.rounds), indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
