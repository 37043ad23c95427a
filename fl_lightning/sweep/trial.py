"""One trial of ``flrun sweep``: the objective runs ``flrun fit`` in ``trial_NNNN/`` with the trial's
parameters; a pruning logger reports the sweep's metric every evaluation round."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import warnings
from pathlib import Path
from typing import Any

from ..federation.errors import ConfigError
from ..tracking import RunLogger
from .metric import MissingMetric, test_counterpart, varies_between_evaluations
from .spec import SweepSpec, as_args, shared_args


class PruningLogger(RunLogger):
    """Reports the objective at every evaluation round; stops the run when Optuna's pruner says so, and at
    its first evaluation when that lacks the objective (a wrong metric name, then no trial can have a value)."""

    def __init__(self, trial, metric: str):
        self.trial, self.metric = trial, metric
        self.eval_every = self.rounds = None

    def start(self, output_dir, name, config, state):
        self.eval_every, self.rounds = (config or {}).get("eval_every"), (config or {}).get("rounds")

    def log_metrics(self, metrics, step):
        if self.metric in metrics:
            import optuna

            self.trial.report(float(metrics[self.metric]), step)
            if self.trial.should_prune():
                raise optuna.TrialPruned(f"pruned at round {step}")
        elif self._evaluated(step) and not varies_between_evaluations(self.metric):
            raise missing_metric(self.metric, step, metrics)

    def _evaluated(self, step: int) -> bool:
        """Whether round ``step`` ended with an evaluation (as the orchestrator decides)."""
        if not isinstance(self.eval_every, int) or not isinstance(self.rounds, int) or self.eval_every < 1:
            return False
        return step % self.eval_every == 0 or step == self.rounds


def missing_metric(metric: str, step: int | None, metrics) -> MissingMetric:
    """The sweep's metric is not among the evaluation's: no trial can have a value."""
    reported = sorted(k for k in metrics if "/test_" in k or "/val_" in k or k.startswith("personal/"))
    return MissingMetric(
        f"the run has no metric {metric!r}; its evaluation at round {step} reports {reported}; fix `metric` in the "
        "sweep file."
    )


def _suggest(trial, name: str, p: dict[str, Any]):
    if p["type"] == "float":
        return trial.suggest_float(name, p["low"], p["high"], log=bool(p.get("log")), step=p.get("step"))
    if p["type"] == "int":
        return trial.suggest_int(name, p["low"], p["high"], log=bool(p.get("log")), step=p.get("step", 1))
    return trial.suggest_categorical(name, p["choices"])


PROCESS = f"{socket.gethostname()}:{os.getpid()}"


def warm_up(spec: SweepSpec) -> None:
    """Imports what a trial's run needs (torch, Fabric, the parser and the recipe's classes) by parsing the base
    recipe once, before a worker process asks for its first trial: a worker starts without them, and its first
    trial's time (the trials table, the pruner's view of it) would include seconds of imports that a sweep in one
    process pays in its recipe check instead. A recipe that fails here fails its trials, which say why."""
    from ..distributed.fabric import fabric_class
    from ..run.arguments import parse_fit

    fabric_class()
    with contextlib.suppress(ConfigError):
        parse_fit(["--config", spec.base, *shared_args(spec)])


@contextlib.contextmanager
def messages_named(number: int):
    """The warnings a trial's run gives (the package's log warnings, Python's warnings) go to stderr as
    ``flrun sweep: trial 3: warning: ...``: with several workers, lines of several trials interleave, and one
    without its trial cannot be told apart."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_TrialFormatter(f"flrun sweep: trial {number}: "))
    package = logging.getLogger("fl_lightning")
    propagate, package.propagate = package.propagate, False  # shown once, here, not again by a root handler
    package.addHandler(handler)

    def show(message, category, filename, lineno, file=None, line=None):
        package.warning("%s: %s", category.__name__, message)

    try:
        with warnings.catch_warnings():
            warnings.showwarning = show
            yield
    finally:
        package.removeHandler(handler)
        package.propagate = propagate


class _TrialFormatter(logging.Formatter):
    """``<prefix>warning: <message>`` for a warning, ``<prefix><message>`` for a note (a download, a resume)."""

    def __init__(self, prefix: str):
        super().__init__("%(message)s")
        self.prefix = prefix

    def format(self, record: logging.LogRecord) -> str:
        kind = "warning: " if record.levelno >= logging.WARNING else ""
        return f"{self.prefix}{kind}{super().format(record)}"


def run_trial(spec: SweepSpec, trial, notify) -> float:
    """The objective: one ``flrun fit`` run in ``trial_NNNN/`` with the trial's parameters."""
    import optuna

    from ..run.arguments import fit_from_argv

    values = {name: _suggest(trial, name, p) for name, p in spec.parameters.items()}
    run_dir = Path(spec.output_dir) / f"trial_{trial.number:04d}"
    # a retry inherits its dead predecessor's attributes: each is set afresh
    for key, attribute in (("output_dir", str(run_dir)), ("process", PROCESS), ("error", "")):
        trial.set_user_attr(key, attribute)
    notify("started", trial.number)
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
        *shared_args(spec),
        *as_args(values),
        "--output_dir",
        str(run_dir),
        "--name",
        f"{spec.study_name}/trial_{trial.number:04d}",
        "--runtime.progress",
        "false",
        *as_args({"logger": logger}),
    ]
    try:
        with messages_named(trial.number):
            summary = fit_from_argv(argv, [PruningLogger(trial, spec.metric)])
        value = trial_value(summary, spec)
        test = test_counterpart(spec.metric)
        if test is not None and test in (summary.get(spec.use) or {}):  # reported for the best trial only
            trial.set_user_attr("test_value", float(summary[spec.use][test]))
    except optuna.TrialPruned:
        raise
    except KeyboardInterrupt:
        trial.set_user_attr("error", "interrupted; its parameters are queued again")
        raise
    except Exception as err:  # recorded as a failed trial; the study goes on (unless its metric is wrong)
        from ..run.arguments import UserError
        from ..run.state import MissingMonitor

        if isinstance(err, MissingMonitor) and err.monitor == spec.metric:  # the trial monitors the sweep's metric
            err = missing_metric(spec.metric, err.round, err.metrics)
        from ..federation.user_code import UserCodeError

        plain = (UserError, ConfigError, UserCodeError)  # a sentence already ("your model builder m.b raised ...")
        message = str(err) if isinstance(err, plain) else f"{type(err).__name__}: {err}"
        trial.set_user_attr("error", (message.splitlines() or [""])[0][:300])
        if isinstance(err, MissingMetric):
            trial.set_user_attr("wrong_metric", True)
            raise err from None
        raise
    return value


def trial_value(summary: dict[str, Any], spec: SweepSpec) -> float:
    """The trial's value from its run's summary; an error saying why there is none."""
    import math

    reported = summary.get(spec.use) or {}
    if not reported:  # no evaluation, or the monitor was never a number (`best`): this trial alone has no value
        raise ValueError(
            f"the run's summary.json has no `{spec.use}` evaluation (its monitor {summary.get('monitor')!r} was "
            "never a number), so the trial has no value."
        )
    if spec.metric not in reported:
        raise MissingMetric(f"the run has no metric {spec.metric!r}; it reports {sorted(reported)}.")
    value = float(reported[spec.metric])
    if math.isnan(value):
        raise ValueError(f"the run's {spec.metric} ({spec.use}) is NaN, so the trial has no value.")
    return value
