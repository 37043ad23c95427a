"""``flrun sweep``: an Optuna study over a base recipe.

A sweep file names the base recipe, the search space (dotted recipe keys, as on the command line), the
objective and the sampler / pruner. Each trial is an ordinary run directory under the sweep's directory,
run in-process through ``flrun fit``; a pruning logger reports the monitored metric every evaluation round
so bad trials stop early. The study lives in an RDB storage (SQLite file in the sweep directory by
default, or any Optuna URL such as PostgreSQL), so re-running the command resumes it and several
processes or machines can work on one study.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError
from .tracking import RunLogger

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
        n_trials: trials in the study in total (finished, pruned or failed); re-running continues up to it.
        timeout: seconds this command may run new trials for.
        sampler: ``{name: tpe|random, seed: 0}``.
        pruner: ``{name: median|hyperband|none, ...}`` (Optuna pruner arguments).
        overrides: fixed recipe overrides for every trial, e.g. ``{rounds: 20}``.
        logger: the trials' logger (``wandb`` groups them by study).
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


def load_sweep(path: str | Path, **cli: Any) -> SweepSpec:
    """Reads and validates a sweep file; every problem is one sentence, before any trial runs."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"sweep file {path} does not exist; sweeps live in sweeps/, e.g. sweeps/digits_quickstart.yaml."
        )
    raw = yaml.safe_load(path.read_text()) or {}
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
    _validate(spec)
    return spec


def _validate(spec: SweepSpec) -> None:
    if not Path(spec.base).is_file():
        raise ConfigError(f"the sweep's base recipe {spec.base} does not exist.")
    if spec.direction not in ("maximize", "minimize") or spec.use not in ("best", "final"):
        raise ConfigError("direction must be maximize or minimize and use best or final.")
    if not spec.parameters:
        raise ConfigError("the sweep has no parameters to search.")
    if spec.sampler.get("name", "tpe") not in SAMPLERS or spec.pruner.get("name", "median") not in PRUNERS:
        raise ConfigError(f"sampler name must be one of {SAMPLERS} and pruner name one of {PRUNERS}.")
    for name, p in spec.parameters.items():
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
    # every parameter path must be an option of the base recipe: parse it once with a sample value
    from .cli import _UserError, parse_fit

    for name, p in spec.parameters.items():
        sample = p["choices"][0] if p["type"] == "categorical" else p["low"]
        try:
            parse_fit(["--config", spec.base, *_as_args(spec.overrides), *_as_args({name: sample})])
        except (_UserError, ConfigError) as err:
            raise ConfigError(f"sweep parameter {name!r} does not fit the base recipe {spec.base}: {err}") from None


def _as_args(values: dict[str, Any]) -> list[str]:
    args = []
    for key, value in values.items():
        args += [f"--{key}", value if isinstance(value, str) else json.dumps(value)]
    return args


class PruningLogger(RunLogger):
    """Reports the objective at every evaluation round; stops the run when Optuna's pruner says so."""

    def __init__(self, trial, metric: str):
        self.trial, self.metric = trial, metric

    def log_metrics(self, metrics, step):
        if self.metric in metrics:
            import optuna

            self.trial.report(float(metrics[self.metric]), step)
            if self.trial.should_prune():
                raise optuna.TrialPruned(f"pruned at round {step}")


def _sampler(spec: SweepSpec):
    import optuna

    options = {k: v for k, v in spec.sampler.items() if k != "name"}
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


def _storage(spec: SweepSpec):
    import optuna

    url = spec.storage or f"sqlite:///{Path(spec.output_dir).resolve() / 'study.db'}"
    kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite") else {"pool_pre_ping": True}
    return optuna.storages.RDBStorage(url, engine_kwargs=kwargs)


def _suggest(trial, name: str, p: dict[str, Any]):
    if p["type"] == "float":
        return trial.suggest_float(name, p["low"], p["high"], log=bool(p.get("log")), step=p.get("step"))
    if p["type"] == "int":
        return trial.suggest_int(name, p["low"], p["high"], log=bool(p.get("log")), step=p.get("step", 1))
    return trial.suggest_categorical(name, p["choices"])


