"""What ``flrun sweep`` shows and writes: progress lines, the final table, ``trials.csv``, ``sweep.json``
and ``best_recipe.yaml`` (the base recipe plus the best trial's parameters, as a user would run it)."""

from __future__ import annotations

import csv
import io
import json
import shlex
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ..federation.errors import ConfigError
from ..federation.files import atomic_write
from .metric import test_counterpart
from .spec import SweepSpec, shared_args
from .storage import shown_storage, tally

# fANOVA's importances from fewer completed trials than this are mostly noise: shown with a note saying so
RELIABLE_IMPORTANCES = 10


def short_names(names) -> dict[str, str]:
    """The last part of each dotted parameter key, or the whole key where two would look the same."""
    last = [name.rsplit(".", 1)[-1] for name in names]
    return {name: short if last.count(short) == 1 else name for name, short in zip(names, last)}


def _value(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def search_space(spec: SweepSpec) -> dict[str, Any]:
    """The sweep's parameters as the Optuna distributions its trials record."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    space: dict[str, Any] = {}
    for name, p in spec.parameters.items():
        if p["type"] == "float":
            space[name] = FloatDistribution(p["low"], p["high"], log=bool(p.get("log")), step=p.get("step"))
        elif p["type"] == "int":
            space[name] = IntDistribution(p["low"], p["high"], log=bool(p.get("log")), step=p.get("step", 1))
        else:
            space[name] = CategoricalDistribution(p["choices"])
    return space


def outside_space(trials, spec: SweepSpec) -> list[int]:
    """Completed trials drawn from another search space (a study run before it recorded its definition):
    their parameters are not the sweep's, so none of them is reported as its best."""
    space = search_space(spec)
    return [t.number for t in trials if t.state.name == "COMPLETE" and t.distributions != space]


def _best(trials, spec: SweepSpec):
    """The best completed trial of the sweep's search space, or None."""
    foreign = set(outside_space(trials, spec))
    complete = [t for t in trials if t.state.name == "COMPLETE" and t.number not in foreign]
    if not complete:
        return None
    return (max if spec.direction == "maximize" else min)(complete, key=lambda t: t.value)


def _seconds(trial) -> float | None:
    if trial.datetime_start and trial.datetime_complete:
        return (trial.datetime_complete - trial.datetime_start).total_seconds()
    return None


def finished_by(trials, trial) -> int:
    """How many of the study's finished trials (as :func:`~fl_lightning.sweep.storage.tally` counts them) had ended
    when ``trial`` did: each trial's own place, even when two end before the progress line of either is shown
    (two workers), where the count at the moment of showing would give both the same."""
    retried = {n for t in trials for n in t.system_attrs.get("retry_history", [])}

    def counted(t) -> bool:
        state = t.state.name
        wrong = state == "FAIL" and t.user_attrs.get("wrong_metric")
        return state in ("COMPLETE", "PRUNED", "FAIL") and t.number not in retried and not wrong

    def ended(t) -> tuple:
        return (t.datetime_complete is None, t.datetime_complete or 0, t.number)

    return sum(1 for t in trials if counted(t) and ended(t) <= ended(trial))


class Progress:
    """One line per trial as it starts and ends: "[k/n] trial 3 COMPLETE 0.9123 | best ... | pruned ..."."""

    def __init__(self, spec: SweepSpec, study, out=None):
        self.spec, self.study, self.out = spec, study, out or sys.stdout
        self.names = short_names(list(spec.parameters))
        self.ended: list[str] = []  # the state of each trial this command ran to its end
        self.stopped: str | None = None  # why the sweep stops early: a run without the sweep's metric

    def print(self, text: str) -> None:
        """A line of the sweep's report: on ``out`` (stdout)."""
        self.out.write(f"{text}\n")
        self.out.flush()

    def note(self, text: str) -> None:
        """Something went wrong or needs the user's attention: on stderr."""
        sys.stderr.write(f"flrun sweep: {text}\n")
        sys.stderr.flush()

    def header(self, n_jobs: int, gpus: Sequence[str] = ()) -> None:
        counts = tally(self.study.get_trials(deepcopy=False))
        workers = f"{n_jobs} worker processes" if n_jobs > 1 else "in this process"
        if gpus:
            workers += f" (each on one GPU of CUDA_VISIBLE_DEVICES {','.join(gpus)})"
        where = f"storage {shown_storage(self.spec)}; trial runs under {self.spec.output_dir}"
        if counts["finished"] >= self.spec.n_trials:  # n_trials is the study's total, not trials to add
            self.print(
                f"sweep {self.spec.study_name}: the study already holds {counts['finished']} trials, n_trials is "
                f"{self.spec.n_trials}: nothing to run (a larger --n_trials adds more); {where}"
            )
            return
        done = f"{counts['finished']} of {self.spec.n_trials} trials done"
        self.print(f"sweep {self.spec.study_name}: {done}, {workers}; {where}")

    def _trial(self, number: int):
        storage = self.study._storage
        return storage.get_trial(storage.get_trial_id_from_study_id_trial_number(self.study._study_id, number))

    def __call__(self, event: str, number: int) -> None:
        trial = self._trial(number)
        if event == "started":
            params = ", ".join(f"{self.names.get(k, k)}={_value(v)}" for k, v in trial.params.items())
            retry = trial.system_attrs.get("retry_history")
            self.print(f"trial {number} started{f' (retry of trial {retry[-1]})' if retry else ''}: {params}")
            return
        trials = self.study.get_trials(deepcopy=False)
        counts = tally(trials)
        state, metric = trial.state.name, f"{self.spec.metric} ({self.spec.use})"
        position = finished_by(trials, trial)
        if state == "COMPLETE":
            outcome = f"COMPLETE {metric} {trial.value:.4f}"
        elif state == "PRUNED":
            outcome = f"PRUNED at round {trial.last_step} ({self.spec.metric} {_value(trial.value)})"
        elif state == "FAIL" and any(trial.number in t.system_attrs.get("retry_history", []) for t in trials):
            self.print(f"trial {number} interrupted; its parameters are queued again")
            return
        else:
            outcome = f"{state}: {trial.user_attrs.get('error') or 'see the messages above'}"
        self.ended.append(state)
        if state == "FAIL" and trial.user_attrs.get("wrong_metric") and self.stopped is None:
            self.stopped = f"trial {number}: {trial.user_attrs.get('error')}"
        seconds = _seconds(trial)
        best = _best(trials, self.spec)
        self.print(
            f"[{position}/{self.spec.n_trials}] trial {number} {outcome}"
            + (f" in {seconds:.{0 if seconds >= 10 else 1}f} s" if seconds is not None else "")
            + (f" | best {best.value:.4f} (trial {best.number})" if best else " | no completed trial yet")
            + f" | {counts['PRUNED']} pruned, {counts['FAIL']} failed"
        )

    def final(self, result: dict[str, Any], status: int) -> None:
        self.print("")
        self.print(trials_table(self.study, self.spec))
        self.print("")
        if "best_trial" in result:
            test = result.get("best_test")
            tested = f" (its {test['metric']} {test['value']:.4f})" if test else ""
            self.print(
                f"best: trial {result['best_trial']}, {self.spec.metric} ({self.spec.use}) {result['best_value']:.4f}"
                f"{tested}; best recipe: {result['best_recipe']}"
            )
        if result["importances"]:
            shown = ", ".join(f"{self.names.get(k, k)} {value:.2f}" for k, value in result["importances"].items())
            self.print(f"parameter importances (fANOVA): {shown}")
        if result.get("importances_note"):
            self.print(f"  {result['importances_note']}")
        wrong = f", {result['wrong_metric']} without the metric (not counted)" if result["wrong_metric"] else ""
        of = (
            f"of {self.spec.n_trials} "
            if result["trials"] <= self.spec.n_trials
            else f"(n_trials {self.spec.n_trials}) "
        )
        self.print(
            f"{result['trials']} {of}trials: {result['complete']} complete, {result['pruned']} "
            f"pruned, {result['failed']} failed{wrong}; all trials: {Path(self.spec.output_dir) / 'trials.csv'}"
        )
        if result.get("outside_space"):
            self.note(
                f"trials {result['outside_space']} were drawn from another search space (the study predates "
                "recorded definitions) and are not taken as the best."
            )
        if self.stopped:
            self.note(
                f"stopped after {self.stopped} No trial of this sweep can have a value: fix `metric` in the sweep "
                "file and re-run the same command."
            )
        elif status == 1 and self.ended and all(state == "FAIL" for state in self.ended):
            self.note(
                f"every trial this command ran failed ({len(self.ended)}); their errors are above and in "
                f"{Path(self.spec.output_dir) / 'trials.csv'}."
            )
        elif status == 1:
            self.note(
                f"the study holds {result['trials']} of {self.spec.n_trials} trials; re-run the same command to "
                "finish it."
            )


def trial_rows(study, spec: SweepSpec) -> list[dict[str, Any]]:
    trials = study.get_trials(deepcopy=False)
    retried_as = {n: t.number for t in trials for n in t.system_attrs.get("retry_history", [])[-1:]}
    rows = []
    for t in trials:
        seconds = _seconds(t)
        rows.append(
            {
                "trial": t.number,
                "state": t.state.name,
                "value": t.value,
                **{f"param/{k}": v for k, v in t.params.items()},
                "last_round": t.last_step if t.state.name == "PRUNED" else "",
                "seconds": round(seconds, 2) if seconds is not None else "",
                "retry_of": (t.system_attrs.get("retry_history") or [""])[-1],
                "retried_as": retried_as.get(t.number, ""),
                "output_dir": t.user_attrs.get("output_dir", ""),
                "error": t.user_attrs.get("error", ""),
            }
        )
    return rows


def trials_table(study, spec: SweepSpec) -> str:
    """The trials as an aligned text table (the command's last output)."""
    names = short_names(list(spec.parameters))
    header = ["trial", "state", spec.metric, *names.values(), "seconds"]
    lines = [header]
    for row in trial_rows(study, spec):
        state = row["state"] + (f" -> {row['retried_as']}" if row["retried_as"] != "" else "")
        value = "" if row["value"] is None else f"{row['value']:.4f}"
        params = [_value(row.get(f"param/{k}", "")) for k in names]
        lines.append([str(row["trial"]), state, value, *params, str(row["seconds"])])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def importances(study) -> dict[str, float] | None:
    """fANOVA parameter importances over the completed trials (seeded), or None with too few of them."""
    import optuna

    complete = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if len(complete) < 2:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            evaluator = optuna.importance.FanovaImportanceEvaluator(seed=0)
            return {k: float(v) for k, v in optuna.importance.get_param_importances(study, evaluator=evaluator).items()}
    except (RuntimeError, ValueError):  # e.g. every completed trial has the same parameters
        return None


def write_results(study, spec: SweepSpec, root: Path) -> dict[str, Any]:
    """``trials.csv`` (every trial), ``sweep.json`` (counts, best trial, search space, importances) and
    ``best_recipe.yaml``; returns what ``sweep.json`` holds."""
    rows = trial_rows(study, spec)
    columns: dict[str, None] = {}
    for row in rows:
        columns.update(dict.fromkeys(row))
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=list(columns) or ["trial"])
    writer.writeheader()
    writer.writerows(rows)
    atomic_write(root / "trials.csv", table.getvalue())
    trials = study.get_trials(deepcopy=False)
    counts = tally(trials)
    result: dict[str, Any] = {
        "study": spec.study_name,
        "storage": shown_storage(spec),
        "metric": spec.metric,
        "use": spec.use,
        "direction": spec.direction,
        "n_trials": spec.n_trials,
        "trials": counts["finished"],
        "complete": counts["COMPLETE"],
        "pruned": counts["PRUNED"],
        "failed": counts["FAIL"],
        "retried": counts["retried"],
        "wrong_metric": counts["wrong_metric"],
        "running": counts["RUNNING"],
        "parameters": spec.parameters,
        "overrides": spec.overrides,
        "fit_args": spec.fit_args,
        "base": str(spec.base),
        "importances": importances(study),
    }
    if result["importances"] and counts["COMPLETE"] < RELIABLE_IMPORTANCES:
        result["importances_note"] = (
            f"from {counts['COMPLETE']} completed trials: unreliable below about {RELIABLE_IMPORTANCES}; run more "
            "trials (--n_trials) before reading them."
        )
    foreign = outside_space(trials, spec)
    if foreign:
        result["outside_space"] = foreign
    best = _best(trials, spec)
    if best is not None:
        path = root / "best_recipe.yaml"
        atomic_write(path, best_recipe(spec, best, path))
        result.update(
            {"best_trial": best.number, "best_value": best.value, "best_params": best.params, "best_recipe": str(path)}
        )
        if "test_value" in best.user_attrs:  # the tuned recipe's test score: the test set chose nothing
            result["best_test"] = {"metric": test_counterpart(spec.metric), "value": best.user_attrs["test_value"]}
    atomic_write(root / "sweep.json", json.dumps(result, indent=2, default=str) + "\n")
    return result


