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

import contextlib
import json
import os
import socket
import time
from collections.abc import Iterator
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


def check_definition(study, spec, current: dict[str, Any], note, created: bool = False) -> None:
    """Records ``current`` in a study this command ``created``; refuses (ConfigError) a study that was defined
    otherwise.

    A study whose trials all failed (or that has none yet) has no value to mix: it takes the new definition (a
    wrong metric is fixed so), unless another ``flrun sweep`` runs it now, whose trials would then be mixed with
    this one's. A study made before definitions were recorded is taken to match, with a note, and records it.
    """
    where = f"study {spec.study_name!r}"
    if study.direction.name.lower() != spec.direction:  # Optuna's own record, in studies of any age
        raise ConfigError(
            f"{where} was made to {study.direction.name.lower()} and the sweep file says direction "
            f"{spec.direction}; give the changed sweep a new study_name (and output_dir) or storage, or revert it."
        )
    if created:
        study.set_user_attr(STUDY_KEY, current)
        return
    recorded = _recorded_definition(study)
    trials = study.get_trials(deepcopy=False)
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
    others = others_running(study)
    if others:
        raise ConfigError(
            f"{where} in {shown_storage(spec)} is being run by another flrun sweep ({', '.join(others)}) with another "
            f"sweep definition ({shown}); give this sweep its own study_name (and output_dir), or wait for that one "
            "to end."
        )
    if all(t.state.name == "FAIL" for t in trials):
        count = f"the {len(trials)} trial(s) of {where} all failed" if trials else f"{where} has no trials yet"
        note(f"{count}, so it takes the changed sweep file ({shown}).")
        study.set_user_attr(STUDY_KEY, current)
        return
    raise ConfigError(
        f"{where} in {shown_storage(spec)} was run with another sweep definition ({shown}); give the changed sweep "
        "a new study_name (and output_dir) or storage, or revert the sweep file."
    )


def _recorded_definition(study, wait_s: float = 10.0) -> dict[str, Any] | None:
    """The study's recorded definition. A study without one and without trials was made an instant ago by another
    command (which records it next) or by one that died before it could: waits ``wait_s`` for the record."""
    end = time.monotonic() + wait_s
    while True:
        recorded = study.user_attrs.get(STUDY_KEY)
        if recorded is not None or study.get_trials(deepcopy=False) or time.monotonic() > end:
            return recorded
        time.sleep(0.2)


# One user attribute per command that runs the study, ``flrun_sweep_running:<host>:<pid>``: True while it runs,
# False once it ended (Optuna cannot delete an attribute). Per command, so that two commands never overwrite one
# attribute; one killed leaves True behind, which the next command on its host that looks clears.
RUNNING_KEY = "flrun_sweep_running:"


def this_command() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@contextlib.contextmanager
def running(study) -> Iterator[None]:
    """Marks ``study`` as run by this command until the block ends."""
    key = RUNNING_KEY + this_command()
    study.set_user_attr(key, True)
    try:
        yield
    finally:
        with contextlib.suppress(Exception):  # a storage gone (a full disk) must not hide why the sweep ended
            study.set_user_attr(key, False)


def others_running(study) -> list[str]:
    """``host:pid`` of the other commands that run ``study`` now; one on another host is taken to run (its
    process cannot be looked at from here). A mark left by a command of this host that was killed is cleared."""
    me, host = this_command(), socket.gethostname()
    marked = [key[len(RUNNING_KEY) :] for key, on in study.user_attrs.items() if key.startswith(RUNNING_KEY) and on]
    others = []
    for who in marked:
        if who == me:
            continue
        if who.startswith(f"{host}:") and not _alive(int(who.rpartition(":")[2])):
            study.set_user_attr(RUNNING_KEY + who, False)  # before its pid can be given to another process
            continue
        others.append(who)
    return others


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