def run_sweep(
    spec: SweepSpec, n_jobs: int = 1, worker: bool = False, sweep_file: str | None = None, quota: int | None = None
) -> dict:
    """Runs trials until the study holds ``n_trials`` (or ``timeout``); returns the best trial's summary.

    With ``n_jobs`` the remaining trials are split between this process and ``n_jobs - 1`` workers, so
    the study ends with exactly ``n_trials``. Independent commands on other machines share the study
    through its storage and stop once it is full (each may overshoot by the trials it was running).
    """
    import optuna

    from .cli import fit_from_argv

    root = Path(spec.output_dir)
    root.mkdir(parents=True, exist_ok=True)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(
        study_name=spec.study_name,
        storage=_storage(spec),
        sampler=_sampler(spec),
        pruner=_pruner(spec),
        direction=spec.direction,
        load_if_exists=True,
    )
    workers = []
    if n_jobs > 1 and not worker and not spec.timeout:  # processes, not threads: trials share no torch state
        remaining = max(0, spec.n_trials - len(study.trials))
        shares = [remaining // n_jobs + (i < remaining % n_jobs) for i in range(n_jobs)]
        quota = shares[0]
        for share in shares[1:]:
            if share:
                workers.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            "-m",
                            "fl_lightning",
                            "sweep",
                            "--config",
                            sweep_file,
                            "--worker",
                            "--quota",
                            str(share),
                            "--storage",
                            str(_storage(spec).url),
                            "--output_dir",
                            str(root),
                            "--study_name",
                            spec.study_name,
                        ]
                    )
                )

    def objective(trial) -> float:
        values = {name: _suggest(trial, name, p) for name, p in spec.parameters.items()}
        run_dir = root / f"trial_{trial.number:04d}"
        trial.set_user_attr("output_dir", str(run_dir))
        logger = spec.logger
        if logger == "wandb" or (isinstance(logger, list) and "wandb" in logger):
            logger = [
                {
                    "class_path": "fl_lightning.tracking.WandbLogger",
                    "init_args": {"group": spec.study_name, "tags": ["sweep", spec.study_name]},
                }
            ]
        argv = [
            "--config",
            spec.base,
            *_as_args(spec.overrides),
            *_as_args(values),
            "--output_dir",
            str(run_dir),
            "--name",
            f"{spec.study_name}/trial_{trial.number:04d}",
            "--runtime.progress",
            "false",
            *_as_args({"logger": logger}),
        ]
        try:
            summary = fit_from_argv(argv, [PruningLogger(trial, spec.metric)])
        except optuna.TrialPruned:
            raise
        except Exception as err:  # recorded as a failed trial; the study goes on
            trial.set_user_attr("error", f"{type(err).__name__}: {err}")
            raise
        value = summary[spec.use].get(spec.metric)
        if value is None:
            raise ConfigError(f"the run has no metric {spec.metric!r}; it reports {sorted(summary[spec.use])}.")
        return float(value)

    states = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED, optuna.trial.TrialState.FAIL)
    if quota is None or quota > 0:
        study.optimize(
            objective,
            n_trials=quota if quota is not None else (None if spec.timeout else spec.n_trials),
            timeout=spec.timeout,
            callbacks=[optuna.study.MaxTrialsCallback(spec.n_trials, states=states)],
            catch=(Exception,),
            gc_after_trial=True,
        )
    for process in workers:
        process.wait()
    return _write_results(study, spec, root)


def _write_results(study, spec: SweepSpec, root: Path) -> dict:
    import optuna

    rows = []
    for t in study.trials:
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name,
                "value": t.value,
                **{f"param/{k}": v for k, v in t.params.items()},
                "output_dir": t.user_attrs.get("output_dir", ""),
                "error": t.user_attrs.get("error", ""),
            }
        )
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    with (root / "trials.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(columns))
        writer.writeheader()
        writer.writerows(rows)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    result = {
        "study": spec.study_name,
        "trials": len(study.trials),
        "complete": len(complete),
        "pruned": sum(t.state.name == "PRUNED" for t in study.trials),
        "failed": sum(t.state.name == "FAIL" for t in study.trials),
    }
    if complete:
        best = study.best_trial
        config = Path(best.user_attrs["output_dir"]) / "config.yaml"
        recipe = yaml.safe_load(config.read_text())
        for key in ("output_dir", "resume", "stop_after", "name"):
            recipe.pop(key, None)
        header = (
            f"# Best trial {best.number} of sweep {spec.study_name} ({spec.metric} {spec.use} = {best.value:.4f});\n"
            f"# parameters: {json.dumps(best.params)}\n"
        )
        (root / "best_recipe.yaml").write_text(header + yaml.safe_dump(recipe, sort_keys=False))
        result.update(
            {
                "best_trial": best.number,
                "best_value": best.value,
                "best_params": best.params,
                "best_recipe": str(root / "best_recipe.yaml"),
            }
        )
    (root / "sweep.json").write_text(json.dumps(result, indent=2) + "\n")
    return result
