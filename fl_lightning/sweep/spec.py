"""``flrun sweep``: an Optuna study over a base recipe.

A sweep file names the base recipe (relative to the sweep file's folder, as a recipe's ``base:`` is), the
search space (dotted recipe keys, as on the command line), the objective and the sampler / pruner;
``flrun sweep --config S -- ARGS`` adds ``flrun fit`` arguments for every trial (``-- --rounds 4``). Each
trial is an ordinary run directory under the sweep's directory, run through ``flrun fit``
(:mod:`fl_lightning.sweep.trial`); a pruning logger reports the monitored metric every evaluation round so
bad trials stop early. The study lives in an RDB storage (SQLite file in the
sweep directory by default, or any Optuna URL such as PostgreSQL), so re-running the command resumes it
and several processes or machines can work on one study; a re-run that changes what a trial means is
refused (:mod:`fl_lightning.sweep.study`).

``n_trials`` is the study's total: trials that completed, were pruned or failed on their own count (not
those whose run lacked the sweep's metric: the sweep stops at the first); a trial whose process died (a
heartbeat that stopped, a killed worker, an interrupt) is failed and queued again with the same parameters,
and only its retry counts. Worker processes (``--n_jobs``) ask the
command for permission before each trial (:mod:`fl_lightning.sweep.workers`), so the total is exact.
"""

from __future__ import annotations

import difflib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..federation.errors import ConfigError, bad_choice
from ..federation.files import check_folder_name, path_problem
from ..run.safe_yaml import read_file
from ..tracking.loggers import check_wandb_mode
from .metric import check_metric, test_metric_warning, varies_between_evaluations
from .space_checks import check_parameter
from .storage_check import check_storage

