"""What a run records of where it ran: package versions and the git commit, the device, CPU, threads and
ranks (reports and sweeps compare timings only between runs on the same hardware)."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from .. import __version__


def versions() -> dict[str, Any]:
    from ..distributed.fabric import lightning_version

    versions = {
        "fl_lightning": __version__,
        "torch": str(torch.__version__),  # a TorchVersion object would not load with weights_only
        "lightning": lightning_version(),
        "python": platform.python_version(),
    }
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            check=False,
            capture_output=True,
            text=True,
            timeout=5,
            cwd=Path(__file__).resolve().parent,
        )
        if commit.returncode == 0:
            versions["git_commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return versions


def hardware(device: torch.device, world: int = 1) -> dict[str, Any]:
    """Where a run's wall time comes from: its device (the GPU's name), CPU, threads and ranks.

    Timings compare only between runs on the same hardware, so reports and sweeps need it beside the
    versions; a resumed run records the hardware of its last invocation.
    """
    record: dict[str, Any] = {
        "device": str(device),
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        # PyTorch's CPU kernels pick their code path by instruction set (AVX2, AVX512, ...): runs agree bit for
        # bit only on the same one
        "cpu_instruction_set": torch.backends.cpu.get_cpu_capability(),
        "threads": torch.get_num_threads(),
        "ranks": world,
    }
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # e.g. the GPU a sweep worker was given
        record["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return record


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:  # Linux; platform.processor() there is only the architecture
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
