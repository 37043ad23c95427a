"""The sweep's Optuna study on its RDB storage: the URL, the sampler and pruner of each worker, heartbeats and
the retry of trials whose process died, and counting trials by state (``n_trials`` is exact)."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path

from ..federation.files import lock_file
from .spec import SweepSpec


def sampler_seed(seed: int | None, epoch: int, worker: int) -> int | None:
    """The sampler seed of one worker: the sweep's seed for the first worker of a fresh study, else a seed
    derived from (seed, trials in the study when the command started, worker index). Workers then draw
    different parameters (equal seeds made trial 0 = trial 1), a re-run does not repeat the first run's
    draws, and the same command on the same study state draws the same values again."""
    if seed is None:
        return None
    if epoch == 0 and worker == 0:
        return int(seed)
    import numpy as np

    return int(np.random.SeedSequence([int(seed), epoch, worker]).generate_state(1)[0])


def _sampler(spec: SweepSpec, epoch: int = 0, worker: int = 0):
    import optuna

    options = {k: v for k, v in spec.sampler.items() if k != "name"}
    options["seed"] = sampler_seed(options.get("seed"), epoch, worker)
    return (
        optuna.samplers.RandomSampler(**options)
        if spec.sampler.get("name") == "random"
        else optuna.samplers.TPESampler(**options)
    )


def _pruner(spec: SweepSpec):
    import optuna

    name = spec.pruner.get("name", "median")
    options = {k: v for k, v in spec.pruner.items() if k != "name"}
    if name == "none":
        return optuna.pruners.NopPruner()
    return optuna.pruners.HyperbandPruner(**options) if name == "hyperband" else optuna.pruners.MedianPruner(**options)


def shown_storage(spec: SweepSpec) -> str:
    """The storage URL without its password."""
    from sqlalchemy.engine import make_url

    return make_url(storage_url(spec)).render_as_string(hide_password=True)


def storage_url(spec: SweepSpec) -> str:
    return spec.storage or f"sqlite:///{Path(spec.output_dir).resolve() / 'study.db'}"


def retry_callback(spec: SweepSpec):
    """Optuna's callback that queues a dead trial's parameters again (renamed in Optuna 5)."""
    import optuna

    retry = (
        getattr(optuna.storages, "RetryHeartbeatStaleTrialCallback", None) or optuna.storages.RetryFailedTrialCallback
    )
    return retry(max_retry=spec.max_retry)


def open_study(spec: SweepSpec, epoch: int = 0, worker: int = 0):
    """The study on its storage, with heartbeats: a trial whose process stops beating for ``grace_period``
    is failed and queued again by the next process that asks for a trial."""
    return open_or_create_study(spec, epoch, worker, create=False)[0]


def open_or_create_study(spec: SweepSpec, epoch: int = 0, worker: int = 0, create: bool = True):
    """The study as :func:`open_study` gives it, and whether this call made it (``create``: tell)."""
    import inspect

    import optuna

    url = storage_url(spec)
    _make_sqlite_folder(url)
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    stale_key = (
        "heartbeat_stale_trial_callback"
        if "heartbeat_stale_trial_callback" in inspect.signature(optuna.storages.RDBStorage).parameters
        else "failed_trial_callback"
    )
    from sqlalchemy.exc import DatabaseError, IntegrityError

    for attempt in range(3):
        try:
            with warnings.catch_warnings(), _schema_lock(url):
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                storage = optuna.storages.RDBStorage(
                    url,
                    engine_kwargs=kwargs,
                    heartbeat_interval=spec.heartbeat_interval,
                    grace_period=spec.grace_period,
                    **{stale_key: retry_callback(spec)},
                )
            break
        # a process that does not take the lock (optuna-dashboard, any client of a server database) made the new
        # schema at the same time: a table ("already exists") or version row of it is there now; the next attempt
        # finds it and makes the rest
        except DatabaseError as err:
            if attempt == 2 or not (isinstance(err, IntegrityError) or "already exists" in str(err)):
                raise
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # the sweep prints each trial's outcome itself
    study = dict(
        study_name=spec.study_name, storage=storage, sampler=_sampler(spec, epoch, worker), pruner=_pruner(spec)
    )
    if not create:
        return optuna.create_study(**study, direction=spec.direction, load_if_exists=True), False
    try:  # the storage's unique study name decides which of two commands starting at once made it
        return optuna.create_study(**study, direction=spec.direction), True
    except optuna.exceptions.DuplicatedStudyError:
        return optuna.load_study(**study), False


def _schema_lock(url: str) -> contextlib.AbstractContextManager:
    """An SQLite database file's tables are made by one process at a time (a lock file beside it, removed after):
    Optuna checks for each table and then makes it, so two processes opening a new database at once (a sweep's
    workers, two sweeps started together) both found it missing, and one failed on "table ... already exists"."""
    from sqlalchemy.engine import make_url

    from .storage_check import in_memory

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or in_memory(url) or not parsed.database:
        return contextlib.nullcontext()  # a server's clients share no folder (the retry covers them)
    database = Path(parsed.database)
    return lock_file(database.with_name(f".{database.name}.lock"))


def _make_sqlite_folder(url: str) -> None:
    """SQLite makes the database file but not its folders: a new ``sqlite:///runs/sweeps/study.db`` works as a new
    output folder does."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() == "sqlite" and parsed.database not in (None, "", ":memory:"):
        Path(parsed.database).parent.mkdir(parents=True, exist_ok=True)


def tally(trials) -> dict[str, int]:
    """Counts by state. A failed trial that was queued again (a retry exists) is ``retried``, one that failed
    because its run lacks the sweep's metric is ``wrong_metric``; neither counts towards ``n_trials``;
    ``finished`` = complete + pruned + failed."""
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}
    counts = dict.fromkeys(("COMPLETE", "PRUNED", "FAIL", "RUNNING", "WAITING", "retried", "wrong_metric"), 0)
    for t in trials:
        state = t.state.name
        if state == "FAIL" and t.number in retried:
            state = "retried"
        elif state == "FAIL" and t.user_attrs.get("wrong_metric"):
            state = "wrong_metric"
        counts[state] += 1
    counts["finished"] = counts["COMPLETE"] + counts["PRUNED"] + counts["FAIL"]
    return counts


def open_slots(study, n_trials: int) -> int:
    """Trials still to start so that the study ends with exactly ``n_trials`` (queued retries fill slots)."""
    counts = tally(study.get_trials(deepcopy=False))
    return n_trials - counts["finished"] - counts["RUNNING"]


def requeue(study, spec: SweepSpec, trial_id: int, reason: str) -> int | None:
    """Fails a trial whose process died (if still running) and queues its parameters again; returns the
    dead trial's number, or None when it had finished or was already queued again."""
    import optuna

    State = optuna.trial.TrialState
    storage = study._storage
    trial = storage.get_trial(trial_id)
    if trial.state == State.RUNNING:
        storage.set_trial_user_attr(trial_id, "error", reason)
        storage.set_trial_state_values(trial_id, State.FAIL)
    elif trial.state != State.FAIL:
        return None
    if any(trial.number in t.system_attrs.get("retry_history", []) for t in study.get_trials(deepcopy=False)):
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        retry_callback(spec)(study, storage.get_trial(trial_id))
    return trial.number