SAMPLERS = ("tpe", "random")
PRUNERS = ("median", "hyperband", "none")
# set by the sweep for each trial, so not for the fit arguments after `--`
TRIAL_ARGS = ("--config", "--output_dir", "--name", "--resume", "--logger")
# keys only a recipe has: a file with them given to `flrun sweep` is a recipe
RECIPE_KEYS = ("data", "models", "strategy", "population", "training", "rounds")


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
        fit_args: ``flrun fit`` arguments for every trial, from the command line after ``--`` (not a sweep-file
            key); like ``overrides`` they are part of what defines the study.
    """

    base: str
    parameters: dict[str, dict[str, Any]]
    metric: str
    direction: Literal["maximize", "minimize"] = "maximize"
    use: Literal["best", "final"] = "best"
    study_name: str = ""  # empty: set by read_sweep, as are the defaults below
    storage: str | None = None
    output_dir: str = ""
    n_trials: int = 10
    timeout: float | None = None
    sampler: dict[str, Any] = field(default_factory=lambda: {"name": "tpe", "seed": 0})
    pruner: dict[str, Any] = field(default_factory=lambda: {"name": "median"})
    overrides: dict[str, Any] = field(default_factory=dict)
    logger: Any = "csv"
    heartbeat_interval: int = 10
    grace_period: int = 30
    max_retry: int = 3
    fit_args: list[str] = field(default_factory=list)


SWEEP_KEYS = sorted(set(SweepSpec.__dataclass_fields__) - {"fit_args"})


def load_sweep(path: str | Path, check_recipe: bool = True, fit_args: list[str] | None = None, **cli: Any) -> SweepSpec:
    """Reads and validates a sweep file; every problem is one sentence, before any trial runs.

    Args:
        path: the sweep file.
        check_recipe: also parse the base recipe with each parameter (worker processes skip it: their
            coordinator did it).
        fit_args: ``flrun fit`` arguments for every trial (after ``--`` on the command line).
        **cli: command-line values that replace the file's.
    """
    spec = read_sweep(path, fit_args, **cli)
    if check_recipe:
        check_against_recipe(spec)
    return spec


def read_sweep(path: str | Path, fit_args: list[str] | None = None, **cli: Any) -> SweepSpec:
    """The sweep file read and checked by itself, without importing torch: fast, so that the command can say
    what it does before the base recipe is parsed (:func:`check_against_recipe`)."""
    path = Path(path)
    if not path.exists() and not path.is_symlink():  # a directory, a FIFO or a link loop: read_file names it
        raise ConfigError(
            f"sweep file {path} does not exist; sweeps live in sweeps/, e.g. sweeps/digits_quickstart.yaml."
        )
    raw = read_file(path, f"sweep file {path}", "a YAML sweep file, e.g. sweeps/digits_quickstart.yaml")
    if not isinstance(raw, dict):
        raise ConfigError(f"sweep file {path} must be a YAML mapping with base, metric and parameters.")
    _check_keys(raw, path)
    raw.update({k: v for k, v in cli.items() if v is not None})
    raw["base"] = _base_path(raw["base"], path)
    spec = SweepSpec(**raw, fit_args=list(fit_args or []))
    if "study_name" in raw and not spec.output_dir:  # the sweep's folder is named after it
        check_folder_name(raw["study_name"], "study_name", "runs/sweeps/<name>", "--study_name my_sweep")
    spec.study_name = spec.study_name or path.stem
    spec.output_dir = spec.output_dir or str(Path("runs") / "sweeps" / spec.study_name)
    _validate(spec)
    return spec


def _check_keys(raw: dict[str, Any], path: Path) -> None:
    if any(key in raw for key in RECIPE_KEYS) and not any(key in raw for key in ("parameters", "metric")):
        raise ConfigError(
            f"{path} is a recipe, not a sweep file; run it with `flrun fit --config {path}`, or tune it with a sweep "
            "file whose `base:` names it (e.g. sweeps/digits_quickstart.yaml)."
        )
    unknown = sorted(set(raw) - set(SWEEP_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], SWEEP_KEYS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown key(s) {unknown} in {path}{hint}; a sweep file has {SWEEP_KEYS}.")
    for key in ("base", "parameters", "metric"):
        if key not in raw:
            raise ConfigError(f"{path} needs `{key}`.")


def _base_path(base: Any, path: Path) -> str:
    """The base recipe's path: relative to the sweep file's folder, as a recipe's ``base:`` is."""
    if not isinstance(base, str) or not base:
        raise ConfigError(f"`base` in {path} must name the base recipe file, e.g. base: ../recipes/quickstart.yaml.")
    resolved = Path(os.path.normpath(path.parent / base))
    problem = path_problem(resolved)
    if problem is None:
        return str(resolved)
    where = f"the sweep's base recipe {resolved} (base: {base} in {path}) {problem}"
    if problem != "does not exist":  # there, but not a file to read (a FIFO, a directory, a link loop)
        raise ConfigError(f"{where}; give a recipe file, e.g. base: ../recipes/quickstart.yaml.")
    if Path(base).is_file():  # where sweep files used to point: the working directory
        relative = os.path.relpath(base, path.parent)
        shown = relative if relative.count("..") <= 2 else Path(base).resolve()
        raise ConfigError(
            f"{where}; `base:` is relative to the sweep file's folder, as a recipe's is: use base: {shown}."
        )
    raise ConfigError(
        f"{where}; `base:` is relative to the sweep file's folder, e.g. base: ../recipes/quickstart.yaml."
    )


def _validate(spec: SweepSpec) -> None:
    choices: tuple[str, ...]
    for key, choices in (("direction", ("maximize", "minimize")), ("use", ("best", "final"))):
        if getattr(spec, key) not in choices:
            raise bad_choice(key, getattr(spec, key), choices, " in the sweep file")
    for key, choices, default in (("sampler", SAMPLERS, "tpe"), ("pruner", PRUNERS, "median")):
        given = getattr(spec, key)
        if not isinstance(given, dict):
            raise ConfigError(f"{key} must be a mapping, e.g. {key}: {{name: {default}}}, got {given!r:.80}.")
        if given.get("name", default) not in choices:
            raise bad_choice(f"{key}.name", given.get("name"), choices, " in the sweep file")
    if not isinstance(spec.parameters, dict) or not spec.parameters:
        raise ConfigError("the sweep has no parameters to search; give `parameters: {dotted.key: {type: ...}}`.")
    if spec.storage is not None:
        check_storage(spec.storage)
    if spec.logger == "wandb" or (isinstance(spec.logger, list) and "wandb" in spec.logger):
        check_wandb_mode(None)  # WANDB_MODE: before the study is made, not in every trial
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
    for name, p in spec.parameters.items():
        check_parameter(name, p)  # every field, before the first trial
    _check_overrides(spec)
    _check_fit_args(spec)


