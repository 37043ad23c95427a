"""The sweep's metric, checked before any trial runs against the names evaluations produce
(:mod:`fl_lightning.client.evaluation`: ``<role>/test_<acc|loss|top_class_share|acc_<extra test set>>`` of a
global model, ``personal/...`` of the clients' own models); a run that reports no such metric stops the
sweep after its first trial (:class:`MissingMetric`)."""

from __future__ import annotations

import difflib

from ..federation.errors import ConfigError

# Evaluator.global_model's names, each as <role>/test_<name> (plus acc_<extra test set>)
GLOBAL_NAMES = ("test_acc", "test_loss", "test_top_class_share")
# Evaluator.personalized's names under personal/ (plus personal/<tier>/test_acc with several tiers)
PERSONAL_NAMES = ("test_acc", "test_acc_std", "test_acc_min", "test_loss", "clients_evaluated")


class MissingMetric(ConfigError):
    """A run that does not report the sweep's metric: no trial can have a value, so the sweep stops."""


def metric_candidates(roles, tiers) -> list[str]:
    names = [f"{role}/{name}" for role in roles for name in GLOBAL_NAMES]
    names += [f"personal/{name}" for name in PERSONAL_NAMES]
    return names + ([f"personal/{tier}/test_acc" for tier in tiers] if len(tiers) > 1 else [])


def known_metric(metric: str, roles, tiers) -> bool:
    """Whether an evaluation of a built-in strategy can report ``metric`` (FedGKT names its server model's
    metrics server/ whatever its role is called)."""
    parts = metric.split("/")
    if len(parts) == 2 and parts[0] in (*roles, "server"):
        return parts[1] in GLOBAL_NAMES or parts[1].startswith("test_acc_")
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
    if known_metric(spec.metric, roles, tiers):
        return
    candidates = metric_candidates(roles, tiers)
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
