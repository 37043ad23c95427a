"""A recipe as Flower apps (``fl_lightning/flower``): payloads as records, and the numbers of ``flrun fit``.

The fast tests run the ServerApp's work and the ClientApp in this process over a grid that hands each message to
the ClientApp at once (Flower's messages and records, without its engine); the slow one runs Flower's simulation
engine, each SuperNode a worker process.
"""

import json
import math

import pytest
import torch
from conftest import ROOT, assert_same, metrics_rows, read_summary, run_cli

flwr = pytest.importorskip("flwr", reason="flrun flower needs the flower extra: pip install -e '.[flower]'")

from flwr.app import Context, RecordDict  # noqa: E402

from fl_lightning.federation.errors import ConfigError  # noqa: E402
from fl_lightning.federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights  # noqa: E402
from fl_lightning.flower import records  # noqa: E402
from fl_lightning.flower.apps import client_app, run_server  # noqa: E402
from fl_lightning.flower.codec import decode, encode  # noqa: E402
from fl_lightning.knowledge.class_stats import ClassStatistics  # noqa: E402


# ---------------------------------------------------------------------- payloads as records
def test_every_payload_kind_travels_with_its_dtypes_shapes_and_values():
    weights = {"w": torch.randn(3, 4), "b": torch.arange(3, dtype=torch.bfloat16), "n": torch.zeros(0, 2)}
    stats = ClassStatistics.padded("class_logits", {"logits": torch.randn(3, 3)}, torch.tensor([True, False, True]))
    update = ClientUpdate(
        ClientSpec(7, "weak", ("global",)), 12, {"global": ModelWeights("global", weights), "stats": stats},
        {"global/loss": float("nan"), "acc": 0.5},
    )  # fmt: skip
    task = ClientTask(ClientSpec(7, "weak", ("global",)), 3, {"global": ModelWeights("global", weights)}, "digest")
    content = RecordDict()
    stored = records.put(content, "value", {"update": update, "task": task, 4: ({1, 2}, None, [True, "x"])})
    back, size = records.take(content, "value")
    assert size == stored and size >= sum(t.numel() * t.element_size() for t in weights.values()) * 2
    got = back["update"]
    assert got.client == update.client and got.num_samples == 12 and back["task"].phase == "digest"
    assert math.isnan(got.metrics["global/loss"]) and got.metrics["acc"] == 0.5
    for name, tensor in weights.items():
        sent = got.sent("global", ModelWeights).state[name]
        assert sent.dtype == tensor.dtype and sent.shape == tensor.shape and torch.equal(sent, tensor)
    assert torch.equal(got.sent("stats", ClassStatistics).labels, stats.labels)
    assert back[4] == ({1, 2}, None, [True, "x"])


def test_a_message_cannot_name_a_class_or_carry_an_object_outside_the_payload_kinds():
    encoded = encode({"a": ClientSpec(1, "t", ("global",))})
    encoded.structure = encoded.structure.replace("ClientSpec", "Popen")
    with pytest.raises(ValueError, match="'Popen', which is not one a message may carry"):
        decode(encoded)
    with pytest.raises(TypeError, match="a object cannot travel as a Flower record"):
        encode({"x": object()})


# ---------------------------------------------------------------------- the same numbers as flrun fit
class InProcessGrid:
    """Flower's grid for the ServerApp, handing each message to a ClientApp of SuperNode ``partition-id`` i."""

    def __init__(self, supernodes: int, node_args: dict[int, str] | None = None):
        from flwr.supercore.task_identity import TaskIdentity

        TaskIdentity.run_id = TaskIdentity.node_id = TaskIdentity.task_id = 1  # what Flower's runtime sets
        self.app = client_app()
        self.contexts = {}
        for i in range(supernodes):
            config = {"partition-id": i, "num-partitions": supernodes, "fit-args": (node_args or {}).get(i, "")}
            self.contexts[100 + i] = Context(1, 100 + i, config, RecordDict(), {})
        self.received: list[str] = []

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, timeout=None):
        replies = []
        for message in messages:
            self.received.append(message.metadata.message_type)
            replies.append(self.app(message, self.contexts[message.metadata.dst_node_id]))
        return replies


