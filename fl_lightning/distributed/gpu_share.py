"""The child processes of one command on one machine: each is given one GPU through ``CUDA_VISIBLE_DEVICES``,
and none outlives the command.

Used by ``flrun sweep --n_jobs K`` (its worker processes) and ``flrun table --n_jobs K`` (its runs), so that K
processes on a machine with G GPUs spread over them instead of all training on the first.
"""

from __future__ import annotations

import os
import re
import signal
import sys
from collections import Counter
from collections.abc import Iterable, Sequence


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The GPUs this process may use, each as a ``CUDA_VISIBLE_DEVICES`` entry a child process can be given.

    The process's own ``CUDA_VISIBLE_DEVICES`` read as CUDA and torch read it (UUIDs when the first entry is
    one, else indices; the list ends at the first entry of another kind, and a repeated entry makes it
    empty), cut to the number of GPUs torch sees when it sees any; without the setting, every GPU's index.
    """
    environ = os.environ if environ is None else environ
    import torch

    count = torch.cuda.device_count()
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return [str(index) for index in range(count)]
    entries = _parse_visible(environ["CUDA_VISIBLE_DEVICES"])
    return entries[:count] if count else entries


def _parse_visible(value: str) -> list[str]:
    """torch.cuda's reading of ``CUDA_VISIBLE_DEVICES`` (``_parse_visible_devices``), as strings."""
    entries: list[str] = []
    prefix = next((p for p in ("GPU-", "MIG-") if value.startswith(p)), None)
    for raw in value.split(","):
        entry = raw.strip()
        if prefix is not None:
            if not entry.startswith(prefix):
                break
        else:
            digits = re.match(r"\d+", entry)
            if digits is None:  # not an index (a negative one included): the list ends here
                break
            entry = str(int(digits.group()))
        if entry in entries:  # CUDA refuses a repeated device: no GPU at all
            return []
        entries.append(entry)
    return entries


def least_used(gpus: Sequence[str], in_use: Iterable[str | None]) -> str | None:
    """The GPU with the fewest of ``in_use`` (the GPUs of the processes still running), the first listed on a
    tie, so a process that replaces an ended one takes its GPU; None without GPUs."""
    if not gpus:
        return None
    load = Counter(in_use)
    return min(gpus, key=lambda gpu: load[gpu])


def environment_for(gpu: str | None, environ: dict[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment that shows a child process ``gpu`` alone (unchanged for None)."""
    env = dict(os.environ if environ is None else environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    return env


def end_with_parent() -> None:
    """Asks Linux to send this process SIGTERM when its parent dies, even by SIGKILL (run in the child: a
    worker at its start, or as ``preexec_fn`` before a run's ``flrun fit``)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def raise_interrupt(signum, frame):
    """A SIGTERM handler: ``kill PID`` interrupts like Ctrl-C, so the command ends its children first."""
    raise KeyboardInterrupt
