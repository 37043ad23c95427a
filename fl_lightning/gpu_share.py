"""Several processes on one machine's GPUs: each is given one GPU through ``CUDA_VISIBLE_DEVICES``.

Used by ``flrun sweep --n_jobs K`` (its worker processes) and ``flrun table --n_jobs K`` (its runs), so that K
processes on a machine with G GPUs spread over them instead of all training on the first.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The GPUs this process may use, each as a ``CUDA_VISIBLE_DEVICES`` entry a child process can be given.

    The process's own ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs) up to the first one CUDA would
    stop at (an empty or negative entry), or, without the setting, the index of every GPU torch sees.
    """
    environ = os.environ if environ is None else environ
    if "CUDA_VISIBLE_DEVICES" in environ:
        entries = []
        for entry in environ["CUDA_VISIBLE_DEVICES"].split(","):
            entry = entry.strip()
            if not entry or entry.startswith("-"):
                break
            entries.append(entry)
        return entries
    import torch

    return [str(index) for index in range(torch.cuda.device_count())]


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
