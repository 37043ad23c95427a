"""``flrun fit``: build the objects of a recipe and run the orchestrator. Its signature is the schema."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from . import __version__
from .asynchrony import AsynchronousSchedule
from .checkpoint import load_checkpoint
from .client.loop import LocalLoop, LocalTraining
from .data import FederatedData
from .errors import ConfigError
from .evaluation import PersonalEvaluation
from .models import ModelSpec
from .orchestrator import FederationOrchestrator
from .population import Population
from .ranks import connect_ranks, join_ranks, leave_ranks
from .robustness import Faults
from .run_state import check_monitor, check_resume
from .sampling import ClientSampler, UniformSampler
from .strategies import Strategy
from .strategies.base import roles_to_build
from .tracking import RunFiles, RunLock, RunLogger, resolve_loggers


@dataclass
class Runtime:
    """Where and how fast the simulation runs.

    Attributes:
        accelerator: Lightning Fabric accelerator (``cpu``, ``cuda``, ``auto``).
        precision: Fabric precision (``32-true``, ``bf16-mixed``, ``16-mixed``).
        executor: how a phase's clients train: ``sequential`` one after another; ``batched`` the clients of
            one architecture as one vmapped computation per step (``client/batched.py``; same numbers to
            float tolerance, not bit for bit); ``auto`` batched on a GPU, sequential on CPU (where batching
            measured slower for small models, docs/performance.md).
        batch_clients: at most this many clients per batched computation (bounds GPU memory).
        num_threads: torch CPU threads. 1 is the measured best for small models on 2 cores (up to 10x
            faster than torch's default, docs/performance.md); raise it for large CPU models.
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
            shape and learning rate (``client/graphs.py``): the sequential loop without its per-step host
            cost. Needs a CUDA device, precision ``32-true`` and the sequential executor (``auto`` picks it);
            steps that cannot be replayed faithfully run eagerly, counted in ``summary.json``. SGD runs give
            the eager run's numbers bit for bit; Adam and AdamW run in their ``capturable`` mode (the numbers of
            ``capturable: true`` without graphs, float rounding away from the default Adam's). Experimental:
            its speed is not yet measured on a GPU (docs/performance.md).
    """

    accelerator: str = "auto"
    precision: str = "32-true"
    executor: Literal["auto", "sequential", "batched"] = "auto"
    batch_clients: int = 64
    num_threads: int | None = 1
    flush_denormal: bool = True
    deterministic: bool = True
    progress: bool = True
    client_state_memory_mb: float | None = 1024.0
    devices: int = 1
    cuda_graphs: bool = False

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
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(
                f"runtime.num_threads must be at least 1, got {self.num_threads}; use 1 for small models "
                "or null for torch's default."
            )

    def apply(self, local_rank: int = 0):
        """Applies the torch settings and returns the run's ``lightning.Fabric`` (on GPUs: GPU ``local_rank``).

        Fabric is imported here, not at the top (:mod:`fl_lightning.fabric_loader`: Fabric alone, without
        the rest of Lightning): jsonargparse reads this module's annotations to build the parser, so
        ``flrun fit --help`` and recipe errors would wait for it.
        """
        if self.num_threads is not None:
            torch.set_num_threads(self.num_threads)
        torch.set_flush_denormal(self.flush_denormal)
        torch.use_deterministic_algorithms(self.deterministic, warn_only=True)
        # deterministic kernels without deterministic mode's debugging aid of filling every tensor torch allocates
        # uninitialised with NaN: 19 fills more per digits-CNN training step, 5 per MLP step; numbers unchanged
        torch.utils.deterministic.fill_uninitialized_memory = False
        devices: int | list[int] = 1
        if local_rank and self.accelerator in ("auto", "cuda", "gpu") and torch.cuda.is_available():
            devices = [local_rank % torch.cuda.device_count()]  # modulo: a Slurm task may see one GPU only
        from .fabric_loader import fabric_class, single_process_environment

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


SHARED_STATE_SEQUENTIAL = (
    "optimizer_state shared: each client continues the previous client's optimizer state, so clients cannot "
    "train at once (shared_per_phase can)"
)


def resolve_executor(runtime: Runtime, device: torch.device, training: LocalTraining) -> tuple[str, str | None]:
    """``sequential`` or ``batched`` for this run (``auto``: batched on a GPU), and why ``auto`` chose
    sequential where it would have batched (summary.json says so), else None."""
    if training.optimizer_state == "shared":  # each client continues the previous client's optimizer state
        if runtime.executor == "batched":
            raise ConfigError(
                "runtime.executor batched cannot train with training.optimizer_state shared (each client starts "
                "from the previous client's optimizer state, so clients cannot train at once); use executor "
                "sequential or auto, or optimizer_state shared_per_phase (one state per role taken at each phase's "
                "start), reset or per_client."
            )
        would_batch = runtime.executor == "auto" and device.type == "cuda" and not runtime.cuda_graphs
        return "sequential", SHARED_STATE_SEQUENTIAL if would_batch else None
    if runtime.executor == "auto":
        return "batched" if device.type == "cuda" and not runtime.cuda_graphs else "sequential", None
    return runtime.executor, None


def fit(
    data: FederatedData,
    models: dict[str, ModelSpec],
    strategy: Strategy,
    population: Population = Population(),  # noqa: B008 (the CLI reads defaults here; never mutated)
    sampler: ClientSampler | None = None,
    schedule: AsynchronousSchedule | None = None,
    training: LocalTraining = LocalTraining(),  # noqa: B008 (as above)
    rounds: int = 50,
    eval_every: int = 1,
    evaluation: PersonalEvaluation | None = None,
    seed: int = 0,
    output_dir: str | None = None,
    resume: str | None = None,
    logger: str | RunLogger | list[str | RunLogger] = "csv",
    runtime: Runtime = Runtime(),  # noqa: B008 (as above)
    checkpoint_every: int = 1,
    stop_after: int | None = None,
    monitor: str | None = None,
    divergence: Literal["stop", "drop"] = "stop",
    faults: Faults | None = None,
    name: str | None = None,
    reference: dict[str, Any] | None = None,
    resolved_config: str | None = None,
) -> dict[str, Any]:
    """Run a federated experiment and write its run directory.

    Args:
        data: the federated data set (class_path of a FederatedData, e.g. fl_lightning.data.DigitsData).
        models: model roles, each a registered builder and its arguments (see ``flrun models``).
        strategy: the federated algorithm (class_path of a Strategy, e.g. fl_lightning.strategies.FedAvg).
        population: clients, tiers and the roles each tier trains.
        sampler: which clients join each round (all clients when not given).
        schedule: asynchronous mode (fl_lightning.asynchrony.AsynchronousSchedule: simulated client speeds,
            the server handles each arrival as it comes); synchronous rounds when not given.
        training: local training of every client (optimizer, steps or epochs, batch size, schedule).
        rounds: number of communication rounds.
        eval_every: evaluate every k rounds (and after the last round).
        evaluation: which clients a personalized evaluation covers: ``sample: k`` a seeded sample of k per
            evaluation (all of them after the last round), ``untrained: skip`` only those that have trained;
            every client at every evaluation when not given.
        seed: the run seed; the same seed gives the same numbers on CPU.
        output_dir: run directory; ``runs/<name>/seed<seed>`` when not given.
        resume: ``auto`` resumes from ``<output_dir>/checkpoints/last.ckpt`` if it exists, or a checkpoint path.
        logger: ``csv`` (always written), ``wandb``, ``tensorboard``, a RunLogger class_path, or a list.
        runtime: accelerator, precision, CPU threads, determinism, the progress bar and the ranks (devices).
        checkpoint_every: checkpoint every k rounds (and at the end).
        stop_after: end this invocation after that round, e.g. to fit a job's time limit; resume later.
        monitor: metric that decides the best round (default: the strategy's main accuracy).
        divergence: a client update with NaN or infinite values ``stop``s the run (exit 2, the last good
            checkpoint kept, ``diverged: true`` in summary.json) or is ``drop``ped (counted in
            ``faults/dropped_nonfinite``). Non-finite server or evaluation metrics always stop it.
        faults: faults injected into the clients (crash, nan, straggle, drop_upload rates; seeded per round
            and client); none when not given.
        name: run name, used for the default output_dir and W&B; the recipe's file name by default.
        reference: the paper's reported numbers for this recipe (kept in summary.json for reports).
        resolved_config: the resolved YAML (written by the CLI; not a recipe option).

    Returns:
        The summary written to ``summary.json``.
    """
    name = name or "run"
    _check_counts(rounds=rounds, eval_every=eval_every, checkpoint_every=checkpoint_every, stop_after=stop_after)
    if seed < 0:
        raise ConfigError(f"seed must be a non-negative integer, got {seed}; e.g. --seed 0.")
    undefined = [role for role in population.roles() if role not in models]
    if undefined:  # checked before any data is loaded
        raise ConfigError(
            f"population tiers use model role(s) {undefined} that `models` does not define (defined: "
            f"{sorted(models) or 'none'}); add them under models, e.g. models: {{{undefined[0]}: {{builder: "
            "digits_cnn}}, or change the tiers' roles."
        )
    server_only = [role for role in strategy.server_roles() if role not in models]
    if server_only:
        raise ConfigError(
            f"the strategy's server model role(s) {server_only} are not defined under models (defined: "
            f"{sorted(models) or 'none'}); add them, e.g. models: {{{server_only[0]}: {{builder: digits_mlp}}}}, "
            "or name a defined role in the strategy's server_role."
        )
    files = RunFiles(output_dir or Path("runs") / name / f"seed{seed}")
    check_output_dir(files.root)
    ranks = join_ranks(runtime.devices, schedule, training.optimizer_state)  # several if launched as several
    with RunLock(files.root, enabled=ranks.writes) as lock:
        if files.root.is_dir():  # before its checkpoint is read: another process may be writing the run
            lock.acquire()
        checkpoint = _find_checkpoint(resume, files)
        fabric = runtime.apply(ranks.local_rank)
        connect_ranks(ranks, fabric.device)

        clients = population.build(seed)
        data.setup(len(clients), seed)
        data.to(fabric.device)
        partition = data.partition_summary()

        loop = LocalLoop(fabric, training, rounds)
        loop.build_slots(
            models,
            roles_to_build(population.roles(), strategy),
            seed,
            num_classes=data.num_classes,
            in_channels=int(data.x.shape[1]) if data.x.dim() == 4 else 1,
        )
        if runtime.cuda_graphs:
            from .client.graphs import StepGraphs, backend_for, prepare_optimizer

            loop.graphs = StepGraphs(backend_for(fabric.device))
            for slot in loop.slots.values():
                prepare_optimizer(slot.optimizer)  # Adam: capturable, for eager steps and replays alike
        loggers = resolve_loggers(logger) if ranks.writes else []  # rank 0 alone logs
        run_info = {
            "name": name,
            "config_sha256": hashlib.sha256((resolved_config or "").encode()).hexdigest() if resolved_config else None,
            "partition_sha256": partition["sha256"],
            "reference": reference,
            "versions": _versions(),
            "hardware": hardware(fabric.device, ranks.world),
        }
        if checkpoint is not None:
            resumes = check_resume(checkpoint, run_info, resolved_config, rounds, files.root)
            if monitor is not None and checkpoint.get("last_eval"):  # refused before anything is written
                check_monitor(monitor, checkpoint["last_eval"]["metrics"])
            if resumes:
                run_info["resumed_with"] = resumes
            if ranks.writes:  # a user (and a table run's log) must see that this continues an earlier run
                print(_resuming_line(checkpoint, rounds, resume, files, stop_after), file=sys.stderr, flush=True)
        elif resume == "auto" and ranks.writes:
            print(f"--resume auto: no checkpoint in {files.root}; starting a new run.", file=sys.stderr, flush=True)
        executor, sequential_why = resolve_executor(runtime, fabric.device, training)
        orchestrator = FederationOrchestrator(
            strategy,
            clients,
            sampler or UniformSampler(),
            loop,
            data,
            files,
            loggers,
            rounds,
            seed,
            eval_every=eval_every,
            checkpoint_every=checkpoint_every,
            stop_after=stop_after,
            monitor=monitor,
            progress=runtime.progress and ranks.writes,
            run_info=run_info,
            schedule=schedule,
            config=resolved_config,
            evaluation=evaluation,
            client_state_memory_mb=runtime.client_state_memory_mb,
            executor=executor,
            sequential_why=sequential_why,
            batch_clients=runtime.batch_clients,
            faults=faults,
            divergence=divergence,
        )
        # every check has passed: only now is the run directory written (a refused start changes nothing)
        if ranks.writes:  # rank 0 alone writes it
            lock.acquire()  # a new directory: created here, locked before its first file
            if checkpoint is None and (files.last_checkpoint.exists() or files.previous_checkpoint.exists()):
                # another process made the directory and saved a run there while this one set up
                raise ConfigError(
                    f"{files.root} received another process's run while this one started; pass --resume auto to "
                    "continue it or choose another --output_dir."
                )
            files.write_json(files.partition, partition)
            if resolved_config is not None:
                files.write_text(files.config, resolved_config)
        config_dict = _config_dict(resolved_config)
        for i, run_logger in enumerate(loggers):
            previous = checkpoint["loggers"][i] if checkpoint and i < len(checkpoint["loggers"]) else None
            run_logger.start(files.root, name, config_dict, previous)
        if any(run_logger.wants_images for run_logger in loggers):
            from .data_inspect import bubble_chart

            chart = bubble_chart(data, files.root / "partition.png")
            for run_logger in loggers:
                run_logger.log_image("partition/client_by_class", chart)
        summary = orchestrator.run(checkpoint)
        leave_ranks()
        for run_logger in loggers:
            run_logger.log_files([files.last_checkpoint])
            run_logger.finish(summary)
        return summary


def _check_counts(**counts: int | None) -> None:
    for key, value in counts.items():
        if value is not None and value < 1:
            raise ConfigError(f"{key} must be at least 1, got {value}; e.g. --{key} 1.")


def check_output_dir(root: Path) -> None:
    """Refuses a run directory that could never be written, before anything is loaded or trained.

    Nothing is created here: a refused start leaves the file system as it was.
    """
    where = f"--output_dir {str(root)[:80]}{'...' if len(str(root)) > 80 else ''}"
    longest = max((len(part.encode()) for part in root.parts), default=0)
    if longest > 255 or len(str(root).encode()) > 3800:  # NAME_MAX and (under) PATH_MAX of common file systems
        raise ConfigError(f"{where}: the path or one of its names is too long; choose a shorter output_dir.")
    existing = root
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(
            f"{where}: {existing} is a file, not a directory; choose another output_dir or move the file away."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: {existing} is not writable; choose an output_dir you can write to.")
    if (root / "sweep.json").is_file():  # a run's files would be mixed into the sweep's results
        raise ConfigError(f"{where} holds a sweep (sweep.json); give the run a directory of its own.")


def _find_checkpoint(resume: str | None, files: RunFiles) -> dict[str, Any] | None:
    """The checkpoint to resume from (loaded, its checksum verified), None for a fresh start."""
    if resume is None and files.last_checkpoint.exists():
        raise ConfigError(
            f"{files.root} already holds a run; pass --resume auto to continue it or choose another --output_dir."
        )
    if resume in (None, "auto") and not files.last_checkpoint.exists() and files.previous_checkpoint.exists():
        # last.ckpt moved away or not copied: a fresh start here would replace previous.ckpt, the run's only state
        raise ConfigError(
            f"{files.root} holds {files.previous_checkpoint.name} but no last.ckpt; continue from it with --resume "
            f"{files.previous_checkpoint}, or choose another --output_dir."
        )
    if resume is None:
        return None
    if resume == "auto":
        return load_checkpoint(files.last_checkpoint) if files.last_checkpoint.exists() else None
    return load_checkpoint(Path(resume))


def _resuming_line(
    checkpoint: dict[str, Any], rounds: int, resume: str | None, files: RunFiles, stop_after: int | None
) -> str:
    done = checkpoint["rounds_done"]
    source = files.last_checkpoint if resume == "auto" else Path(str(resume))
    if done >= rounds:
        return f"resuming {files.root} from {source}: all {rounds} rounds are done; only the summary is rewritten."
    if stop_after is not None and stop_after <= done:  # a job chain's rerun: the orchestrator trains nothing
        return (
            f"resuming {files.root} from {source}: {done} of {rounds} rounds done, at or past --stop_after "
            f"{stop_after}; nothing to train, only the summary is rewritten."
        )
    return f"resuming {files.root} from {source}: {done} of {rounds} rounds done, continuing with round {done + 1}."


def _config_dict(resolved_config: str | None) -> dict[str, Any]:
    if not resolved_config:
        return {}
    import yaml

    return yaml.safe_load(resolved_config) or {}


def _versions() -> dict[str, Any]:
    from .fabric_loader import lightning_version

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
        "cpu": _cpu_name(),
        "cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "ranks": world,
    }
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
    if "CUDA_VISIBLE_DEVICES" in os.environ:  # e.g. the GPU a sweep worker was given
        record["cuda_visible_devices"] = os.environ["CUDA_VISIBLE_DEVICES"]
    return record


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:  # Linux; platform.processor() there is only the architecture
            for line in info:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summary_metrics(summary: dict[str, Any]) -> str:
    """The final and best metrics as compact JSON, for the CLI's last line."""
    return json.dumps({"final": summary["final"], "best": summary["best"]}, sort_keys=True)