@pytest.mark.parametrize("method", ["fedavg", "fedproto", "fedgh", "fd", "ondevice_kd"])
def test_the_flower_apps_give_flrun_fits_numbers_bit_for_bit(tmp_path, method):
    """The ServerApp and ClientApp over a grid of 2 SuperNodes: metrics.csv, the ledger, the server's state and
    every client's state of flrun fit."""
    from fl_lightning.run.checkpoint import load_checkpoint
    from fl_lightning.run.client_store import load_client_states

    recipe = "recipes/quickstart.yaml" if method == "fedavg" else f"recipes/digits_{method}.yaml"
    # 3 rounds: the quickstart's cosine rate leaves a 1- or 2-round run at its initial accuracy
    args = ["--config", str(ROOT / recipe), "--rounds", "3", "--runtime.progress", "false"]
    assert run_cli("fit", *args, "--output_dir", str(tmp_path / "fit")) == 0
    grid = InProcessGrid(2)
    summary = run_server(grid, [*args, "--output_dir", str(tmp_path / "flower")], expected_nodes=2)
    fit, flower = read_summary(tmp_path / "fit"), read_summary(tmp_path / "flower")
    assert metrics_rows(tmp_path / "fit") == metrics_rows(tmp_path / "flower")
    assert fit["final"] == flower["final"] and fit["comm"] == flower["comm"]
    one, two = (load_checkpoint(tmp_path / run / "checkpoints/last.ckpt") for run in ("fit", "flower"))
    for key in ("strategy", "ledger", "best", "last_eval"):
        assert_same(one[key], two[key], key)
    assert_same(load_client_states(one), load_client_states(two), "client states")
    assert flower["flower"] == summary["flower"] and flower["flower"]["supernodes"] == 2
    phases = 2 if method == "ondevice_kd" else 1  # one message per SuperNode and phase, and one reply each
    assert flower["flower"]["messages"] == 3 * 2 * 2 * phases
    assert grid.received.count("query") == 2
    # what Flower carried holds at least the payloads the ledger counts (and the copies of the clients' states)
    assert flower["flower"]["downlink_bytes"] >= fit["comm"]["downlink_bytes"]
    assert flower["flower"]["uplink_bytes"] >= fit["comm"]["uplink_bytes"] + flower["flower"]["client_state_bytes"]
    assert (flower["flower"]["client_state_bytes"] > 0) == (method in ("fedproto", "fedgh", "fd"))
    assert (tmp_path / "flower" / "config.yaml").is_file()


def test_methods_a_deployment_cannot_give_are_refused_in_one_sentence(tmp_path):
    out = ["--output_dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=r"^asynchronous rounds \(schedule\) .* remove schedule"):
        run_server(InProcessGrid(1), ["--config", str(ROOT / "recipes/digits_fedhe_async.yaml"), *out])
    shared = ["--config", str(ROOT / "recipes/quickstart.yaml"), "--training.optimizer_state", "shared", *out]
    with pytest.raises(ConfigError, match="clients on separate SuperNodes cannot share"):
        run_server(InProcessGrid(1), shared)
    private = ["--config", str(ROOT / "recipes/quickstart.yaml"), "--privacy.clip", "0.5", *out]
    private += ["--privacy.noise_multiplier", "1.0", "--privacy.delta", "1e-3"]
    with pytest.raises(ConfigError, match="^privacy is accounted by the process that samples the clients"):
        run_server(InProcessGrid(1), private)
    resumed = ["--config", str(ROOT / "recipes/quickstart.yaml"), "--resume", "auto", *out]
    with pytest.raises(ConfigError, match="^flrun flower starts new runs only"):
        run_server(InProcessGrid(1), resumed)
    assert not (tmp_path / "run").exists()


def test_a_supernode_that_partitioned_other_data_is_refused_before_any_training(tmp_path):
    """A node option (fit-args in its node config) that changes what the data hold, not where they are."""
    grid = InProcessGrid(2, node_args={1: "--data.init_args.test_fraction 0.3"})
    args = ["--config", str(ROOT / "recipes/quickstart.yaml"), "--output_dir", str(tmp_path / "run")]
    with pytest.raises(ConfigError, match=r"SuperNode\(s\) \[101\] partitioned other data than the server"):
        run_server(grid, args)
    assert grid.received == ["query", "query"]  # no task was sent


def test_flrun_flower_refuses_a_bad_supernode_count(capsys):
    assert run_cli("flower", "--config", str(ROOT / "recipes/quickstart.yaml"), "--supernodes", "0") == 2
    assert "--supernodes takes a whole number of SuperNodes of at least 1, got '0'" in capsys.readouterr().err


@pytest.mark.slow
def test_flrun_flower_simulation_gives_flrun_fits_numbers(tmp_path):
    """Flower's simulation engine, each SuperNode a worker process: flrun fit's metrics bit for bit."""
    args = ["--config", str(ROOT / "recipes/quickstart.yaml"), "--rounds", "3", "--runtime.progress", "false"]
    assert run_cli("fit", *args, "--output_dir", str(tmp_path / "fit")) == 0
    assert run_cli("flower", "--simulation", "--supernodes", "2", *args, "--output_dir", str(tmp_path / "sim")) == 0
    assert metrics_rows(tmp_path / "fit") == metrics_rows(tmp_path / "sim")
    summary = json.loads((tmp_path / "sim" / "summary.json").read_text())
    assert summary["flower"]["supernodes"] == 2 and summary["flower"]["messages"] == 3 * 2 * 2


def _listening(pids: set[int]) -> list[str]:
    """The local addresses that processes ``pids`` listen on (TCP), from ``ss``."""
    import re
    import subprocess

    out = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True).stdout
    return [line.split()[3] for line in out.splitlines() if {int(p) for p in re.findall(r"pid=(\d+)", line)} & pids]


