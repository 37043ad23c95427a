"""What a sweep's trials mean, checked before any trial runs.

A study's trials are comparable only when they were run with the same objective and the same recipe. The
study records its *definition* when it is created: the metric, the direction, which value of a run is the
trial's (``use``), the search space and the resolved recipe every trial starts from (the base recipe with
the sweep's overrides and the fit arguments after ``--``, without the searched keys and the keys that change
no number). A re-run whose sweep
file defines another study is refused instead of mixing its trials in.

What may change between runs of one study: ``n_trials``, ``timeout``, ``--n_jobs``, the sampler and the
pruner (they choose which points are tried and which trials stop early, not what a completed trial's value
means), ``logger``, ``heartbeat_interval``, ``grace_period``, ``max_retry``, and the recipe keys in
:data:`NOT_DEFINING`.

The sweep's metric is checked by :mod:`fl_lightning.sweep.metric`.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from ..federation.errors import ConfigError
from .spec import as_args, flatten, under
from .storage import shown_storage

STUDY_KEY = "flrun_sweep"  # the study's user attribute holding its definition
COMPARED = ("metric", "direction", "use", "parameters", "recipe")
# recipe keys that change no trial's numbers: where it writes, its name, where it logs, its progress bar
NOT_DEFINING = (
    "name",
    "output_dir",
    "logger",
    "reference",
    "resume",
    "checkpoint_every",
    "runtime.progress",
    "runtime.client_state_memory_mb",
    "runtime.devices",
)


def trial_recipe(spec) -> dict[str, Any]:
    """The resolved recipe every trial starts from (base recipe and overrides), as ``{dotted.key: value}``,
    without the searched keys and :data:`NOT_DEFINING`: a change of an included ``base:`` file shows here."""
    from ..run.arguments import UserError, parse_fit

    try:
        _, _, resolved = parse_fit(["--config", spec.base, *as_args(spec.overrides), *spec.fit_args])
    except (UserError, ConfigError) as err:
        raise ConfigError(
            f"the sweep's base recipe {spec.base} with its overrides is not a valid recipe: {err}"
        ) from None
    flat = flatten(yaml.safe_load(resolved) or {})
    return {k: v for k, v in flat.items() if not under(k, spec.parameters) and not under(k, NOT_DEFINING)}


def definition(spec) -> dict[str, Any]:
    """What defines the study of ``spec`` (as the storage returns it: JSON types); ``base`` and ``overrides``
    are recorded for people, the recipe they resolve to is what is compared."""
    value = {
        "metric": spec.metric,
        "direction": spec.direction,
        "use": spec.use,
        "parameters": spec.parameters,
        "recipe": trial_recipe(spec),
        "base": str(spec.base),
        "overrides": spec.overrides,
        "fit_args": spec.fit_args,
    }
    return json.loads(json.dumps(value, default=str))


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """``{what: (old, new)}`` for every defining difference; absent entries are None."""
    changed: dict[str, tuple[Any, Any]] = {}
    for key in COMPARED:
        before, after = old.get(key), new.get(key)
        if key in ("parameters", "recipe") and isinstance(before, dict) and isinstance(after, dict):
            label = "parameter " if key == "parameters" else "recipe key "
            for name in sorted(set(before) | set(after)):
                if before.get(name) != after.get(name) and not (key == "recipe" and _new_option(name, before, after)):
                    changed[label + name] = (before.get(name), after.get(name))
        elif before != after:
            changed[key] = (before, after)
    return changed


def _new_option(name: str, before: dict[str, Any], after: dict[str, Any]) -> bool:
    """An option that one side's resolved recipe lacks while its class has others: a library or code update
    added (or dropped) an option, with its default, which the recipe does not set."""
    if name in before and name in after:
        return False
    parent = name.rsplit(".", 1)[0] + "." if "." in name else None
    lacking = after if name in before else before
    return parent is not None and any(key.startswith(parent) for key in lacking)


def _shown(value: Any) -> str:
    return "(absent)" if value is None else json.dumps(value, sort_keys=True)  # as the storage returns it


def check_definition(study, spec, current: dict[str, Any], note) -> None:
    """Records ``current`` in a new study; refuses (ConfigError) a study that was defined otherwise.

    A study whose trials all failed has no value to mix: it takes the new definition (a wrong metric is
    fixed so). A study made before definitions were recorded is taken to match, with a note, and records it.
    """
    where = f"study {spec.study_name!r}"
    if study.direction.name.lower() != spec.direction:  # Optuna's own record, in studies of any age
        raise ConfigError(
            f"{where} was made to {study.direction.name.lower()} and the sweep file says direction "
            f"{spec.direction}; give the changed sweep a new study_name (and output_dir) or storage, or revert it."
        )
    trials = study.get_trials(deepcopy=False)
    recorded = study.user_attrs.get(STUDY_KEY)
    if recorded is None:
        if trials:
            note(
                f"{where} was made before sweeps recorded what defines them: its {len(trials)} trials are taken "
                "to match this sweep file, which re-runs are checked against from now on."
            )
        study.set_user_attr(STUDY_KEY, current)
        return
    changed = changed_keys(recorded, current)
    if not changed:
        return
    listed = list(changed.items())
    shown = ", ".join(f"{key} {_shown(old)} -> {_shown(new)}" for key, (old, new) in listed[:6])
    shown += f" and {len(listed) - 6} more" if len(listed) > 6 else ""
    if all(t.state.name == "FAIL" for t in trials):
        note(f"the {len(trials)} trial(s) of {where} all failed, so it takes the changed sweep file ({shown}).")
        study.set_user_attr(STUDY_KEY, current)
        return
    raise ConfigError(
        f"{where} in {shown_storage(spec)} was run with another sweep definition ({shown}); give the changed sweep "
        "a new study_name (and output_dir) or storage, or revert the sweep file."
    )
