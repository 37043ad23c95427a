"""The ServerApp and ClientApp of a recipe.

The ServerApp runs ``flrun fit`` itself, with one change: each phase's tasks go to the SuperNodes through Flower's
grid (:class:`FlowerTransport`) instead of the local loop. The orchestrator still holds the only round loop:
sampling, each phase's ``configure`` and ``aggregate``, evaluation, the ledger, checkpoints and the run files are
the same code as ``flrun fit``'s. One message per SuperNode and phase carries the tasks of its clients, in task
order (a client's second task of a phase starts from the state its first left), and its reply their updates.

A SuperNode holds the clients whose id modulo ``num-partitions`` is its ``partition-id`` (its node config; Flower's
simulation engine sets both). Its ClientApp builds the same run from the recipe the ServerApp sends first (the
data partitioned with the run's seed, one model per role, the strategy set up) and runs each task with the code
``flrun fit`` runs each client with (:meth:`FederationOrchestrator.run_client`): the same Fabric loop, the same
strategy client hooks, the same random streams. A client's persistent state (its own model, its optimizer state)
stays on its SuperNode, in the node's Flower context; a copy goes back with each reply, since the server evaluates
personal models and checkpoints them as ``flrun fit`` does.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp

from ..federation.errors import ConfigError
from ..federation.types import ClientTask, ClientUpdate
from ..run.remote import RemoteClients, remote_clients
from ..run.robustness import Diverged
from ..run.tally import RoundTally
from ..tracking import RunFiles
from . import records

if TYPE_CHECKING:
    from ..run.orchestrator import FederationOrchestrator

RECIPE = "flrun.recipe"  # the ConfigRecord of the query message, kept in each SuperNode's context
NODE_WAIT_S = 120.0  # how long the ServerApp waits for the SuperNodes it expects to connect
SCRATCH_ENV = "FLRUN_FLOWER_SCRATCH"  # where a SuperNode's process builds its run (a temporary folder when unset)


def check_deployable(init: Any) -> None:
    """Refuses, in one sentence, a recipe whose method needs what clients on separate SuperNodes cannot give."""
    if init.schedule is not None:
        raise ConfigError(
            "asynchronous rounds (schedule) simulate each client's arrival time in one process, and a Flower "
            "deployment runs synchronous rounds; remove schedule from the recipe to run it with flrun flower."
        )
    if init.training.optimizer_state in ("shared", "shared_per_phase"):
        raise ConfigError(
            f"training.optimizer_state {init.training.optimizer_state} continues one optimizer state from client to "
            "client, which clients on separate SuperNodes cannot share; use reset or per_client with flrun flower."
        )
    if getattr(init, "privacy", None) is not None:
        raise ConfigError(
            "privacy is accounted by the process that samples the clients and noises their uploads in one run, "
            "and flrun flower does not carry it to the SuperNodes yet; remove the privacy section (or run it with "
            "flrun fit)."
        )
    if init.resume is not None:
        raise ConfigError(
            "flrun flower starts new runs only: the clients' states of a stopped run lived in its SuperNodes' Flower "
            "contexts, which a new deployment does not have; leave out --resume (or continue the run with flrun fit)."
        )
    if init.runtime.devices > 1 or init.runtime.executor == "batched":
        raise ConfigError(
            "each SuperNode runs its clients' tasks one after another, so runtime.devices above 1 and runtime.executor "
            "batched do not apply to flrun flower; leave them at their defaults."
        )


# ---------------------------------------------------------------------------------------------- the server side
class FlowerTransport:
    """Sends each phase's tasks through Flower's grid, one message per SuperNode, and hands the updates back in task
    order, recording what the orchestrator's own client runner records (``run/remote.ClientTransport``).

    Args:
        grid: the ServerApp's grid.
        owners: partition id -> node id of each SuperNode.
    """

    def __init__(self, grid: Grid, owners: dict[int, int], partitions: dict[int, str] | None = None):
        self.grid, self.owners, self.partitions = grid, owners, partitions or {}
        self.traffic = {"messages": 0, "downlink_bytes": 0, "uplink_bytes": 0, "client_state_bytes": 0}

    def node_of(self, client_id: int) -> int:
        """The SuperNode that holds client ``client_id``."""
        return self.owners[client_id % len(self.owners)]

    def updates(
        self, orchestrator: FederationOrchestrator, rnd: int, tasks: list[ClientTask], tally: RoundTally
    ) -> Iterator[ClientUpdate]:
        state = orchestrator.state
        ours = (orchestrator.output.run_info or {}).get("partition_sha256")
        other = {node: sha for node, sha in self.partitions.items() if sha != ours}
        if other:  # a SuperNode whose data differ would train other clients than the server evaluates
            raise ConfigError(
                f"SuperNode(s) {sorted(other)} partitioned other data than the server (partition SHA-256 "
                f"{next(iter(other.values()))[:12]} vs {str(ours)[:12]}); give every node the same data set files, "
                "and node options (fit-args) that say where the files are, not what they hold."
            )
        self.partitions = {}  # checked once
        for task in tasks:
            state.ledger.record(rnd, "downlink", task.downlink)
        shares: dict[int, list[int]] = {}
        for position, task in enumerate(tasks):
            shares.setdefault(self.node_of(task.client.id), []).append(position)
        messages = []
        for node, positions in shares.items():
            content = RecordDict()
            self.traffic["downlink_bytes"] += records.put(content, "tasks", [tasks[p] for p in positions])
            messages.append(Message(content, dst_node_id=node, message_type="train", group_id=str(rnd)))
        self.traffic["messages"] += len(messages)
        results: dict[int, dict[str, Any]] = {}
        replies = {reply.metadata.src_node_id: reply for reply in self.grid.send_and_receive(messages)}
        for node, positions in shares.items():
            reply = replies.get(node)
            if reply is None or reply.has_error():
                why = reply.error.reason if reply is not None else "no reply"
                raise RuntimeError(f"round {rnd}: SuperNode {node} did not return its clients' updates ({why}).")
            answers, size = records.take(reply.content, "replies")
            self.traffic["messages"] += 1
            for position, answer in zip(positions, answers):
                results[position] = answer
            for answer in answers:  # the copy of a client's state is not its update: counted apart
                self.traffic["client_state_bytes"] += answer.pop("state_bytes", 0)
            self.traffic["uplink_bytes"] += size
        for position, task in enumerate(tasks):
            answer = results.get(position)
            if answer is None:  # a task after its SuperNode's failing one: the failure is raised first
                continue
            if answer["error"] is not None:
                _raise(answer["error"])
            tally.add_steps(answer["steps"])
            for key, count in answer["events"].items():
                tally.count(key, count)
            if answer["trained"]:
                state.shares.trained(task.client.id)
                state.client_states.close(task.client.id, answer["state"] or {})
            orchestrator.progress.client_done()
            update = answer["update"]
            if update is not None:
                state.ledger.record(rnd, "uplink", update.uplink)
                tally.add_metrics(update.metrics)
                yield update


def _raise(error: dict[str, Any]) -> None:
    """Raises a client's error on the server as the kind it was on its SuperNode."""
    if error["kind"] == "diverged":
        raise Diverged(error["message"], error["round"])
    if error["kind"] == "config":
        raise ConfigError(error["message"])
    raise RuntimeError(f"client {error['client']} failed on its SuperNode: {error['message']}")


