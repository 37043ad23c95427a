"""Several processes (ranks) run one federation together; this module starts them and connects them.

Each rank trains a share of every phase's clients (``sharding.py``) and holds a full, identical copy of
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
:func:`launch` unless they fail.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import math
import os
import pickle
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import IO, Any

import torch

from .errors import ConfigError

GRACE_S = 30.0  # after a rank fails, how long the others get to stop on their own (rank 0 writes its summary)
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
            ranks.scratch = Path(tempfile.mkdtemp(prefix=f"flrun-rank{ranks.rank}-"))
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
            dist.barrier()  # a rank that is done must not remove its last message before the others have read it
            _current.mailbox.close()
        dist.destroy_process_group()
    _current = Ranks()


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
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(_current.world)]
    dist.all_gather(sizes, torch.tensor([message.numel() if posted else -message.numel()], dtype=torch.int64))
    sizes = [int(size) for size in sizes]
    if all(size > 0 for size in sizes):
        gathered = [message if i == me else mailbox.read(i, size) for i, size in enumerate(sizes)]
    else:
        longest = max(abs(size) for size in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8)
        padded[: message.numel()] = message
        gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(_current.world)]
        dist.all_gather(gathered, padded)
    if mailbox is not None:
        mailbox.done()
    return [obj if i == me else unpack(gathered[i], _current.device) for i in range(_current.world)]


MAILBOX_ENV = "FLRUN_EXCHANGE_DIR"  # the folder launch() made for its ranks' mailbox


def make_mailbox_folder() -> str:
    """A new private folder for a mailbox, in shared memory (``/dev/shm``) where the machine has it."""
    shared = Path("/dev/shm") if Path("/dev/shm").is_dir() else None
    return tempfile.mkdtemp(prefix="flrun-exchange-", dir=shared)


class Mailbox:
    """Messages between the ranks of one machine as files in shared memory (``/dev/shm`` where there is one).

    Rank 0 makes the folder; every rank writes its message of an exchange to its own file, and after the
    all-gather of the sizes (which every rank reaches only once it has written) reads the others'. Two slots
    alternate: a rank writes exchange k + 2 into the slot of exchange k only after passing exchange k + 1's
    all-gather, which no rank enters before it has read exchange k. The folder goes when the run ends, after
    a barrier (rank 0 removes it, each rank its own files; at exit too, when a run fails).

    Args:
        folder: the shared folder.
        rank: this rank.
    """

    def __init__(self, folder: Path, rank: int):
        self.folder, self.rank, self.exchanges = folder, rank, 0

    @classmethod
    def open(cls, rank: int, world: int) -> Mailbox | None:
        """The mailbox of a group whose ranks all run on this machine and see one folder; None otherwise."""
        import torch.distributed as dist

        folder = None
        if rank == 0:
            # flrun fit --runtime.devices N made it (and removes it however the ranks end); else a new one
            folder = os.environ.get(MAILBOX_ENV) or None
            if folder is None:
                with contextlib.suppress(OSError):
                    folder = make_mailbox_folder()
        places: list[Any] = [None] * world
        dist.all_gather_object(places, (socket.gethostname(), folder))
        hosts, folder = {host for host, _ in places}, places[0][1]
        sees = torch.tensor([int(len(hosts) == 1 and folder is not None and Path(folder).is_dir())])
        dist.all_reduce(sees, op=dist.ReduceOp.MIN)  # one rank that cannot see the folder: nobody uses it
        if not bool(sees):
            if folder is not None and rank == 0:
                shutil.rmtree(folder, ignore_errors=True)
            return None
        mailbox = cls(Path(folder), rank)
        atexit.register(mailbox.close)
        return mailbox

    def _path(self, rank: int) -> Path:
        return self.folder / f"rank{rank}-slot{self.exchanges % 2}"

    def post(self, message: torch.Tensor) -> bool:
        """Writes this rank's message of the current exchange; False when it cannot (e.g. the folder is full)."""
        path = self._path(self.rank)
        try:
            with open(path, "wb") as f:
                f.write(memoryview(message.numpy()))
        except OSError:
            with contextlib.suppress(OSError):
                path.unlink()  # a partial file would keep a full /dev/shm full
            return False
        return True

    def read(self, rank: int, size: int) -> torch.Tensor:
        """Rank ``rank``'s message of the current exchange (``size`` bytes, as its all-gathered size says)."""
        data = bytearray(size)
        with open(self._path(rank), "rb") as f:
            if f.readinto(data) != size:
                raise RuntimeError(f"rank {rank}'s message in {self.folder} is shorter than the {size} bytes it sent")
        return torch.frombuffer(data, dtype=torch.uint8)

    def done(self) -> None:
        """The current exchange is over on this rank: the next one uses the other slot."""
        self.exchanges += 1

    def close(self) -> None:
        """Removes this rank's files (and the folder, for rank 0)."""
        for slot in (0, 1):
            with contextlib.suppress(OSError):
                (self.folder / f"rank{self.rank}-slot{slot}").unlink()
        if self.rank == 0:
            shutil.rmtree(self.folder, ignore_errors=True)


