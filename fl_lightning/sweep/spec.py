"""``flrun sweep``: an Optuna study over a base recipe.

A sweep file names the base recipe, the search space (dotted recipe keys, as on the command line), the
objective and the sampler / pruner. Each trial is an ordinary run directory under the sweep's directory,
run through ``flrun fit`` (:mod:`fl_lightning.sweep.trial`); a pruning logger reports the monitored metric
every evaluation round so bad trials stop early. The study lives in an RDB storage (SQLite file in the
sweep directory by default, or any Optuna URL such as PostgreSQL), so re-running the command resumes it
and several processes or machines can work on one study; a re-run that changes what a trial means is
refused (:mod:`fl_lightning.sweep.study`).

``n_trials`` is the study's total: trials that completed, were pruned or failed on their own count (not
those whose run lacked the sweep's metric: the sweep stops at the first); a trial whose process died (a heartbeat that stopped, a killed worker, an interrupt) is failed and queued
again with the same parameters, and only its retry counts. Worker processes (``--n_jobs``) ask the
command for permission before each trial (:mod:`fl_lightning.sweep.workers`), so the total is exact.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..federation.errors import ConfigError
from ..run.safe_yaml import read_file
from .metric import check_metric
from .space_checks import check_parameter
from .storage_check import check_storage

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
    if not path.exists() and not path.is_symlink():  # a directory, a FIFO or a link loop: read_file names it
        raise ConfigError(
            f"sweep file {path} does not exist; sweeps live in sweeps/, e.g. sweeps/digits_quickstart.yaml."
        )
    raw = read_file(path, f"sweep file {path}", "a YAML sweep file, e.g. sweeps/digits_quickstart.yaml")
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
    if spec.storage is not None:
        check_storage(spec.storage)
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
        check_parameter(name, p)  # every field, before the first trial
    _check_overrides(spec)
    if not check_recipe:
        return
    # every parameter path must be an option of the base recipe: parse it once with a sample value
    from ..run.arguments import UserError, parse_fit

    init = None
    for name, p in spec.parameters.items():
        sample = p["choices"][0] if p["type"] == "categorical" else p["low"]
        try:
            _, init, _ = parse_fit(["--config", spec.base, *as_args(spec.overrides), *as_args({name: sample})])
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