def _wait_for_nodes(grid: Grid, expected: int | None) -> list[int]:
    """The connected SuperNodes' ids, once ``expected`` of them are there (any, at least one, when None)."""
    deadline = time.monotonic() + NODE_WAIT_S
    while True:
        nodes = sorted(grid.get_node_ids())
        if nodes and (expected is None or len(nodes) >= expected):
            return nodes
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{len(nodes)} SuperNode(s) connected within {NODE_WAIT_S:.0f} s, and the run expects "
                f"{expected or 1}; start them, or check the SuperLink's Fleet API address they connect to."
            )
        time.sleep(0.5)


def _owners(grid: Grid, nodes: list[int], recipe: str) -> tuple[dict[int, int], dict[int, str]]:
    """Sends each SuperNode the recipe (its ClientApp builds the run from it); returns partition id -> node id,
    and node id -> the SHA-256 of the data partition the node built."""
    messages = []
    for node in nodes:
        content = RecordDict({RECIPE: ConfigRecord({"text": recipe})})
        messages.append(Message(content, dst_node_id=node, message_type="query", group_id="setup"))
    owners: dict[int, int] = {}
    partitions: dict[int, str] = {}
    counts = set()
    for reply in grid.send_and_receive(messages):
        if reply.has_error():
            raise RuntimeError(
                f"SuperNode {reply.metadata.src_node_id} could not build the run from the recipe: {reply.error.reason}"
            )
        info = reply.content["node"]
        assert isinstance(info, ConfigRecord)
        owners[int(str(info["partition-id"]))] = reply.metadata.src_node_id
        counts.add(int(str(info["num-partitions"])))
        partitions[reply.metadata.src_node_id] = str(info["partition-sha256"])
    if counts != {len(nodes)} or sorted(owners) != list(range(len(nodes))):
        raise ConfigError(
            f"the {len(nodes)} SuperNodes report partition ids {sorted(owners)} of {sorted(counts)} partitions; give "
            f"each one node config partition-id=0..{len(nodes) - 1} and num-partitions={len(nodes)}."
        )
    return owners, partitions


