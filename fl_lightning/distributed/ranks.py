"""Several processes (ranks) run one federation together; this module connects them.

Each rank trains a share of every phase's clients (``run.sharding``) and holds a full, identical copy of
everything else: the server state, the client states, the history. It keeps its own single-device Fabric;
the federation's exchanges go through ``torch.distributed`` directly (gloo on CPU; on GPUs NCCL joins the
group, and objects still travel through gloo in CPU memory). Fabric's DDP strategy is not used: it would
wrap the client models in DistributedDataParallel and average gradients, but here each rank trains other
clients.

Three ways to start the ranks:

- ``flrun fit --runtime.devices N``: :func:`launch` re-runs the same command N times on this machine with
  ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as torchrun does.
- ``torchrun --nproc_per_node N -m fl_lightning fit ...`` (one machine or several): torchrun sets them.
- ``srun flrun fit ...`` in a Slurm allocation: every task of the step is a rank (``SLURM_PROCID``,
  ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``); the first node of the step is the rendezvous. A batch
  script's own shell is no step, so ``flrun fit`` run there without srun is a single process.

On GPUs a rank uses ``cuda:<local rank>`` (modulo the visible GPUs, so a task that sees one GPU uses it).
Only rank 0 writes the run directory, logs and shows progress; the other ranks' output is kept back by
:func:`~fl_lightning.distributed.launch.launch` unless they fail. The messages between ranks are
:mod:`fl_lightning.distributed.messages`'.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from ..federation.errors import ConfigError, RankLost
from .messages import SCRATCH_ENV, Mailbox, pack, unpack

TIMEOUT = timedelta(hours=2)  # one exchange's wait: a phase of a paper-scale model can run long on one rank


@dataclass
class Ranks:
    """This process's place among the ranks.

    Attributes:
        rank: 0 for the process that writes the run directory.
        world: how many ranks run the federation (1: this process alone).
        local_rank: the rank's number on its machine (its GPU).
        address: the rendezvous host (``MASTER_ADDR``), None for a single process.
        port: the rendezvous port (``MASTER_PORT``).
        device: the rank's Fabric device, set by :func:`connect_ranks`.
        scratch: where a rank other than 0 spills client states beyond the memory budget (never the run
            directory, which is rank 0's alone); None for rank 0.
        mailbox: the shared-memory folder that carries the exchanges when every rank runs on this machine
            (:class:`Mailbox`); None otherwise.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    address: str | None = None
    port: int | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    scratch: Path | None = None
    mailbox: Mailbox | None = None

    @property
    def writes(self) -> bool:
        """Whether this rank writes files, logs and shows progress (rank 0 alone)."""
        return self.rank == 0


_current = Ranks()


def current_ranks() -> Ranks:
    """The ranks this process belongs to (a single process unless :func:`connect_ranks` joined a group)."""
    return _current


def from_env(environ: dict[str, str] | None = None) -> Ranks:
    """The ranks a launcher (this module's, torchrun's or srun's) set in the environment; one process if none."""
    env = os.environ if environ is None else environ
    try:
        if "RANK" in env and "WORLD_SIZE" in env:
            rank, world, local = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", "0"))
            address, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT")
            if world > 1 and (not address or not port):
                raise ConfigError(
                    f"RANK and WORLD_SIZE are set (rank {rank} of {world}) but MASTER_ADDR or MASTER_PORT is not; "
                    "start the ranks with flrun fit --runtime.devices N, torchrun or srun, which set them."
                )
        elif "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:  # a task of an srun step
            rank, world, local = int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"]), int(env["SLURM_LOCALID"])
            nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST", "")
            address = env.get("MASTER_ADDR") or first_node(nodes)
            # every task derives the same port from the job id (as Lightning's SLURMEnvironment does)
            port = env.get("MASTER_PORT") or str(15000 + int(env.get("SLURM_JOB_ID", "0")[-4:] or 0))
        else:
            return Ranks()
    except (KeyError, ValueError) as err:
        if isinstance(err, ConfigError):
            raise
        raise ConfigError(
            f"the launcher's environment is incomplete or not a number ({err}); start the ranks with "
            "flrun fit --runtime.devices N, torchrun or srun."
        ) from None
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside a world of {world} ranks; check RANK / WORLD_SIZE.")
    if world == 1:
        return Ranks()
    assert address and port, "refused above when several ranks lack them"
    return Ranks(rank, world, local, address, int(port))


def first_node(nodes: str) -> str:
    """The first host of a Slurm node list: ``gpu[003-005,010],cpu1`` -> ``gpu003``."""
    nodes = re.sub(r"\[(.*?)[,-].*\]", r"\1", nodes)  # the first number of the first range
    nodes = re.sub(r"\[(.*?)\]", r"\1", nodes)
    return nodes.split(" ")[0].split(",")[0] or "127.0.0.1"


def needs_launch(devices: int, environ: dict[str, str] | None = None) -> bool:
    """Whether ``flrun fit`` must start ``devices`` ranks itself (no launcher has started this process as one)."""
    return devices > 1 and from_env(environ).world == 1


def join_ranks(devices: int, schedule: Any = None, optimizer_state: str = "reset") -> Ranks:
    """This process's ranks, checked against ``runtime.devices`` and what sharding supports.

    Call :func:`connect_ranks` once the Fabric device is known.
    """
    ranks = from_env()
    if devices > 1 and ranks.world == 1:
        raise ConfigError(
            f"runtime.devices {devices} starts its ranks from the command line: run flrun fit ... --runtime.devices "
            f"{devices} (or torchrun / srun), not fit() from Python (or a sweep trial), or set runtime.devices 1."
        )
    if devices > 1 and devices != ranks.world:
        raise ConfigError(
            f"runtime.devices {devices} does not match the {ranks.world} ranks the launcher (torchrun or srun) "
            "started; leave runtime.devices at 1 there: the launcher's process count decides."
        )
    if ranks.world > 1:
        check_shardable(ranks.world, schedule, optimizer_state)
    return ranks


def check_shardable(world: int, schedule: Any, optimizer_state: str) -> None:
    """Refuses what several ranks cannot run with the numbers of one process."""
    if schedule is not None:
        raise ConfigError(
            f"asynchronous rounds (schedule) run on one process for now, but {world} ranks were asked for; "
            "set runtime.devices 1 or remove schedule."
        )
    if optimizer_state == "shared":
        raise ConfigError(
            f"training.optimizer_state shared carries one optimizer state from client to client in order, so "
            f"{world} ranks cannot split the clients; set runtime.devices 1 or optimizer_state shared_per_phase "
            "(one state per role taken at each phase's start), reset or per_client."
        )


def connect_ranks(ranks: Ranks, device: torch.device) -> Ranks:
    """Joins the process group of ``ranks`` (nothing for a single process); every later exchange uses it."""
    global _current
    ranks.device = torch.device(device)
    if ranks.world > 1:
        import torch.distributed as dist

        backend = "gloo"
        if ranks.device.type == "cuda":
            torch.cuda.set_device(ranks.device)
            backend = "cpu:gloo,cuda:nccl"  # object exchanges pick gloo (CPU) in a group that has both
        dist.init_process_group(
            backend,
            init_method=f"tcp://{ranks.address}:{ranks.port}",
            rank=ranks.rank,
            world_size=ranks.world,
            timeout=TIMEOUT,
        )
        if ranks.rank > 0:
            # inside the launcher's folder where it made one: the launcher removes it even after a killed rank
            ranks.scratch = Path(tempfile.mkdtemp(prefix=f"flrun-rank{ranks.rank}-", dir=os.environ.get(SCRATCH_ENV)))
            atexit.register(shutil.rmtree, ranks.scratch, True)
        ranks.mailbox = Mailbox.open(ranks.rank, ranks.world)
    _current = ranks
    return ranks


def leave_ranks() -> None:
    """Leaves the process group at the end of a run (a failed run leaves it when the process exits)."""
    global _current
    if _current.world > 1:
        import torch.distributed as dist

        if _current.mailbox is not None:
            with lost_ranks_said():  # a rank that is done must not remove its last message before the others read it
                dist.barrier()
            _current.mailbox.close()
        dist.destroy_process_group()
    _current = Ranks()


@contextlib.contextmanager
def lost_ranks_said():
    """A collective that fails because another rank ended (gloo: "Connection reset by peer"; NCCL: a communicator
    error) raises :class:`RankLost`, one sentence, instead of the backend's traceback."""
    try:
        yield
    except (RuntimeError, OSError) as err:  # torch.distributed's errors are RuntimeErrors; a mailbox file, OSError
        cause = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise RankLost(
            f"rank {_current.rank} of {_current.world} lost contact with the other ranks ({cause[:160]}): one of them "
            "ended, and its own output says why; the last checkpoint is intact, so run the same command with "
            "--resume auto to continue."
        ) from None


def exchange(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order (this rank's own entry is ``obj`` itself).

    Each rank's object is one message (:func:`pack`). Its size goes through one all-gather, which is also
    where the ranks wait for each other; the messages themselves go through the :class:`Mailbox` when every
    rank runs on this machine (a file in shared memory each: a phase's 0.8 MB took 2.1-3.2 ms through
    gloo's loopback socket), else, or when a rank could not post its message, through a second
    all-gather. Tensors sent from an accelerator arrive on this rank's device, those sent from CPU on CPU
    (:func:`unpack`); a CPU tensor travels in the default group's gloo also when NCCL is beside it on GPUs.
    """
    import torch.distributed as dist

    message, mailbox, me = pack(obj), _current.mailbox, _current.rank
    posted = mailbox is not None and mailbox.post(message)
    # a negative size: this rank's message is not in the mailbox
    gathered_sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(_current.world)]
    with lost_ranks_said():
        size = torch.tensor([message.numel() if posted else -message.numel()], dtype=torch.int64)
        dist.all_gather(gathered_sizes, size)
    sizes = [int(size) for size in gathered_sizes]
    if mailbox is not None and all(size > 0 for size in sizes):  # every rank posted, this one too
        with lost_ranks_said():  # a rank that ended (SIGTERM, a crash) took its message file with it
            gathered = [message if i == me else mailbox.read(i, size) for i, size in enumerate(sizes)]
    else:
        longest = max(abs(size) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: message.numel()] = message
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(_current.world)]
        with lost_ranks_said():
            dist.all_gather(gathered, padded)
    if mailbox is not None:
        mailbox.done()
    return [obj if i == me else unpack(gathered[i], _current.device) for i in range(_current.world)]
