"""``flrun fit``: build the objects of a recipe and run the orchestrator. Its signature is the schema.

:func:`fit` checks every option first, each once, before anything is loaded or written (the counts in
:class:`~.options.RoundPlan`, the executor in :class:`~.options.ExecutionPlan`, faults and divergence in
:class:`~.robustness.Robustness`, the seed, the model roles, the population and the ranks), then runs the steps:
the run folder and the checkpoint it resumes (:func:`_open_run_dir`), the data (:func:`_setup_data`), the models
and their loop (:func:`_setup_loop`), the run's identity (:func:`_run_info`, :func:`_resumed_identity`), the
orchestrator and the strategy's set-up, the run folder's first files (:func:`_write_run_dir`), the loggers, the
rounds (:meth:`FederationOrchestrator.run_rounds`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..client.data_fit import check_models_fit_data
from ..client.evaluation import PersonalEvaluation
from ..client.lightning import check_model_parts
from ..client.loop import LocalLoop, LocalTraining
from ..data import FederatedData
from ..data.sources import fetch_pretrained
from ..distributed.ranks import Ranks, connect_ranks, join_ranks, leave_ranks
from ..federation.errors import ConfigError
from ..federation.population import Population
from ..federation.sampling import ClientSampler, UniformSampler
from ..federation.types import ClientSpec
from ..models import ModelSpec
from ..strategies import Strategy
from ..strategies.base import roles_to_build
from ..tracking import RunFiles, RunLock, RunLogger, resolve_loggers
from .asynchrony import AsynchronousSchedule
from .checkpoint import check_shapes, load_checkpoint
from .memory import check_model_memory
from .options import ExecutionPlan, RoundPlan, RunOutput
from .orchestrator import FederationOrchestrator
from .privacy import Privacy, dp_accounting_module
from .provenance import hardware, versions
from .remote import current_remote
from .robustness import Faults, Robustness
from .run_dir import (
    check_no_results,
    check_output_dir,
    check_resume_target,
    check_still_ours,
    free_leftovers,
    run_id,
    run_root,
)
from .runtime import Runtime
from .state import RunState, check_monitor, check_resume, planned_rounds

log = logging.getLogger(__name__)

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
    privacy: Privacy | None = None,
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
        logger: ``wandb``, ``tensorboard``, a RunLogger class_path, or a list; ``csv`` (metrics.csv) is always there.
        runtime: accelerator, precision, CPU threads, determinism, the progress bar and the ranks (devices).
        checkpoint_every: checkpoint every k rounds (and at the end).
        stop_after: end this invocation after that round, e.g. to fit a job's time limit; resume later.
        monitor: metric that decides the best round (default: the strategy's main accuracy).
        divergence: a client update with NaN or infinite values ``stop``s the run (exit 2, the last good
            checkpoint kept, ``diverged: true`` in summary.json) or is ``drop``ped (counted in
            ``faults/dropped_nonfinite``). Non-finite server or evaluation metrics always stop it.
        faults: faults injected into the clients (crash, nan, straggle, drop_upload rates; seeded per round
            and client); none when not given.
        privacy: client-level differential privacy of every upload: each client's upload of a round clipped to
            ``clip`` and Gaussian noise added on the client (``where: client``) or once to the aggregate on the
            server (``where: server``); ``noise_multiplier`` given or calibrated from ``target_epsilon`` and
            ``delta``; the epsilon spent is in ``metrics.csv`` and ``summary.json`` (needs the ``privacy`` extra).
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
    root = run_root(output_dir, name, seed)  # first: a name that would leave runs/ is refused before anything
    name = name or "run"
    plan, robustness, experiment, execution = _checked(
        data, models, strategy, population, sampler, schedule, training, evaluation, seed, runtime,
        (rounds, eval_every, checkpoint_every, stop_after), faults, divergence, privacy,
    )  # fmt: skip
    files = RunFiles(root)
    check_output_dir(files.root)
    ranks = join_ranks(runtime.devices, schedule, training.optimizer_state)  # several if launched as several
    loggers = resolve_loggers(logger) if ranks.writes else []  # rank 0 alone logs
    output = RunOutput(files, loggers, runtime.progress and ranks.writes, monitor, config=resolved_config)
    with RunLock(files.root, enabled=ranks.writes) as lock:
        return _run(experiment, plan, execution, robustness, runtime, ranks, output, lock, resume, name, reference)


def check_options(options: dict[str, Any]) -> None:
    """The checks :func:`fit` makes of its options (``fit``'s keyword arguments, as the parser instantiates them)
    before it writes or loads anything: for a command that starts runs later, such as a sweep, whose trials all
    share the arguments after its ``--``."""
    _checked(
        options["data"], options["models"], options["strategy"], options["population"], options["sampler"],
        options["schedule"], options["training"], options["evaluation"], options["seed"], options["runtime"],
        (options["rounds"], options["eval_every"], options["checkpoint_every"], options["stop_after"]),
        options["faults"], options["divergence"], options.get("privacy"),
    )  # fmt: skip


def _checked(
    data: FederatedData,
    models: dict[str, ModelSpec],
    strategy: Strategy,
    population: Population,
    sampler: ClientSampler | None,
    schedule: AsynchronousSchedule | None,
    training: LocalTraining,
    evaluation: PersonalEvaluation | None,
    seed: int,
    runtime: Runtime,
    counts: tuple[int, int, int, int | None],
    faults: Faults | None,
    divergence: Literal["stop", "drop"],
    privacy: Privacy | None = None,
) -> tuple[RoundPlan, Robustness, _Experiment, ExecutionPlan]:
    """The run's options, each checked as its part is made (nothing is written or loaded)."""
    plan = RoundPlan(*counts)  # the counts, checked here once
    robustness = Robustness(faults, divergence)
    if privacy is not None:
        dp_accounting_module()  # the extra is installed, or one sentence before anything is loaded
    experiment = _Experiment(
        data, models, strategy, population, sampler or UniformSampler(), schedule, training, evaluation, seed, privacy
    )
    robustness.check_clients(len(experiment.clients))  # fault ids against the population
    execution = ExecutionPlan.of(runtime, training, schedule)  # the executor against the schedule and optimizer state
    return plan, robustness, experiment, execution


@dataclass
class _Experiment:
    """What a run simulates, its options checked as it is made: the seed, that every model role the tiers and the
    strategy use is defined (before any data is loaded), and the population (its clients built here)."""

    data: FederatedData
    models: dict[str, ModelSpec]
    strategy: Strategy
    population: Population
    sampler: ClientSampler
    schedule: AsynchronousSchedule | None
    training: LocalTraining
    evaluation: PersonalEvaluation | None
    seed: int
    privacy: Privacy | None = None
    clients: list[ClientSpec] = field(init=False)

    def __post_init__(self):
        models, seed = self.models, self.seed
        if seed < 0:
            raise ConfigError(f"seed must be a non-negative integer, got {seed}; e.g. --seed 0.")
        undefined = [role for role in self.population.roles() if role not in models]
        if undefined:
            raise ConfigError(
                f"population tiers use model role(s) {undefined} that `models` does not define (defined: "
                f"{sorted(models) or 'none'}); add them under models, e.g. models: {{{undefined[0]}: {{builder: "
                "digits_cnn}}, or change the tiers' roles."
            )
        server_only = [role for role in self.strategy.server_roles() if role not in models]
        if server_only:
            raise ConfigError(
                f"the strategy's server model role(s) {server_only} are not defined under models (defined: "
                f"{sorted(models) or 'none'}); add them, e.g. models: {{{server_only[0]}: {{builder: digits_mlp}}}}, "
                "or name a defined role in the strategy's server_role."
            )
        self.clients = self.population.build(seed)


def _run(
    experiment: _Experiment,
    plan: RoundPlan,
    execution: ExecutionPlan,
    robustness: Robustness,
    runtime: Runtime,
    ranks: Ranks,
    output: RunOutput,
    lock: RunLock,
    resume: str | None,
    name: str,
    reference: dict[str, Any] | None,
) -> dict[str, Any]:
    """The steps of :func:`fit` once its options have passed, inside the run folder's lock; returns the summary."""
    files = output.files
    checkpoint = _open_run_dir(resume, files, lock)
    fabric = runtime.apply(ranks.local_rank)
    connect_ranks(ranks, fabric.device)
    partition = _setup_data(experiment, fabric.device)
    loop = _setup_loop(experiment, fabric, plan.rounds, runtime.cuda_graphs)
    run_info = _run_info(name, files, checkpoint, output.config, partition["sha256"], reference, fabric.device, ranks)
    rewrite_config = True
    if checkpoint is not None:
        run_info, rewrite_config = _resumed_identity(checkpoint, run_info, output, plan)
    output = dataclasses.replace(output, run_info=run_info)
    remote = current_remote()  # clients in other processes (Flower), or this process's client side of such a run
    orchestrator = FederationOrchestrator(
        strategy=experiment.strategy,
        clients=experiment.clients,
        sampler=experiment.sampler,
        loop=loop,
        data=experiment.data,
        seed=experiment.seed,
        plan=plan,
        output=output,
        execution=execution,
        robustness=robustness,
        schedule=experiment.schedule,
        evaluation=experiment.evaluation,
        privacy=experiment.privacy,
        transport=remote.transport if remote is not None else None,
    )
    if checkpoint is not None:  # the server state set up for this recipe against the one saved
        check_shapes(checkpoint, "strategy", experiment.strategy.state_dict())
        if ranks.writes:  # a user (and a table run's log) must see that this continues an earlier run
            log.info("%s", _resuming_line(checkpoint, plan, resume, files))
    elif resume == "auto" and ranks.writes:
        log.info("--resume auto: no checkpoint in %s; starting a new run.", files.root)
    # every check has passed: only now is the run directory written (a refused start changes nothing)
    if ranks.writes:  # rank 0 alone writes it
        config = output.config if rewrite_config else None
        _write_run_dir(files, lock, run_info["run_id"], checkpoint, orchestrator.state, partition, config)
    _start_loggers(output, name, checkpoint, experiment.data)
    if remote is not None and remote.serve is not None:  # a client side: it runs the tasks it receives, no rounds
        summary = remote.serve(orchestrator)
    else:
        summary = orchestrator.run_rounds(checkpoint)
    leave_ranks()
    for run_logger in output.loggers:
        run_logger.log_files([files.last_checkpoint])
        run_logger.finish(summary)
    return summary


def _open_run_dir(resume: str | None, files: RunFiles, lock: RunLock) -> dict[str, Any] | None:
    """Locks a run folder that exists (another process may be writing the run) and returns the checkpoint this start
    resumes (checked to be the folder's own), None for a fresh start."""
    if files.root.is_dir():  # before its checkpoint is read
        lock.acquire()
    checkpoint = _find_checkpoint(resume, files)
    if checkpoint is not None:
        check_resume_target(checkpoint, resume, files)
    return checkpoint


def _setup_data(experiment: _Experiment, device: Any) -> dict[str, Any]:
    """Loads and partitions the data for the population's clients on the run's device; returns the partition's
    summary (``partition.json``)."""
    data = experiment.data
    data.setup(len(experiment.clients), experiment.seed)
    data.to(device)
    return data.partition_summary()


def _setup_loop(experiment: _Experiment, fabric: Any, rounds: int, cuda_graphs: bool) -> LocalLoop:
    """Builds one model per role and the loop that trains them, each checked against the strategy and the data."""
    data, strategy, roles = experiment.data, experiment.strategy, experiment.population.roles()
    loop = LocalLoop(fabric, experiment.training, rounds)
    context = {
        "num_classes": data.num_classes,
        **data.input_sizes(),
        "fetch_weights": fetch_pretrained,  # pretrained builders (vit_b16) fetch their pinned weights once
    }
    roles_built = roles_to_build(roles, strategy)
    sizes = check_model_memory(experiment.models, roles_built, context)  # before the first model is allocated
    loop.build_slots(experiment.models, roles_built, experiment.seed, sizes, **context)
    check_model_parts(loop.slots, type(strategy).__name__, strategy.needs_split)
    check_models_fit_data(loop.slots, data.num_classes, data.x, input_roles=roles)
    if cuda_graphs:
        from ..client.graphs import StepGraphs, backend_for, prepare_optimizer

        loop.graphs = StepGraphs(backend_for(fabric.device))
        for slot in loop.slots.values():
            prepare_optimizer(slot.optimizer)  # Adam: capturable, for eager steps and replays alike
    return loop


def _run_info(
    name: str,
    files: RunFiles,
    checkpoint: dict[str, Any] | None,
    resolved_config: str | None,
    partition_sha256: str,
    reference: dict[str, Any] | None,
    device: Any,
    ranks: Ranks,
) -> dict[str, Any]:
    """This invocation's entries of ``summary.json`` that describe the run (saved in its checkpoints too)."""
    return {
        "name": name,
        "run_id": run_id(files, checkpoint),  # the directory's: its checkpoints resume only there (run_dir.py)
        "config_sha256": hashlib.sha256(resolved_config.encode()).hexdigest() if resolved_config else None,
        "partition_sha256": partition_sha256,
        "reference": reference,
        "versions": versions(),
        "hardware": hardware(device, ranks.world),
    }


def _write_run_dir(
    files: RunFiles,
    lock: RunLock,
    run_id_: str,
    checkpoint: dict[str, Any] | None,
    state: RunState,
    partition: dict[str, Any],
    config: str | None,
) -> None:
    """The run folder's first writes: locked, marked as this run's, ``partition.json`` and ``config.yaml`` (None:
    the one a resume keeps)."""
    lock.acquire()  # a new directory: created here, locked before its first file
    check_still_ours(files, run_id_, fresh=checkpoint is None)
    free_leftovers(files)  # a disk that filled up gets the space of a failed write back first
    state.client_states.free_leftovers(checkpoint["client_states"] if checkpoint else None)
    files.mark(run_id_)
    if checkpoint is None or not files.partition.is_file():  # a resume checked that it is the same
        files.write_json(files.partition, partition)
    if config is not None:
        files.write_text(files.config, config)


def _start_loggers(output: RunOutput, name: str, checkpoint: dict[str, Any] | None, data: FederatedData) -> None:
    """Starts each logger (a resumed W&B run continues) and hands the partition chart to those that take images."""
    config_dict = _config_dict(output.config)
    for i, run_logger in enumerate(output.loggers):
        previous = checkpoint["loggers"][i] if checkpoint and i < len(checkpoint["loggers"]) else None
        run_logger.start(output.files.root, name, config_dict, previous)
    if any(run_logger.wants_images for run_logger in output.loggers):
        _log_partition_chart(data, output.loggers)


def _log_partition_chart(data, loggers) -> None:
    """The client-by-class chart, to the loggers that take images (W&B copies it into its run): drawn in a
    temporary folder, so the run folder holds only the files docs/reference/run_files.md lists."""
    import tempfile

    from ..data.inspect import bubble_chart

    with tempfile.TemporaryDirectory(prefix="flrun-chart-") as folder:
        chart = bubble_chart(data, Path(folder) / "partition.png", replace=True)
        for run_logger in loggers:
            run_logger.log_image("partition/client_by_class", chart)


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
    if resume in (None, "auto") and not files.last_checkpoint.exists():
        check_no_results(files, resume)
    if resume is None:
        return None
    if resume == "auto":
        return load_checkpoint(files.last_checkpoint) if files.last_checkpoint.exists() else None
    return load_checkpoint(Path(resume))


def _resumed_identity(
    checkpoint: dict[str, Any], run_info: dict[str, Any], output: RunOutput, plan: RoundPlan
) -> tuple[dict[str, Any], bool]:
    """What a resume keeps of the run's identity, once it is checked to change nothing it must not; returns the
    run's info and whether ``config.yaml`` is to be written again.

    ``config.yaml`` (and ``partition.json``, checked equal) stay byte for byte as they were, and ``config_sha256``
    stays their recipe's: a resume changes how the run goes on (``resumed_with`` records it), not which experiment
    it is. Only a resume that changes ``rounds`` makes it another experiment (a longer run), and one into a
    directory without ``config.yaml`` (a copy resumed elsewhere) has none to keep: both write this invocation's
    recipe. A resume that trains nothing also keeps the versions and hardware that computed the numbers.
    """
    files, config = output.files, output.config
    resumes = check_resume(checkpoint, run_info, config, plan.rounds, files.root)
    if output.monitor is not None and checkpoint.get("last_eval"):  # refused before anything is written
        check_monitor(output.monitor, checkpoint["last_eval"]["metrics"])
    run_info = {**run_info, "resumed_with": resumes} if resumes else dict(run_info)
    saved = checkpoint["run_info"]
    if not plan.rounds_to_run(checkpoint["rounds_done"]):
        run_info.update({k: saved[k] for k in ("versions", "hardware") if k in saved})
    if config is None or not files.config.is_file() or planned_rounds(checkpoint) != plan.rounds:
        return run_info, True
    run_info["config_sha256"] = saved.get("config_sha256") or hashlib.sha256(files.config.read_bytes()).hexdigest()
    return run_info, False


def _resuming_line(checkpoint: dict[str, Any], plan: RoundPlan, resume: str | None, files: RunFiles) -> str:
    done, rounds, stop_after = checkpoint["rounds_done"], plan.rounds, plan.stop_after
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