def run_server(grid: Grid, argv: list[str], expected_nodes: int | None = None) -> dict[str, Any]:
    """The ServerApp's work: the run of ``flrun fit <argv>`` with its clients on the grid's SuperNodes; returns its
    summary, to which ``summary.json`` adds the bytes Flower carried (``flower``)."""
    from ..run.arguments import fit_from_argv, parse_fit

    _, init, resolved = parse_fit(argv)
    check_deployable(init)
    nodes = _wait_for_nodes(grid, expected_nodes)
    transport = FlowerTransport(grid, *_owners(grid, nodes, resolved))
    with remote_clients(RemoteClients(transport=transport)):
        summary = fit_from_argv(argv)
    # beside the ledger's bytes (what the payloads hold), the bytes of the records Flower carried: arrays' data
    # and their structure text, without gRPC's framing; the copies of client states apart
    summary["flower"] = {"supernodes": len(nodes), **transport.traffic}
    files = RunFiles(Path(summary["output_dir"]))
    written = json.loads(files.summary.read_text())
    written["flower"] = summary["flower"]
    files.write_json(files.summary, written)
    return summary


def server_app(
    argv: list[str] | None = None, expected_nodes: int | None = None, summaries: list[dict[str, Any]] | None = None
) -> ServerApp:
    """The ServerApp of ``flrun fit <argv>``; without ``argv``, the app's run config says it (``recipe``: a recipe
    file, ``fit-args``: more ``flrun fit`` options in one string, ``supernodes``: how many to wait for). The run's
    summary is appended to ``summaries`` when given."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        args, nodes = argv, expected_nodes
        if args is None:
            import shlex

            config = context.run_config
            args = ["--config", str(config["recipe"]), *shlex.split(str(config.get("fit-args", "")))]
            nodes = int(str(config["supernodes"])) if "supernodes" in config else None
        summary = run_server(grid, args, nodes)
        if summaries is not None:
            summaries.append(summary)

    return app


# ---------------------------------------------------------------------------------------------- the client side
class _Node:
    """A SuperNode's side of the run: the run built from the recipe, its orchestrator serving tasks."""

    def __init__(self, recipe: str, node_args: list[str]):
        from ..run.arguments import fit_from_argv
        from ..tracking import RoundProgress

        # under the folder flrun flower removes at the end: a worker ended by Flower's engine runs no atexit
        self.folder = Path(tempfile.mkdtemp(prefix="flrun-flower-node-", dir=os.environ.get(SCRATCH_ENV)))
        atexit.register(shutil.rmtree, self.folder, True)
        (self.folder / "recipe.yaml").write_text(recipe)
        served: list[FederationOrchestrator] = []

        def serve(orchestrator: FederationOrchestrator) -> dict[str, Any]:
            served.append(orchestrator)
            return {}

        argv = ["--config", str(self.folder / "recipe.yaml"), "--output_dir", str(self.folder / "run")]
        argv += ["--logger", "csv", "--runtime.progress", "false", "--resume", "null", *node_args]
        with remote_clients(RemoteClients(serve=serve)):
            fit_from_argv(argv)
        self.orchestrator = served[0]
        self.orchestrator.progress = RoundProgress(False, self.orchestrator.plan.rounds, 0, "")

    def run(self, tasks: list[ClientTask], context: Context) -> list[dict[str, Any]]:
        """Runs ``tasks`` in order; each one's update (None when lost), events, steps, state and error."""
        orchestrator = self.orchestrator
        client_states = orchestrator.state.client_states
        answers: list[dict[str, Any]] = []
        for task in tasks:
            cid, name = task.client.id, f"flrun.client.{task.client.id}"
            if records.has(context.state, name):  # the node's own copy: this process may be new
                client_states.close(cid, records.take(context.state, name)[0] or {})
            tally = RoundTally()
            answer: dict[str, Any] = {"update": None, "error": None, "state": None, "trained": False}
            try:
                answer["update"] = orchestrator.run_client(task.round, task, tally)
            except Exception as err:  # noqa: BLE001 - the server raises it, as one process would, and stops
                kind = (
                    "diverged" if isinstance(err, Diverged) else "config" if isinstance(err, ConfigError) else "other"
                )
                answer["error"] = {
                    "kind": kind, "message": str(err), "round": getattr(err, "round", task.round), "client": cid
                }  # fmt: skip
            answer["events"], answer["steps"] = dict(tally.events), dict(tally.steps)
            answer["trained"] = answer["error"] is None and not tally.events.get("crash")
            if answer["trained"]:
                kept = client_states.get(cid)
                answer["state"] = kept
                answer["state_bytes"] = records.put(context.state, name, kept) if kept else 0
                if not kept:  # a state the client emptied goes from the node's copy too
                    for part in (f"{name}.arrays", f"{name}.structure"):
                        context.state.pop(part, None)
            answers.append(answer)
            if answer["error"] is not None:  # one process stops at the first failing client
                break
        return answers