def _in_groups(groups: set[int]) -> set[int]:
    """Every process whose process group is one of ``groups`` (Loopback starts each command in its own)."""
    import subprocess

    out = subprocess.run(["ps", "-eo", "pid=,pgid="], capture_output=True, text=True, check=True).stdout
    return {int(pid) for pid, pgid in (line.split() for line in out.splitlines()) if int(pgid) in groups}


def _alive(pids: set[int]) -> set[int]:
    import os

    alive = set()
    for pid in pids:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":  # ended; its reaper has not looked yet
                    continue
        except (ProcessLookupError, FileNotFoundError):
            continue
        alive.add(pid)
    return alive


@pytest.mark.slow
def test_the_loopback_deployment_listens_on_127_0_0_1_only_and_leaves_no_process(tmp_path):
    """A SuperLink and 2 SuperNodes: every socket they listen on is on 127.0.0.1, and closing ends them all."""
    import shutil
    import time

    from fl_lightning.flower.launch import Loopback

    if shutil.which("ss") is None:
        pytest.skip("ss (iproute2) is not installed: the test reads the listening sockets with it")
    with Loopback(tmp_path, 2) as loopback:
        groups = {process.pid for process in loopback.processes}
        time.sleep(5)  # the SuperNodes connect (a SuperNode opens its own API when a run needs it)
        pids = _in_groups(groups)
        addresses = _listening(pids)
        assert addresses and all(address.startswith("127.0.0.1:") for address in addresses), addresses
    end = time.monotonic() + 30  # SIGKILLed grandchildren take a moment on a loaded machine
    while _alive(pids | _in_groups(groups)) and time.monotonic() < end:
        time.sleep(0.5)
    assert _alive(pids) == set() and _alive(_in_groups(groups)) == set()


@pytest.mark.slow
def test_flrun_flower_on_a_loopback_deployment_gives_flrun_fits_numbers(tmp_path):
    """SuperLink, 2 SuperNodes and the run submitted with flwr run: flrun fit's metrics bit for bit, the run's
    files, and no Flower process left once the command returns."""
    import subprocess

    def flower_processes() -> set[str]:
        out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True, check=True).stdout
        return {line.split()[0] for line in out.splitlines() if str(tmp_path) in line or "flrun-flower-" in line}

    before = flower_processes()
    args = ["--config", str(ROOT / "recipes/digits_fedproto.yaml"), "--rounds", "2", "--runtime.progress", "false"]
    assert run_cli("fit", *args, "--output_dir", str(tmp_path / "fit")) == 0
    assert run_cli("flower", "--supernodes", "2", *args, "--output_dir", str(tmp_path / "loopback")) == 0
    assert metrics_rows(tmp_path / "fit") == metrics_rows(tmp_path / "loopback")
    summary = read_summary(tmp_path / "loopback")
    assert summary["flower"]["supernodes"] == 2 and summary["flower"]["client_state_bytes"] > 0
    assert {"config.yaml", "metrics.csv", "summary.json"} <= {p.name for p in (tmp_path / "loopback").iterdir()}
    assert flower_processes() - before == set()


def test_a_stopped_loopback_run_is_reported_by_its_servers_sentence():
    from fl_lightning.flower.launch import _failure

    log = (
        "Traceback (most recent call last):\n  File 'apps.py', line 118, in updates\n"
        "RuntimeError: round 6: SuperNode 123 did not return its clients' updates (no reply).\n"
        "ERROR :     Exit Code: 201\n"
    )
    error = _failure(log)
    assert isinstance(error, RuntimeError)
    assert (
        str(error) == "the loopback run stopped: round 6: SuperNode 123 did not return its clients' updates (no reply)."
    )
    refused = _failure("fl_lightning.federation.errors.ConfigError: asynchronous rounds (schedule) simulate ...\n")
    assert isinstance(refused, ConfigError) and str(refused).startswith("asynchronous rounds (schedule)")
    assert "log ends with:\nsomething else" in str(_failure("something else"))