_ALIGN = 16  # every part of a message starts at a multiple of the widest element (complex128)


def _aligned(count: int) -> int:
    return -(-count // _ALIGN) * _ALIGN


def pack(obj: Any) -> torch.Tensor:
    """``obj`` as one byte tensor: the pickled structure's length, the structure, then every tensor's bytes.

    Tensors are not pickled one by one (``torch.save`` writes a zip archive, ``all_gather_object`` pickles
    that again): the structure refers to each dense tensor by dtype and shape, and its bytes follow in
    order. A tensor met twice (tied weights) is sent once and arrives as one tensor again; other kinds
    (sparse, quantized, subclasses) go through ``torch.save`` inside the structure. Only :func:`unpack` of
    a rank this run started reads a message: in-memory traffic, never a file.
    """
    tensors: list[torch.Tensor] = []
    seen: dict[int, int] = {}

    class _Pickler(pickle.Pickler):
        def persistent_id(self, value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return None  # pickled as usual
            if id(value) in seen:
                return ("again", seen[id(value)])
            dense = value.layout == torch.strided and not value.is_quantized
            if not dense or type(value) not in (torch.Tensor, torch.nn.Parameter):
                saved = io.BytesIO()
                torch.save(value, saved)
                return ("saved", saved.getvalue(), value.is_cpu)
            seen[id(value)] = len(tensors)
            tensors.append(value.detach().resolve_conj().resolve_neg().to("cpu").contiguous())
            kind = "parameter" if type(value) is torch.nn.Parameter else "tensor"
            return (kind, value.dtype, tuple(value.shape), value.requires_grad, value.is_cpu)

    head = io.BytesIO()
    _Pickler(head, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    structure = head.getvalue()
    parts, used = [torch.tensor([len(structure)], dtype=torch.int64).view(torch.uint8)], 8
    for part in [torch.frombuffer(bytearray(structure), dtype=torch.uint8)] + [
        t.reshape(-1).view(torch.uint8) for t in tensors if t.numel()
    ]:
        padding = _aligned(used) - used
        if padding:
            parts.append(torch.zeros(padding, dtype=torch.uint8))
        parts.append(part)
        used += padding + part.numel()
    return torch.cat(parts)


def unpack(message: torch.Tensor, device: torch.device) -> Any:
    """The object :func:`pack` made of ``message`` (which may be longer), its tensors copies.

    A tensor sent from CPU arrives on CPU, where one process keeps it too (Adam's step count, generator
    states); a tensor sent from an accelerator arrives on ``device``, this rank's own.
    """
    length = int(message[:8].view(torch.int64))
    start = _aligned(8)
    structure, offset = message[start : start + length].numpy().tobytes(), start + length
    made: list[torch.Tensor] = []

    class _Unpickler(pickle.Unpickler):
        def persistent_load(self, pid: Any) -> torch.Tensor:
            nonlocal offset
            if pid[0] == "again":
                return made[pid[1]]
            if pid[0] == "saved":
                return torch.load(io.BytesIO(pid[1]), map_location="cpu" if pid[2] else device, weights_only=False)
            kind, dtype, shape, requires_grad, on_cpu = pid
            place = torch.device("cpu") if on_cpu else device
            count = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            if count:
                offset = _aligned(offset)
                # a copy: a view would keep the whole message alive as long as any of its tensors
                tensor = message[offset : offset + count].view(dtype).reshape(shape).to(place, copy=True)
                offset += count
            else:
                tensor = torch.empty(shape, dtype=dtype, device=place)
            if kind == "parameter":
                tensor = torch.nn.Parameter(tensor, requires_grad=requires_grad)
            else:
                tensor.requires_grad_(requires_grad)
            made.append(tensor)
            return tensor

    return _Unpickler(io.BytesIO(structure)).load()


# ---------------------------------------------------------------------- flrun fit --runtime.devices N
def launch(argv: list[str], devices: int) -> int:
    """Runs ``python -m fl_lightning *argv`` as ``devices`` ranks on this machine; returns the exit status.

    Rank 0 keeps this terminal (progress bar, messages, the final lines). The other ranks' output goes to
    temporary files, shown only when such a rank fails and rank 0 has not said why itself. When a rank fails,
    the others get ``GRACE_S`` seconds to stop on their own (rank 0 writes the summary), then are terminated.
    """
    env = {
        **os.environ,
        "WORLD_SIZE": str(devices),
        "LOCAL_WORLD_SIZE": str(devices),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    command = [sys.executable, "-m", "fl_lightning", *argv]
    with contextlib.ExitStack() as files:
        # the ranks' mailbox folder is made here, so that it goes even when a rank is terminated (SIGTERM
        # skips a rank's own clean-up at exit) or killed
        with contextlib.suppress(OSError):
            env[MAILBOX_ENV] = make_mailbox_folder()
            files.callback(shutil.rmtree, env[MAILBOX_ENV], True)
        logs = [None] + [files.enter_context(tempfile.TemporaryFile()) for _ in range(devices - 1)]
        processes = [
            subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=logs[r], stderr=logs[r])
            for r in range(devices)
        ]
        previous = signal.signal(signal.SIGTERM, lambda *_: _terminate(processes))  # a job scheduler's stop
        try:
            first_failure, killed = _wait(processes)
        except KeyboardInterrupt:  # the terminal interrupted every rank too: they stop and keep their checkpoint
            _wait(processes, stopping=True)
            return 130
        finally:
            signal.signal(signal.SIGTERM, previous)
        codes = [p.returncode for p in processes]
        if codes[0] != 0 and 0 not in killed and (codes[0] == 2 or first_failure == 0):
            return codes[0]  # rank 0 said what went wrong (a user error, a divergence, its own traceback)
        if first_failure is None:
            return 0
        code = codes[first_failure]
        _show_log(first_failure, code, logs[first_failure])
        return code if code > 0 else 1


def _show_log(rank: int, code: int, log: IO[bytes] | None) -> None:
    """The end of a failed rank's output (rank 0's went to the terminal already)."""
    how = f"exit status {code}" if code > 0 else f"killed by signal {-code}"
    tail = []
    if log is not None:
        log.seek(0)
        tail = log.read().decode(errors="replace").splitlines()[-40:]
    print(f"flrun fit: rank {rank} failed ({how}){':' if tail else '.'}", *tail, sep="\n", file=sys.stderr)


def _wait(processes: list[subprocess.Popen], stopping: bool = False) -> tuple[int | None, set[int]]:
    """Waits for every rank; returns the first to fail and those terminated after the grace period."""
    first_failure, failed_at, killed = None, time.monotonic() if stopping else None, set()
    while None in [p.poll() for p in processes]:  # every process polled: each one's exit is seen when it happens
        if first_failure is None:
            failing = [r for r, p in enumerate(processes) if p.returncode not in (None, 0)]
            if failing:
                first_failure, failed_at = failing[0], time.monotonic()
        if failed_at is not None and time.monotonic() - failed_at > GRACE_S:
            killed = {r for r, p in enumerate(processes) if p.poll() is None}
            _terminate(processes)
            for p in processes:
                p.wait()
            break
        time.sleep(0.05)
    if first_failure is None:
        failing = [r for r, p in enumerate(processes) if p.returncode not in (None, 0) and r not in killed]
        first_failure = failing[0] if failing else None
    return first_failure, killed


def _terminate(processes: list[subprocess.Popen]) -> None:
    for p in processes:
        if p.poll() is None:
            p.terminate()


def free_port() -> int:
    """A TCP port free on this machine now (the rendezvous of the ranks :func:`launch` starts)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