def check_against_recipe(spec: SweepSpec) -> list[str]:
    """Every parameter path must be an option of the base recipe: parsed once with a sample value (imports
    torch, as ``flrun fit`` does). Returns warnings (an objective measured on the test set)."""
    from ..run.arguments import UserError, parse_fit
    from ..run.fit import check_options

    fixed = ["--config", spec.base, *shared_args(spec)]
    try:
        _, init, resolved = parse_fit(fixed)
        check_options(vars(init))  # what fit checks before a run starts: with these no trial could run (--rounds 0)
    except (UserError, ConfigError) as err:
        given = " and the fit arguments after --" if spec.fit_args else ""
        raise ConfigError(f"the sweep's base recipe {spec.base} with its overrides{given}: {err}") from None
    for name, p in spec.parameters.items():
        sample = p["choices"][0] if p["type"] == "categorical" else p["low"]
        try:
            _, init, _ = parse_fit([*fixed, *as_args({name: sample})])
        except (UserError, ConfigError) as err:
            keys = flatten(yaml.safe_load(resolved) or {})
            if any(overlap(name, key) for key in keys):  # an option, with a value it refuses
                raise ConfigError(f"sweep parameter {name!r} does not fit the base recipe {spec.base}: {err}") from None
            close = closest_key(name, keys)
            why = f"did you mean {close!r}? Parameters are dotted recipe keys" if close else str(err).rstrip(".")
            raise ConfigError(
                f"sweep parameter {name!r} is not an option of the base recipe {spec.base} ({why})."
            ) from None
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
    warning = test_metric_warning(spec.metric, getattr(init.strategy, "split", None))
    return [warning] if warning else []


def closest_key(name: str, keys) -> str | None:
    """The recipe key a misspelled parameter path most likely means: one with the same last part (``lr``), else
    a sibling spelled alike (``...init_args.lrr``), else None."""
    parent, _, last = name.rpartition(".")
    last = {"learning_rate": "lr"}.get(last, last)
    same_name = sorted((k for k in keys if k.rsplit(".", 1)[-1] == last), key=len)
    if same_name:
        return same_name[0]
    siblings = {k.rsplit(".", 1)[-1]: k for k in keys if k.rpartition(".")[0] == parent}
    close = difflib.get_close_matches(last, list(siblings), n=1)
    return siblings[close[0]] if close else None


def _check_fit_args(spec: SweepSpec) -> None:
    """The arguments after ``--``: ``flrun fit`` options the trials share, never one the sweep sets per trial or
    searches."""
    options = [arg.split("=", 1)[0] for arg in spec.fit_args if arg.startswith("--")]
    reserved = sorted({o for o in options if o in TRIAL_ARGS})
    if reserved:
        raise ConfigError(
            f"the arguments after -- may not set {', '.join(reserved)}: the sweep sets each trial's recipe, directory, "
            "name and logger itself; use base, output_dir and logger in the sweep file."
        )
    searched = [o for o in options for name in spec.parameters if overlap(o[2:], name)]
    if searched:
        raise ConfigError(
            f"the arguments after -- set {searched[0]}, which the sweep searches (parameters); leave it out there."
        )


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


def shared_args(spec: SweepSpec) -> list[str]:
    """The ``flrun fit`` arguments every trial shares (the base recipe aside): ``--monitor`` set to the sweep's
    metric when a trial's value is its best (so that the best round is chosen by the objective, not by the
    strategy's own test metric), then the overrides and the arguments after ``--``, which may set it otherwise."""
    monitor_set = "monitor" in flatten(spec.overrides) or any(a.split("=")[0] == "--monitor" for a in spec.fit_args)
    chosen_by_metric = spec.use == "best" and not monitor_set and not varies_between_evaluations(spec.metric)
    return [*(["--monitor", spec.metric] if chosen_by_metric else []), *as_args(spec.overrides), *spec.fit_args]


def as_args(values: dict[str, Any]) -> list[str]:
    args = []
    for key, value in values.items():
        args += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return args


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as ``{dotted.key: value}`` (lists stay whole values)."""
    if not isinstance(tree, dict) or not tree:
        return {prefix[:-1]: tree} if prefix else {}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        flat.update(flatten(value, f"{prefix}{key}."))
    return flat


def under(key: str, roots) -> bool:
    return any(key == root or key.startswith(root + ".") for root in roots)


def overlap(a: str, b: str) -> bool:
    """Whether two dotted keys name the same option or one holds the other."""
    return under(a, [b]) or under(b, [a])