def _set_dotted(recipe: dict, key: str, value: Any) -> None:
    node = recipe
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.get(part)
        if isinstance(child, str) and parts[i + 1] == "init_args":  # `strategy: a.b.C` shorthand
            child = {"class_path": child}
        elif child is None:
            child = {}
        elif not isinstance(child, dict):
            raise ConfigError(f"cannot set {key} in the base recipe: {'.'.join(parts[: i + 1])} is not a mapping.")
        node[part] = child
        node = child
    node[parts[-1]] = value


def best_recipe(spec: SweepSpec, best, path: Path) -> str:
    """The base recipe (merged with its ``base:`` files) with the best trial's parameters and a name of its
    own; what every trial shared (the overrides, the fit arguments after ``--``, the monitor) is left out and named
    in the header's command."""
    from ..run.recipes import load_recipe

    # merged with its `base:` files: their paths are relative to the base recipe, not to this file
    recipe = load_recipe(spec.base)
    for key, value in best.params.items():
        _set_dotted(recipe, key, value)
    recipe["name"] = f"{spec.study_name}_best"
    overrides = " ".join(shlex.quote(a) for a in shared_args(spec))
    header = [
        f"# The best of sweep {spec.study_name}: the base recipe {spec.base}",
        f"# with the parameters of trial {best.number}: {json.dumps(best.params)}",
        f"# Trial {best.number} scored {spec.metric} ({spec.use}) = {best.value:.4f}"
        + (
            f" with the settings every trial shared; reproduce it with\n#   flrun fit --config {path} {overrides}"
            if overrides
            else "."
        ),
        f"# Runs of this recipe go to runs/{recipe['name']}/seed<seed>.",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(recipe, sort_keys=False)
