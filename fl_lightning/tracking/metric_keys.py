"""The names of the metrics the round loop reports in each round's row (metrics.csv's columns, W&B's and
TensorBoard's keys), written out once: the orchestrator's training step builds its row from these, the
loggers and the progress bar read them.

A round's row holds, besides the strategy's own server and evaluation metrics:

- ``round`` and ``clients`` (the tasks trained that round);
- ``train/<name>``: the mean of each client metric over the round's updates, and ``train/loss``, the mean of
  those whose name ends in ``loss``;
- ``faults/<event>``: injected faults and their effects, when the run injects any;
- ``comm/...``: bytes sent that round and in total, and MiB per client so far;
- ``compute/...``: training FLOPs so far, in total and in GFLOPs per client (when every role's step is counted);
- ``privacy/epsilon``: the differential privacy budget spent so far, with a ``privacy`` section;
- ``time/elapsed_s``: seconds since the run started (a resumed run's earlier time included).
"""

from __future__ import annotations

ROUND = "round"
CLIENTS = "clients"

TRAIN_PREFIX = "train/"
TRAIN_LOSS = "train/loss"
FAULTS_PREFIX = "faults/"

ROUND_UPLINK_BYTES = "comm/round_uplink_bytes"
ROUND_DOWNLINK_BYTES = "comm/round_downlink_bytes"
UPLINK_BYTES = "comm/uplink_bytes"
DOWNLINK_BYTES = "comm/downlink_bytes"
MIB_PER_CLIENT = "comm/mib_per_client"

TRAIN_FLOPS = "compute/train_flops"
PRIVACY_EPSILON = "privacy/epsilon"
GFLOPS_PER_CLIENT = "compute/gflops_per_client"

ELAPSED_S = "time/elapsed_s"


def train_key(name: str) -> str:
    """The row's key of the round's mean of the client metric ``name``."""
    return f"{TRAIN_PREFIX}{name}"


def faults_key(event: str) -> str:
    """The row's key of the count of fault ``event`` in the round."""
    return f"{FAULTS_PREFIX}{event}"
