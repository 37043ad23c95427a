"""``flrun fit``: build the objects of a recipe and run the orchestrator. Its signature is the schema."""

from __future__ import annotations

import functools
import hashlib
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from ..client.data_fit import check_models_fit_data
from ..client.evaluation import PersonalEvaluation
from ..client.lightning import check_model_parts
from ..client.loop import LocalLoop, LocalTraining
from ..data import FederatedData
from ..data.sources import fetch_pretrained
from ..distributed.ranks import connect_ranks, join_ranks, leave_ranks
from ..federation.errors import ConfigError
from ..federation.population import Population
from ..federation.sampling import ClientSampler, UniformSampler
from ..models import ModelSpec
from ..strategies import Strategy
from ..strategies.base import roles_to_build
from ..tracking import RunFiles, RunLock, RunLogger, resolve_loggers
from .asynchrony import AsynchronousSchedule
from .checkpoint import load_checkpoint
from .orchestrator import FederationOrchestrator
from .provenance import hardware, versions
from .robustness import Faults
from .run_dir import check_output_dir, check_resume_target, check_still_ours, free_leftovers, run_id
from .runtime import Runtime, resolve_executor
from .state import check_monitor, check_resume, planned_rounds

_ONE_RUN = threading.Lock()


def _one_run_at_a_time(run: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Refuses a run while another runs in this process. A run sets process-wide state (the global random
    generators it seeds, ``torch.set_num_threads``, deterministic kernels, flush-denormal), so two at once in two
    threads would change each other's numbers; the lock is tried, never waited on. ``functools.wraps`` keeps the
    signature and docstring the command line's parser reads (defined here: the wrapper resolves the signature's
    annotations in this module)."""

    @functools.wraps(run)
    def one_run(*args, **kwargs):
        if not _ONE_RUN.acquire(blocking=False):
            raise ConfigError(
                "another fit is running in this process (in another thread), and runs share the process's random "
                "state, torch threads and precision settings; run them one after another, or in separate "
                "processes (flrun fit, or a process pool)."
            )
        try:
            return run(*args, **kwargs)
        finally:
            _ONE_RUN.release()

    return one_run


@_one_run_at_a_time
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
        schedule: asynchronous mode (fl_lightning.run.asynchrony.AsynchronousSchedule: simulated client speeds,
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

    Raises:
        ConfigError: for a recipe that cannot run, and when another run is in progress in this process (in
            another thread): runs share the process's random state, torch threads and precision settings, so a
            second one is refused rather than changing the first one's numbers.
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
        if checkpoint is not None:
            check_resume_target(checkpoint, resume, files)
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
            fetch_weights=fetch_pretrained,  # pretrained builders (vit_b16) fetch their pinned weights once
        )
        check_model_parts(loop.slots, type(strategy).__name__, strategy.needs_split)
        check_models_fit_data(loop.slots, data.num_classes, data.x, input_roles=population.roles())
        if runtime.cuda_graphs:
            from ..client.graphs import StepGraphs, backend_for, prepare_optimizer

            loop.graphs = StepGraphs(backend_for(fabric.device))
            for slot in loop.slots.values():
                prepare_optimizer(slot.optimizer)  # Adam: capturable, for eager steps and replays alike
        loggers = resolve_loggers(logger) if ranks.writes else []  # rank 0 alone logs
        run_info = {
            "name": name,
            "run_id": run_id(files, checkpoint),  # the directory's: its checkpoints resume only there (run_dir.py)
            "config_sha256": hashlib.sha256((resolved_config or "").encode()).hexdigest() if resolved_config else None,
            "partition_sha256": partition["sha256"],
            "reference": reference,
            "versions": versions(),
            "hardware": hardware(fabric.device, ranks.world),
        }
        if checkpoint is not None:
            resumes = check_resume(checkpoint, run_info, resolved_config, rounds, files.root)
            if monitor is not None and checkpoint.get("last_eval"):  # refused before anything is written
                check_monitor(monitor, checkpoint["last_eval"]["metrics"])
            if resumes:
                run_info["resumed_with"] = resumes
            rewrite_config = _resumed_identity(checkpoint, run_info, resolved_config, rounds, stop_after, files)
            if ranks.writes:  # a user (and a table run's log) must see that this continues an earlier run
                print(_resuming_line(checkpoint, rounds, resume, files, stop_after), file=sys.stderr, flush=True)
        else:
            rewrite_config = True
            if resume == "auto" and ranks.writes:
                print(f"--resume auto: no checkpoint in {files.root}; starting a new run.", file=sys.stderr, flush=True)
        executor = resolve_executor(runtime, training)
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
            batch_clients=runtime.batch_clients,
            lockstep=runtime.lockstep,
            faults=faults,
            divergence=divergence,
        )
        # every check has passed: only now is the run directory written (a refused start changes nothing)
        if ranks.writes:  # rank 0 alone writes it
            lock.acquire()  # a new directory: created here, locked before its first file
            check_still_ours(files, run_info["run_id"], fresh=checkpoint is None)
            free_leftovers(files)  # a disk that filled up gets the space of a failed write back first
            orchestrator.state.client_states.free_leftovers(checkpoint["client_states"] if checkpoint else None)
            files.mark(run_info["run_id"])
            if checkpoint is None or not files.partition.is_file():  # a resume checked that it is the same
                files.write_json(files.partition, partition)
            if resolved_config is not None and rewrite_config:
                files.write_text(files.config, resolved_config)
        config_dict = _config_dict(resolved_config)
        for i, run_logger in enumerate(loggers):
            previous = checkpoint["loggers"][i] if checkpoint and i < len(checkpoint["loggers"]) else None
            run_logger.start(files.root, name, config_dict, previous)
        if any(run_logger.wants_images for run_logger in loggers):
            _log_partition_chart(data, loggers)
        summary = orchestrator.run(checkpoint)
        leave_ranks()
        for run_logger in loggers:
            run_logger.log_files([files.last_checkpoint])
            run_logger.finish(summary)
        return summary


def _log_partition_chart(data, loggers) -> None:
    """The client-by-class chart, to the loggers that take images (W&B copies it into its run): drawn in a
    temporary folder, so the run folder holds only the files docs/reference/run_files.md lists."""
    import tempfile

    from ..data.inspect import bubble_chart

    with tempfile.TemporaryDirectory(prefix="flrun-chart-") as folder:
        chart = bubble_chart(data, Path(folder) / "partition.png", replace=True)
        for run_logger in loggers:
            run_logger.log_image("partition/client_by_class", chart)


def _check_counts(**counts: int | None) -> None:
    for key, value in counts.items():
        if value is not None and value < 1:
            raise ConfigError(f"{key} must be at least 1, got {value}; e.g. --{key} 1.")


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


def _resumed_identity(
    checkpoint: dict[str, Any],
    run_info: dict[str, Any],
    resolved_config: str | None,
    rounds: int,
    stop_after: int | None,
    files: RunFiles,
) -> bool:
    """What a resume keeps of the run's identity; returns whether ``config.yaml`` is to be written again.

    ``config.yaml`` (and ``partition.json``, checked equal) stay byte for byte as they were, and ``config_sha256``
    stays their recipe's: a resume changes how the run goes on (``resumed_with`` records it), not which experiment
    it is. Only a resume that changes ``rounds`` makes it another experiment (a longer run), and one into a
    directory without ``config.yaml`` (a copy resumed elsewhere) has none to keep: both write this invocation's
    recipe. A resume that trains nothing also keeps the versions and hardware that computed the numbers.
    """
    saved = checkpoint["run_info"]
    done = checkpoint["rounds_done"]
    if done >= rounds or (stop_after is not None and stop_after <= done):
        run_info.update({k: saved[k] for k in ("versions", "hardware") if k in saved})
    if resolved_config is None or not files.config.is_file() or planned_rounds(checkpoint) != rounds:
        return True
    kept = saved.get("config_sha256") or hashlib.sha256(files.config.read_bytes()).hexdigest()
    run_info["config_sha256"] = kept
    return False


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