_NODES: dict[str, _Node] = {}  # per recipe: a process keeps its built run across messages


def _node(context: Context) -> _Node:
    import shlex

    config = context.state.get(RECIPE)
    if not isinstance(config, ConfigRecord):
        raise RuntimeError("this SuperNode received a task before the run's recipe")
    recipe = str(config["text"])
    # the node's own flrun fit options (node config fit-args), e.g. where this machine keeps the data set's files
    node_args = shlex.split(str(context.node_config.get("fit-args", "")))
    key = hashlib.sha256("\0".join([recipe, *node_args]).encode()).hexdigest()
    if key not in _NODES:
        _NODES.clear()  # another run's: one at a time per process
        _NODES[key] = _Node(recipe, node_args)
    return _NODES[key]


def client_app() -> ClientApp:
    """The ClientApp that serves any recipe's tasks (the recipe comes from the ServerApp)."""
    app = ClientApp()

    @app.query()
    def query(message: Message, context: Context) -> Message:
        context.state[RECIPE] = message.content[RECIPE]
        built = _node(context)  # built now: a recipe this node cannot run fails before the first round
        config = context.node_config
        partition, partitions = int(str(config.get("partition-id", 0))), int(str(config.get("num-partitions", 1)))
        sha = str((built.orchestrator.output.run_info or {}).get("partition_sha256"))
        info = ConfigRecord({"partition-id": partition, "num-partitions": partitions, "partition-sha256": sha})
        return Message(RecordDict({"node": info}), reply_to=message)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        tasks, _ = records.take(message.content, "tasks")
        answers = _node(context).run(tasks, context)
        content = RecordDict()
        records.put(content, "replies", answers)
        return Message(content, reply_to=message)

    return app
