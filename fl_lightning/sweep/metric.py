"""The sweep's metric, checked before any trial runs against the names evaluations produce
(:mod:`fl_lightning.client.evaluation`: ``<role>/test_<acc|loss|top_class_share|acc_<extra test set>>`` of a
global model, ``<role>/val_<acc|loss>`` where the clients hold local val splits, ``personal/...`` of the
clients' own models); a run that reports no such metric stops the sweep after its first trial
(:class:`MissingMetric`).

A sweep chooses its best trial by its metric, so a test-set metric makes the test set part of the tuning
and overstates what the tuned recipe reaches: :func:`test_metric_warning` says so, and a validation metric's
test counterpart (:func:`test_counterpart`) is reported for the best trial instead."""

from __future__ import annotations

import difflib

from ..federation.errors import ConfigError

# Evaluator.global_model's names, each as <role>/test_<name> (plus acc_<extra test set>)
GLOBAL_NAMES = ("test_acc", "test_loss", "test_top_class_share")
# Evaluator.validation_metrics' names, as <role>/<name>, when the data has a local val share
VALIDATION_NAMES = ("val_acc", "val_loss")
VAL_SPLIT_EXAMPLE = "data.init_args.local_split: [0.8, 0.2, 0.0]"
# Evaluator.personalized's names under personal/ (plus personal/<tier>/test_acc with several tiers)
PERSONAL_NAMES = ("test_acc", "test_acc_std", "test_acc_min", "test_loss", "clients_evaluated")


class MissingMetric(ConfigError):
    """A run that does not report the sweep's metric: no trial can have a value, so the sweep stops."""


def metric_candidates(roles, tiers, validating: bool = False) -> list[str]:
    names = [f"{role}/{name}" for role in roles for name in GLOBAL_NAMES]
    names += [f"{role}/{name}" for role in roles for name in VALIDATION_NAMES] if validating else []
    names += [f"personal/{name}" for name in PERSONAL_NAMES]
    return names + ([f"personal/{tier}/test_acc" for tier in tiers] if len(tiers) > 1 else [])


def known_metric(metric: str, roles, tiers, validating: bool = False) -> bool:
    """Whether an evaluation of a built-in strategy can report ``metric`` (FedGKT names its server model's
    metrics server/ whatever its role is called; global models report val_ metrics when ``validating``)."""
    parts = metric.split("/")
    if len(parts) == 2 and parts[0] in (*roles, "server"):
        validated = validating and parts[0] in roles and parts[1] in VALIDATION_NAMES
        return validated or parts[1] in GLOBAL_NAMES or parts[1].startswith("test_acc_")
    if parts[0] == "personal" and len(parts) == 2:
        return parts[1] in PERSONAL_NAMES
    return (
        len(parts) == 3 and parts[0] == "personal" and len(tiers) > 1 and parts[1] in tiers and parts[2] == "test_acc"
    )


def check_metric(spec, init) -> None:
    """Refuses a metric no run of the recipe reports (built-in strategies; another strategy's names are
    checked by the first trial's first evaluation)."""
    if not type(init.strategy).__module__.startswith("fl_lightning."):
        return
    roles = list(init.models)
    tiers = [tier.name for tier in init.population.tiers]
    validating = getattr(init.data, "local_split", (1.0, 0.0, 0.0))[1] > 0
    if known_metric(spec.metric, roles, tiers, validating):
        return
    if not validating and known_metric(spec.metric, roles, tiers, validating=True):
        raise ConfigError(
            f"the sweep's metric {spec.metric!r} is measured on the clients' local val splits, which the runs of "
            f"{spec.base} do not have; give them a val share in the sweep's overrides, e.g. {VAL_SPLIT_EXAMPLE}."
        )
    candidates = metric_candidates(roles, tiers, validating)
    close = difflib.get_close_matches(spec.metric, candidates, n=1)
    raise ConfigError(
        f"the sweep's metric {spec.metric!r} is not one the runs of {spec.base} can report"
        + (f" (did you mean {close[0]!r}?)" if close else "")
        + f"; they report some of {', '.join(candidates)} (or <role>/test_acc_<extra test set>, by strategy and "
        "data); fix `metric` in the sweep file."
    )


def varies_between_evaluations(metric: str) -> bool:
    """Metrics an evaluation may leave out while later ones report them (personal/clients_evaluated only when
    fewer clients are covered; per-tier ones only when several tiers were evaluated)."""
    parts = metric.split("/")
    return parts[0] == "personal" and (len(parts) == 3 or parts[-1] == "clients_evaluated")


def is_test_metric(metric: str) -> bool:
    """Whether ``metric`` is measured on a test set (the global one or the clients' local test splits)."""
    return metric.rsplit("/", 1)[-1].startswith("test_")


def test_counterpart(metric: str) -> str | None:
    """The test-set metric of a validation metric (``global/val_acc`` -> ``global/test_acc``), else None."""
    head, _, name = metric.rpartition("/")
    return f"{head}/test_{name[4:]}" if name.startswith("val_") else None


def test_metric_warning(metric: str, personal_split: str | None = None) -> str | None:
    """What to say when the objective is a test metric: the best trial is then chosen on the test set
    (``personal_split``: the local split a personalized strategy evaluates on; ``val`` measures ``personal/``
    metrics on the val splits)."""
    if not is_test_metric(metric) or (metric.startswith("personal/") and personal_split == "val"):
        return None
    role, name = metric.split("/", 1)[0], metric.rsplit("/test_", 1)[-1]
    if role == "personal":
        instead = "the strategy's split: val with a val share in data.init_args.local_split, e.g. [0.8, 0.1, 0.1]"
    else:
        instead = f"{role}/val_{name} with {VAL_SPLIT_EXAMPLE} in the overrides"
    return (
        f"the objective {metric} is measured on the test set, so choosing the best trial by it tunes on the test "
        f"set and overstates what the best recipe reaches; tune on a validation metric instead ({instead})."
    )
