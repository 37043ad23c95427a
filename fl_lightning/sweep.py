"""``flrun sweep``: an Optuna study over a base recipe.

A sweep file names the base recipe, the search space (dotted recipe keys, as on the command line), the
objective and the sampler / pruner. Each trial is an ordinary run directory under the sweep's directory,
run through ``flrun fit`` (:mod:`fl_lightning.sweep_trial`); a pruning logger reports the monitored metric
every evaluation round so bad trials stop early. The study lives in an RDB storage (SQLite file in the
sweep directory by default, or any Optuna URL such as PostgreSQL), so re-running the command resumes it
and several processes or machines can work on one study; a re-run that changes what a trial means is
refused (:mod:`fl_lightning.sweep_study`).

``n_trials`` is the study's total: trials that completed, were pruned or failed on their own count (not
those whose run lacked the sweep's metric: the sweep stops at the first); a trial whose process died (a heartbeat that stopped, a killed worker, an interrupt) is failed and queued
again with the same parameters, and only its retry counts. Worker processes (``--n_jobs``) ask the
command for permission before each trial (:mod:`fl_lightning.sweep_workers`), so the total is exact.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .sweep_study import check_metric, flatten, overlap

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "hyperband", "none")


@dataclass
class SweepSpec:
    """A sweep file.

    Attributes:
        base: the base recipe.
        parameters: ``{dotted.key: {type: float|int|categorical, low, high, log, step, choices}}``.
        metric: the objective (a key of summary.json's ``best`` / ``final``, e.g. ``global/test_acc``).
        direction: ``maximize`` or ``minimize``.
        use: ``best`` or ``final`` value of the run as the trial's value.
        study_name: the Optuna study (default: the sweep file's name).
        storage: an Optuna RDB URL; default ``sqlite:///<output_dir>/study.db``.
        output_dir: the sweep directory (default ``runs/sweeps/<study_name>``).
        n_trials: trials in the study in total (completed, pruned or failed, retries not counted twice);
            re-running continues up to it and never past it.
        timeout: seconds this command may start new trials for.
        sampler: ``{name: tpe|random, seed: 0}``.
        pruner: ``{name: median|hyperband|none, ...}`` (Optuna pruner arguments).
        overrides: fixed recipe overrides for every trial, e.g. ``{rounds: 20}``.
        logger: the trials' logger (``wandb`` groups them by study).
        heartbeat_interval: seconds between a running trial's heartbeats in the storage.
        grace_period: seconds without a heartbeat after which a running trial counts as dead (its process
            was killed or its machine lost); it is then failed and queued again with the same parameters.
        max_retry: how many times one trial's parameters are queued again after such deaths.
    """

    base: str
    parameters: dict[str, dict[str, Any]]
    metric: str
    direction: str = "maximize"
    use: str = "best"
    study_name: str | None = None
    storage: str | None = None
    output_dir: str | None = None
    n_trials: int = 10
    timeout: float | None = None
    sampler: dict[str, Any] = field(default_factory=lambda: {"name": "tpe", "seed": 0})
    pruner: dict[str, Any] = field(default_factory=lambda: {"name": "median"})
    overrides: dict[str, Any] = field(default_factory=dict)
    logger: Any = "csv"
    heartbeat_interval: int = 10
    grace_period: int = 30
    max_retry: int = 3


def load_sweep(path: str | Path, check_recipe: bool = True, **cli: Any) -> SweepSpec:
    """Reads and validates a sweep file; every problem is one sentence, before any trial runs.

    Args:
        path: the sweep file.
        check_recipe: also parse the base recipe with each parameter (worker processes skip it: their
            coordinator did it).
        **cli: command-line values that replace the file's.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"sweep file {path} does not exist; sweeps live in sweeps/, e.g. sweeps/digits_quickstart.yaml."
        )
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "malformed YAML"
        raise ConfigError(f"sweep file {path} is not valid YAML ({problem}{where}); fix the YAML there.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"sweep file {path} is not a text file; give a YAML sweep file.") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"sweep file {path} must be a YAML mapping with base, metric and parameters.")
    known = set(SweepSpec.__dataclass_fields__)
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"unknown key(s) {unknown} in {path}; a sweep file has {sorted(known)}.")
    for key in ("base", "parameters", "metric"):
        if key not in raw:
            raise ConfigError(f"{path} needs `{key}`.")
    raw.update({k: v for k, v in cli.items() if v is not None})
    base = Path(raw["base"])
    if not base.is_file():  # also relative to the sweep file, or to the project holding sweeps/
        for candidate in (path.parent / base, path.parent.parent / base):
            if candidate.is_file():
                raw["base"] = str(candidate)
                break
    spec = SweepSpec(**raw)
    spec.study_name = spec.study_name or path.stem
    spec.output_dir = spec.output_dir or str(Path("runs") / "sweeps" / spec.study_name)
    _validate(spec, check_recipe)
    return spec


def _validate(spec: SweepSpec, check_recipe: bool = True) -> None:
    if not Path(spec.base).is_file():
        raise ConfigError(f"the sweep's base recipe {spec.base} does not exist.")
    if spec.direction not in ("maximize", "minimize") or spec.use not in ("best", "final"):
        raise ConfigError("direction must be maximize or minimize and use best or final.")
    if not isinstance(spec.parameters, dict) or not spec.parameters:
        raise ConfigError("the sweep has no parameters to search; give `parameters: {dotted.key: {type: ...}}`.")
    for key in ("n_trials", "heartbeat_interval", "grace_period"):
        value = getattr(spec, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a positive whole number, got {value!r}.")
    if spec.grace_period <= spec.heartbeat_interval:
        raise ConfigError(
            f"grace_period ({spec.grace_period} s) must exceed heartbeat_interval ({spec.heartbeat_interval} s), "
            "or live trials would be taken for dead ones."
        )
    if isinstance(spec.max_retry, bool) or not isinstance(spec.max_retry, int) or spec.max_retry < 0:
        raise ConfigError(f"max_retry must be a whole number >= 0, got {spec.max_retry!r}.")
    if spec.timeout is not None and not spec.timeout > 0:
        raise ConfigError(f"timeout must be a positive number of seconds, got {spec.timeout!r}.")
    if spec.sampler.get("name", "tpe") not in SAMPLERS or spec.pruner.get("name", "median") not in PRUNERS:
        raise ConfigError(f"sampler name must be one of {SAMPLERS} and pruner name one of {PRUNERS}.")
    for name, p in spec.parameters.items():
        if not isinstance(p, dict):
            raise ConfigError(f"parameter {name!r}: give a mapping such as {{type: float, low: 0.01, high: 0.1}}.")
        kind = p.get("type")
        if kind in ("float", "int"):
            if "low" not in p or "high" not in p or not p["low"] < p["high"]:
                raise ConfigError(f"parameter {name!r}: give low < high, got low={p.get('low')} high={p.get('high')}.")
            if p.get("log") and p["low"] <= 0:
                raise ConfigError(f"parameter {name!r}: a log scale needs low > 0, got {p['low']}.")
        elif kind == "categorical":
            if not p.get("choices"):
                raise ConfigError(f"parameter {name!r}: categorical needs a non-empty `choices` list.")
        else:
            raise ConfigError(f"parameter {name!r}: type must be float, int or categorical, got {kind!r}.")
    _check_overrides(spec)
    if not check_recipe:
        return
    # every parameter path must be an option of the base recipe: parse it once with a sample value
    from .fit_args import UserError, parse_fit

    init = None
    for name, p in spec.parameters.items():
        sample = p["choices"][0] if p["type"] == "categorical" else p["low"]
        try:
            _, init, _ = parse_fit(["--config", spec.base, *_as_args(spec.overrides), *_as_args({name: sample})])
        except (UserError, ConfigError) as err:
            raise ConfigError(f"sweep parameter {name!r} does not fit the base recipe {spec.base}: {err}") from None
        devices = [init.runtime.devices]
        if name == "runtime.devices":  # every value the parameter can draw, not only the sample
            devices += list(p["choices"]) if p["type"] == "categorical" else [p["high"]]
        many = [d for d in devices if isinstance(d, (int, float)) and not isinstance(d, bool) and d > 1]
        if many:  # else those trials would fail on it
            raise ConfigError(
                f"the sweep's trials could run with runtime.devices {max(many)}, but a trial runs in one process; "
                "set `runtime.devices: 1` (in the sweep's overrides, not as a parameter) and run trials side by "
                "side with --n_jobs (one GPU each)."
            )
    check_metric(spec, init)


def _override_keys(spec: SweepSpec) -> list[str]:
    """The overrides' dotted keys; a class named in short (``optimizer: torch.optim.Adam``) counts as its
    ``class_path``, so that searching the class's ``init_args`` is not taken for fixing them."""
    keys = []
    for key, value in flatten(spec.overrides).items():
        searched_inside = any(name.startswith(f"{key}.init_args.") for name in spec.parameters)
        keys.append(f"{key}.class_path" if isinstance(value, str) and searched_inside else key)
    return keys


def _check_overrides(spec: SweepSpec) -> None:
    if not isinstance(spec.overrides, dict):
        raise ConfigError(f"overrides must be a mapping of recipe keys, e.g. {{rounds: 20}}, got {spec.overrides!r}.")
    fixed = [key for key in _override_keys(spec) for name in spec.parameters if overlap(key, name)]
    if fixed:  # a trial applies the parameter last, best_recipe.yaml's command the override: they would differ
        raise ConfigError(
            f"the sweep both fixes and searches {fixed[0]} (overrides and parameters); remove it from `overrides`."
        )


def _as_args(values: dict[str, Any]) -> list[str]:
    args = []
    for key, value in values.items():
        args += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return args


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
    import inspect

    import optuna

    url = storage_url(spec)
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    stale_key = (
        "heartbeat_stale_trial_callback"
        if "heartbeat_stale_trial_callback" in inspect.signature(optuna.storages.RDBStorage).parameters
        else "failed_trial_callback"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        storage = optuna.storages.RDBStorage(
            url,
            engine_kwargs=kwargs,
            heartbeat_interval=spec.heartbeat_interval,
            grace_period=spec.grace_period,
            **{stale_key: retry_callback(spec)},
        )
    optuna.logging.set_verbosity(optuna.logging.ERROR)  # the sweep prints each trial's outcome itself
    return optuna.create_study(
        study_name=spec.study_name,
        storage=storage,
        sampler=_sampler(spec, epoch, worker),
        pruner=_pruner(spec),
        direction=spec.direction,
        load_if_exists=True,
    )


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


def check_own_directory(root: Path, spec: SweepSpec) -> None:
    """Refuses a sweep directory that holds another study's results: their trial directories and files
    (trials.csv, sweep.json, best_recipe.yaml) would be mixed up."""
    try:
        other = json.loads((root / "sweep.json").read_text()).get("study")
    except (OSError, ValueError, AttributeError):
        return
    if other is not None and other != spec.study_name:
        raise ConfigError(
            f"{root} holds the trials of sweep study {other!r}; give study {spec.study_name!r} an output_dir of "
            "its own."
        )


def run_sweep(spec: SweepSpec, n_jobs: int = 1, sweep_file: str | None = None, out=None) -> tuple[dict, int]:
    """Runs trials until the study holds ``n_trials`` (or ``timeout`` passes), printing progress.

    With ``n_jobs`` > 1 the trials run in that many worker processes that ask this one before each
    trial. Returns the results (also in ``sweep.json``) and the exit status: 0 when the study is full
    or the timeout ended it, 1 when trials are missing (workers kept dying) or every trial this command
    ran failed, 2 when a run lacked the sweep's metric (the sweep stops at once), 130 when interrupted.
    Refuses (ConfigError) a study whose recorded definition differs from ``spec``'s.
    """
    import sys
    import time

    from .gpu_share import visible_gpus
    from .sweep_results import Progress, write_results
    from .sweep_study import check_definition, definition
    from .sweep_workers import coordinate, run_in_process, wait_for_stale

    if n_jobs < 1:
        raise ConfigError(f"--n_jobs must be at least 1, got {n_jobs}.")
    if n_jobs > 1 and not sweep_file:
        raise ConfigError("worker processes load the sweep file: give sweep_file with n_jobs > 1.")
    root = Path(spec.output_dir)
    check_own_directory(root, spec)
    current = definition(spec)
    root.mkdir(parents=True, exist_ok=True)
    study = open_study(spec)
    progress = Progress(spec, study, out or sys.stdout)
    check_definition(study, spec, current, progress.note)
    epoch = len(study.get_trials(deepcopy=False))
    study.sampler = _sampler(spec, epoch, worker=0)
    gpus = visible_gpus() if n_jobs > 1 else []  # one process alone keeps the GPUs it was given
    progress.header(n_jobs, gpus)
    deadline = time.monotonic() + spec.timeout if spec.timeout else None
    status = 0
    for _ in range(3):  # further passes run trials that went stale (a killed process) while this one ran
        if n_jobs > 1:
            status = coordinate(spec, study, n_jobs, sweep_file, epoch, deadline, progress, gpus)
        else:
            status = run_in_process(spec, study, deadline, progress)
        if status or progress.stopped or not wait_for_stale(spec, study, deadline, progress):
            break
    all_failed = bool(progress.ended) and all(state == "FAIL" for state in progress.ended)
    short = open_slots(study, spec.n_trials) > 0 and not (deadline and time.monotonic() > deadline)
    if status == 0 and progress.stopped:
        status = 2  # the sweep file's metric is wrong: a user error, found by the first trial
    elif status == 0 and (all_failed or short):
        status = 1
    result = write_results(study, spec, root)
    progress.final(result, status)
    return result, status
