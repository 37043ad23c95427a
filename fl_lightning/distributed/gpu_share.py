"""The child processes of one command on one machine: each is given one GPU through ``CUDA_VISIBLE_DEVICES``,
and none outlives the command, however it ends (:func:`as_child` and :func:`follow_parent`; a sweep's workers,
which fail and re-queue their trial first, follow theirs in ``sweep/workers.py``).

Used by ``flrun sweep --n_jobs K`` (its worker processes) and ``flrun table --n_jobs K`` (its runs), so that K
processes on a machine with G GPUs spread over them instead of all training on the first, and by the ranks of
``flrun fit --runtime.devices N``.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import threading
import time
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
    """Asks Linux to send this process SIGTERM when its parent dies, even by SIGKILL (run in the child at its
    start; a sweep's worker, or :func:`follow_parent`)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


PARENT_ENV = "FLRUN_PARENT_PID"  # in a child's environment: the flrun command it must not outlive
FOLLOW_INTERVAL_S = 1.0  # how often a child looks whether its parent is still there
RESEND_S = 5.0  # after the parent ended, SIGTERM again this often until the child has ended


def as_child(environ: dict[str, str]) -> dict[str, str]:
    """``environ`` for a ``python -m fl_lightning`` child process (a ``flrun table`` run, a rank) that is to end
    when this process does, however this one ends (SIGKILL included): the child calls :func:`follow_parent`."""
    return {**environ, PARENT_ENV: str(os.getpid())}


def follow_parent() -> None:
    """In a child started with :func:`as_child`'s environment: SIGTERM (which ``flrun fit`` ends on, keeping its
    last checkpoint) once the parent is gone. Linux's parent-death signal comes at once; a thread that looks at
    the parent every second is the fallback elsewhere, and sends it again while the child lives on (a signal
    that arrives inside a finalizer is lost). Nothing without the variable (a command a user started)."""
    parent = os.environ.pop(PARENT_ENV, None)  # removed: this process's own children follow this process
    if not parent or not parent.isdigit():
        return
    end_with_parent()
    if os.getppid() != int(parent):  # the parent died before the request was made: nothing to wait for
        os.kill(os.getpid(), signal.SIGTERM)
        return
    threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True, name="flrun-follow-parent").start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(FOLLOW_INTERVAL_S)
    main = threading.main_thread().ident
    while True:
        time.sleep(RESEND_S if sys.platform.startswith("linux") else 0.0)  # Linux: the death signal came already
        signal.pthread_kill(main, signal.SIGTERM)
        time.sleep(RESEND_S)


def raise_interrupt(signum, frame):
    """A SIGTERM handler: ``kill PID`` interrupts like Ctrl-C, so the command ends its children first."""
    raise KeyboardInterrupt
