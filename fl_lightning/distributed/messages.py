"""Messages between ranks: any object of tensors and plain values as one flat byte tensor (:func:`pack`,
:func:`unpack`: no pickle of code, every tensor's dtype and shape kept), and the :class:`Mailbox` that passes
them through files in shared memory between the ranks of one machine."""

from __future__ import annotations

import atexit
import contextlib
import io
import math
import os
import pickle
import shutil
import socket
import tempfile
from pathlib import Path
from typing import Any

import torch

MAILBOX_ENV = "FLRUN_EXCHANGE_DIR"  # the folder launch() made for its ranks' mailbox
SCRATCH_ENV = "FLRUN_SCRATCH_DIR"  # the folder launch() made for its ranks' scratch folders


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
                f.write(memoryview(message.numpy()))  # type: ignore[arg-type]  # numpy's stubs lack __buffer__
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
