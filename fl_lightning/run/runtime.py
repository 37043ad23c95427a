"""Where and how fast a run computes: the recipe's ``runtime`` settings (device, precision, threads, ranks,
the executor that trains a phase's clients, CUDA graphs) and the Fabric they give."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from ..client.training import LocalTraining
from ..federation.errors import ConfigError

# Fabric's precisions the client loop runs: it feeds the model float32 batches itself, so the "-true" precisions
# that turn the weights to 64, 16 or bf16 bits meet float32 inputs (refused here rather than in the first step)
Precision = Literal["32-true", "32", "bf16-mixed", "16-mixed"]


@dataclass
class Runtime:
    """Where and how fast the simulation runs.

    Attributes:
        accelerator: Lightning Fabric accelerator (``cpu``, ``cuda``, ``auto``).
        precision: Fabric precision: ``32-true`` (or its alias ``32``), ``bf16-mixed`` or ``16-mixed``.
        executor: how a phase's clients train: ``sequential`` one after another; ``batched`` the clients of
            one architecture as one vmapped computation per step (``client/batched/``; same numbers to
            float tolerance, not bit for bit); ``auto`` sequential for now: batching measured slower on a CPU
            for small models and has not yet been measured faster on a GPU (docs/performance.md).
        batch_clients: at most this many clients per batched computation (bounds GPU memory).
        num_threads: torch CPU threads. 1, the measured best for the smallest models, leaves the other cores
            to ranks and sweep workers; convolutional models on a CPU gain from more (docs/performance.md).
        flush_denormal: flush denormal floats to zero, which near convergence otherwise halve CPU speed.
        deterministic: ask torch for deterministic kernels (identical numbers for a seed on CPU).
        progress: show the progress bar.
        client_state_memory_mb: megabytes of per-client state (personal weights, optimizer moments) kept in
            memory; the least recently trained clients beyond it wait in their checkpoint files
            (``checkpoints/clients``). ``null`` keeps every client's state in memory. Numbers do not change.
        devices: ranks (processes) that share each phase's clients, each on its own GPU (``cuda:<local
            rank>``) or, on CPU, its own ``num_threads`` cores; ``flrun fit`` starts them on this machine.
            Under torchrun or srun leave it at 1: their process count decides (docs/performance.md).
            The numbers are those of one process.
        cuda_graphs: replay each local training step from a CUDA graph, captured per step function, batch
            shape and learning rate (``client/graphs/``): the sequential loop without its per-step host
            cost. Needs a CUDA device, precision ``32-true`` and the sequential executor (``auto`` picks it);
            steps that cannot be replayed faithfully run eagerly, counted in ``summary.json``. SGD runs give
            the eager run's numbers bit for bit; Adam and AdamW run in their ``capturable`` mode (the numbers of
            ``capturable: true`` without graphs, float rounding away from the default Adam's).
        lockstep: with the batched executor, every client of a group takes every step in the same vmapped
            call: each client's batch is padded to the batch size with a mask that losses, class statistics
            and batch norm honour, and a client that has finished its steps is left out of the update
            (``client/batched/lockstep.py``; same numbers as sequential to float tolerance). Without it,
            clients step together only while their batches have one shape.

    Experimental, off by default until a GPU measures what they pay (docs/performance.md): ``cuda_graphs``
    and ``lockstep``.
    """

    accelerator: str = "auto"
    precision: Precision = "32-true"
    executor: Literal["auto", "sequential", "batched"] = "auto"
    batch_clients: int = 64
    num_threads: int | None = 1
    flush_denormal: bool = True
    deterministic: bool = True
    progress: bool = True
    client_state_memory_mb: float | None = 1024.0
    devices: int = 1
    cuda_graphs: bool = False
    lockstep: bool = False

    def __post_init__(self):
        if self.devices < 1:
            raise ConfigError(
                f"runtime.devices must be at least 1, got {self.devices}; e.g. 2 for two GPUs or two CPU processes."
            )
        if self.client_state_memory_mb is not None and self.client_state_memory_mb < 0:
            raise ConfigError(
                f"runtime.client_state_memory_mb must be 0 or more (or null: no limit), got "
                f"{self.client_state_memory_mb}; e.g. 1024."
            )
        if self.batch_clients < 1:
            raise ConfigError(f"runtime.batch_clients must be at least 1, got {self.batch_clients}; e.g. 64.")
        if self.cuda_graphs and str(self.precision) not in ("32-true", "32"):
            raise ConfigError(
                f"runtime.cuda_graphs replays 32-bit steps only, but runtime.precision is {self.precision!r}; "
                "set runtime.precision 32-true or runtime.cuda_graphs false."
            )
        if self.cuda_graphs and self.executor == "batched":
            raise ConfigError(
                "runtime.cuda_graphs replays the sequential loop's steps, but runtime.executor is batched; set "
                "runtime.executor sequential (or auto) or runtime.cuda_graphs false."
            )
        if self.lockstep and self.cuda_graphs:
            raise ConfigError(
                "runtime.lockstep pads the batched executor's steps, and runtime.cuda_graphs replays the sequential "
                "loop's; set one of them false."
            )
        if self.lockstep and self.executor != "batched":
            raise ConfigError(
                f"runtime.lockstep pads the batched executor's steps, but runtime.executor is {self.executor}; set "
                "runtime.executor batched or runtime.lockstep false."
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(
                f"runtime.num_threads must be at least 1, got {self.num_threads}; use 1 for small models "
                "or null for torch's default."
            )

    def apply(self, local_rank: int = 0):
        """Applies the torch settings and returns the run's ``lightning.Fabric`` (on GPUs: GPU ``local_rank``).

        Fabric is imported here, not at the top (:mod:`fl_lightning.distributed.fabric`: Fabric alone, without
        the rest of Lightning): jsonargparse reads this module's annotations to build the parser, so
        ``flrun fit --help`` and recipe errors would wait for it.
        """
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        torch.set_flush_denormal(self.flush_denormal)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=True)
        # deterministic kernels without deterministic mode's debugging aid of filling every tensor torch allocates
        # uninitialised with NaN: 19 fills more per digits-CNN training step, 5 per MLP step; numbers unchanged
        torch.utils.deterministic.fill_uninitialized_memory = False  # type: ignore[attr-defined]  # a module property
        devices: int | list[int] = 1
        if local_rank and self.accelerator in ("auto", "cuda", "gpu") and torch.cuda.is_available():
            devices = [local_rank % torch.cuda.device_count()]  # modulo: a Slurm task may see one GPU only
        from ..distributed.fabric import fabric_class, single_process_environment

        try:
            return fabric_class()(
                accelerator=self.accelerator,
                devices=devices,
                precision=self.precision,
                plugins=[single_process_environment()],  # ranks are ours: Fabric must not read Slurm's settings
            )
        except (ValueError, RuntimeError, TypeError) as err:
            raise ConfigError(
                f"runtime accelerator={self.accelerator!r} / precision={self.precision!r} is not usable here "
                f"({str(err).splitlines()[0].rstrip('.')}); use accelerator cpu, cuda or auto and a precision "
                "such as 32-true, bf16-mixed or 16-mixed."
            ) from None


def resolve_executor(runtime: Runtime, training: LocalTraining) -> Literal["sequential", "batched"]:
    """``sequential`` or ``batched`` for this run. ``auto`` is sequential: on a CPU batching measured slower for
    small models, and on a GPU the batched executor has yet to be measured faster than the sequential loop
    (docs/performance.md); ``batched`` is an explicit choice."""
    if runtime.executor == "batched" and training.optimizer_state == "shared":
        raise ConfigError(
            "runtime.executor batched cannot train with training.optimizer_state shared (each client starts "
            "from the previous client's optimizer state, so clients cannot train at once); use executor "
            "sequential or auto, or optimizer_state shared_per_phase (one state per role taken at each phase's "
            "start), reset or per_client."
        )
    return "batched" if runtime.executor == "batched" else "sequential"
