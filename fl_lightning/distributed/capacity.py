"""Whether this machine can hold the processes a command would start, answered before any starts: the ranks of
``flrun fit --runtime.devices N`` (a CPU rank per core at most, no more than the free memory holds), and the
worker processes of ``flrun sweep --n_jobs K`` and runs of ``flrun table --n_jobs K`` (no more than the free
memory holds), and whether a run's models fit the memory that is free or its address-space limit (RLIMIT_AS,
``ulimit -v``).

Each is a process that imports torch and loads the data set, so it needs at least the memory this process
holds once it has read the recipe (torch imported, no data loaded yet), measured here rather than assumed. Too
many such processes exhaust the machine's memory before the first round ends; refusing them in one sentence costs
nothing.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ..federation.errors import ConfigError, allocation_bytes, is_allocation_failure

MB = 1024 * 1024
SMALLER_MODEL = "use a smaller model (models.<role>.args)"
OWN_STATES = "keep fewer clients' states in memory (runtime.client_state_memory_mb) or use a smaller model"


def check_capacity(devices: int, accelerator: str = "auto") -> None:
    """Refuses (ConfigError) ``devices`` ranks that this machine's cores (CPU ranks) or free memory cannot hold."""
    if _on_cpu(accelerator):
        cores = usable_cores()
        if devices > cores:
            raise ConfigError(
                f"runtime.devices {devices} would start {devices} CPU ranks, but this command may use {cores} "
                f"core{'s' * (cores != 1)}, and ranks beyond the cores only wait for each other; set runtime.devices "
                f"at most {cores}."
            )
    check_memory(devices, "runtime.devices", "ranks")


def check_memory(count: int, option: str, what: str) -> None:
    """Refuses (ConfigError) ``count`` new processes of this command (``what``: "ranks", "worker processes")
    that the free memory cannot hold, each taken to need at least what this process holds; ``option`` sets
    ``count``."""
    per_process, free = process_memory(), available_memory()
    if count < 2 or per_process is None or free is None or count * per_process <= free:
        return
    fits = max(free // per_process, 1)
    raise ConfigError(
        f"{option} {count} would start {count} {what} of at least {per_process // MB} MB each (what this "
        f"process holds before any data is loaded), {count * per_process // MB} MB in all, but {free // MB} MB of "
        f"memory are free; set {option} at most {fits}, or free memory."
    )


def _on_cpu(accelerator: str) -> bool:
    """Whether the ranks would compute on CPU cores (``auto`` without a GPU)."""
    if accelerator == "cpu":
        return True
    if accelerator != "auto":
        return False
    import torch

    return not torch.cuda.is_available()


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, as a job scheduler sets it), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def process_memory() -> int | None:
    """Bytes of memory this process holds alone (private pages, Linux); None where it cannot be read."""
    try:
        fields = _fields(Path("/proc/self/smaps_rollup").read_text())
    except OSError:
        return None
    private = sum(fields.get(key, 0) for key in ("Private_Clean", "Private_Dirty", "SwapPss"))
    return private * 1024 or None


def available_memory() -> int | None:
    """Bytes of memory a new process may still take: the kernel's estimate of what is available, within this
    command's control-group limit where one is set (a container, a job scheduler's allocation); None where it
    cannot be read."""
    try:
        free = _fields(Path("/proc/meminfo").read_text())["MemAvailable"] * 1024
    except (OSError, KeyError):
        return None
    limit = _cgroup_room()
    return free if limit is None else min(free, limit)


def address_space_room() -> int | None:
    """Bytes by which this process's address space may still grow under its soft RLIMIT_AS (``ulimit -v``, a job
    scheduler's memory limit); None without such a limit or where it cannot be read."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    try:
        size = _fields(Path("/proc/self/status").read_text())["VmSize"] * 1024
    except (OSError, KeyError):
        return None
    return max(soft - size, 0)


def memory_room() -> tuple[int, str] | None:
    """The bytes this process may still allocate, and what sets that: the free memory (within the cgroup's limit)
    or the address-space limit, the smaller; None where neither can be read."""
    rooms = [
        (room, why)
        for room, why in (
            (available_memory(), "memory are free"),
            (address_space_room(), "are left under this process's address-space limit (RLIMIT_AS, ulimit -v)"),
        )
        if room is not None
    ]
    return min(rooms) if rooms else None


@contextlib.contextmanager
def allocating(what: str, size: int | None = None, fix: str = SMALLER_MODEL) -> Iterator[None]:
    """Makes ``what`` (``"the model of role 'global' (builder digits_mlp)"``) of ``size`` bytes where known: an
    allocation that fails in the block ends as one sentence (ConfigError) naming it, its size (else the size of
    the allocation that failed) and ``fix``, not the allocator's trace."""
    try:
        yield
    except (MemoryError, RuntimeError) as err:
        if not is_allocation_failure(err):
            raise
        room = memory_room()
        size = size or allocation_bytes(err)  # the whole thing's size, else the allocation that failed
        request = f" ({size // MB:,} MB)" if size else ""
        left = f"; {room[0] // MB:,} MB {room[1]}" if room else ""
        raise ConfigError(
            f"there was not enough memory for {what}{request}{left}; {fix}, or run where more memory is free."
        ) from None


def _cgroup_room() -> int | None:
    """What this process's cgroup (v2) may still allocate below its ``memory.max``; None without a limit."""
    try:
        groups = Path("/proc/self/cgroup").read_text().splitlines()
        path = next(line.split(":", 2)[2] for line in groups if line.startswith("0::"))
        folder = Path("/sys/fs/cgroup") / path.lstrip("/")
        limit = (folder / "memory.max").read_text().strip()
        used = int((folder / "memory.current").read_text())
    except (OSError, StopIteration, ValueError):
        return None
    return None if limit == "max" else max(int(limit) - used, 0)


def _fields(text: str) -> dict[str, int]:
    """``Name:   123 kB`` lines as ``{name: 123}`` (kB)."""
    values = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        number = rest.split()
        if number and number[0].isdigit():
            values[name.strip()] = int(number[0])
    return values
