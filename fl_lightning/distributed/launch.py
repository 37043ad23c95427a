"""``flrun fit --runtime.devices N`` on one machine: the same command re-run as N ranks, as torchrun does, with
rank 0 on the terminal, the others' output shown only when they fail, and every rank ended together (also when
the launcher itself is killed: each rank follows it, ``gpu_share.follow_parent``)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import IO

from .capacity import check_capacity
from .gpu_share import as_child
from .messages import MAILBOX_ENV, SCRATCH_ENV, make_mailbox_folder

log = logging.getLogger(__name__)

GRACE_S = 30.0  # after a rank fails, how long the others get to stop on their own (rank 0 writes its summary)
LAUNCHED_ENV = "FLRUN_LAUNCHED"  # set for the ranks this launcher starts
LOST_STATUS = 3  # a rank's exit when it lost the others (it says nothing: the launcher names the rank that ended)


def launch(argv: list[str], devices: int, accelerator: str = "auto") -> int:
    """Runs ``python -m fl_lightning *argv`` as ``devices`` ranks on this machine; returns the exit status.

    Rank 0 keeps this terminal (progress bar, messages, the final lines). The other ranks' output goes to
    temporary files, shown only when such a rank fails and rank 0 has not said why itself. When a rank fails,
    the others get ``GRACE_S`` seconds to stop on their own (rank 0 writes the summary), then are terminated.
    Ranks that the machine's cores (on CPU) or free memory cannot hold are refused before any starts.
    """
    check_capacity(devices, accelerator)
    env = {
        **os.environ,
        "WORLD_SIZE": str(devices),
        "LOCAL_WORLD_SIZE": str(devices),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        LAUNCHED_ENV: "1",
    }
    command = [sys.executable, "-m", "fl_lightning", *argv]
    with contextlib.ExitStack() as files:
        # the ranks' mailbox folder is made here, so that it goes even when a rank is terminated (SIGTERM
        # skips a rank's own clean-up at exit) or killed
        with contextlib.suppress(OSError):
            env[MAILBOX_ENV] = make_mailbox_folder()
            files.callback(shutil.rmtree, env[MAILBOX_ENV], True)
        # the ranks' scratch folders (spilled client states) go inside one that is removed here for the same reason
        with contextlib.suppress(OSError):
            env[SCRATCH_ENV] = tempfile.mkdtemp(prefix="flrun-ranks-")
            files.callback(shutil.rmtree, env[SCRATCH_ENV], True)
        logs = [None] + [files.enter_context(tempfile.TemporaryFile()) for _ in range(devices - 1)]
        processes = [
            subprocess.Popen(
                command, env=as_child({**env, "RANK": str(r), "LOCAL_RANK": str(r)}), stdout=logs[r], stderr=logs[r]
            )
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
        said = codes[0] > 0 and codes[0] != LOST_STATUS and 0 not in killed
        if said and (codes[0] == 2 or first_failure == 0):
            return codes[0]  # rank 0 said what went wrong (a user error, a divergence, its own traceback)
        if first_failure is None:
            return 0
        ended = first_failure if codes[first_failure] != LOST_STATUS else _first_not_lost(codes, first_failure)
        code = codes[ended]
        _show_log(ended, code, logs[ended])
        return code if code > 0 else 128 - code


def _first_not_lost(codes: list[int | None], fallback: int) -> int:
    """The rank that ended by itself (not one that stopped because it lost the others), else ``fallback``."""
    return next((r for r, code in enumerate(codes) if code not in (0, None, LOST_STATUS)), fallback)


def _show_log(rank: int, code: int, output: IO[bytes] | None) -> None:
    """Which rank ended and how, after the end of its output (rank 0's went to the terminal already)."""
    how = f"exit status {code}" if code > 0 else f"killed by {_signal_name(-code)}"
    tail = []
    if output is not None:
        output.seek(0)
        tail = output.read().decode(errors="replace").splitlines()[-40:]
    if tail:
        log.error("%s", "\n".join([f"flrun fit: output of rank {rank}:", *tail]))
    log.error(
        "flrun fit: rank %d ended (%s) and the run stopped; the last checkpoint is intact: run the same command "
        "with --resume auto to continue.",
        rank,
        how,
    )


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


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
