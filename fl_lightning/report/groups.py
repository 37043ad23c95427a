"""Which runs ``flrun report`` averages together: the seeds of one experiment.

An experiment is a recipe name plus the run's resolved recipe (its ``config.yaml``) without the keys that
differ between the seeds of one experiment or do not change its numbers (:data:`IGNORED`: the seed, where
the run went, how it was resumed, logged and checkpointed, and every key a resume may change except
``rounds``). The run's resolved monitor (``summary.json``) stands in for ``config.yaml``'s, which is null
when the recipe left it to the default. Runs of one name whose recipes differ otherwise (``--rounds 3``,
``--data.init_args.test_fraction 0.1``, another ``--monitor``) are separate experiments, labelled with the
keys they differ in. Within an experiment a seed counts once: another run of the same seed (a copied
directory) is listed, not averaged.

``config.yaml`` may come from anyone: it is parsed as plain YAML only.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from .runs import read_config

UNKNOWN, MISSING = "config.yaml", "missing or unreadable"  # marks a run whose recipe is not known
SHOWN_IN_LABEL = 3  # differing keys a label names; the section lists all of them
VALUE_CHARS = 30


def ignored_keys() -> tuple[str, ...]:
    """Recipe keys that do not separate experiments: the seed, ``resume`` and every key a resume may
    change (run_state.SAFE_TO_CHANGE) except ``rounds``."""
    from ..run.state import SAFE_TO_CHANGE

    return tuple(dict.fromkeys(("seed", "resume", *(k for k in SAFE_TO_CHANGE if k != "rounds"))))


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted keys of nested dicts (lists stay whole, as a resume compares them)."""
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, item in value.items():
            flat.update(_flatten(item, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


def _is_ignored(key: str, ignored: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in ignored)


def recipe_of(run: dict, ignored: tuple[str, ...]) -> dict[str, Any]:
    """A run's experiment-defining recipe: flattened config.yaml without ``ignored`` keys, the resolved
    monitor; for a run without a readable config.yaml only its monitor, planned rounds and a marker."""
    summary = run["summary"]
    config = read_config(run["root"])
    flat = _flatten(config) if config is not None else None
    if flat is None:
        return {
            UNKNOWN: MISSING,
            "rounds": summary.get("rounds_planned"),
            "monitor": summary.get("monitor"),
        }
    recipe = {UNKNOWN: "present", **{k: v for k, v in flat.items() if not _is_ignored(k, ignored)}}
    recipe["monitor"] = summary.get("monitor", recipe.get("monitor"))
    return recipe


def _digest(recipe: dict[str, Any]) -> str:
    try:
        text = json.dumps(recipe, sort_keys=True, default=str)
    except (TypeError, ValueError, RecursionError):  # odd YAML (mixed key types, recursive aliases): its text
        text = repr(sorted(recipe.items(), key=lambda kv: kv[0]))
    return hashlib.sha256(text.encode()).hexdigest()[:8]


def experiment_digest(run: dict) -> str:
    """A short hash of the run's experiment-defining recipe (its name aside: a base-only recipe is its base's
    experiment)."""
    recipe = recipe_of(run, ignored_keys())
    recipe.pop("name", None)
    return _digest(recipe)


def differing_keys(runs: list[dict]) -> list[str]:
    """The recipe keys in which the experiments of ``runs`` (one run each) differ."""
    return _differences([recipe_of(run, ignored_keys()) for run in runs])


def value_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str)


def _seed(run: dict) -> str:
    return json.dumps(run["summary"].get("seed"), default=str)  # a seed from a file may be any JSON value


def one_per_seed(runs: list[dict]) -> tuple[list[dict], list[dict]]:
    """The first run (by directory) of each seed counts; the same seed again is listed, not counted."""
    kept: dict[str, dict] = {}
    duplicates = []
    for run in sorted(runs, key=lambda r: str(r["root"])):
        seed = _seed(run)
        if seed in kept:
            duplicates.append(run)
        else:
            kept[seed] = run
    return list(kept.values()), duplicates


def _differences(recipes: list[dict[str, Any]]) -> list[str]:
    """Keys (in recipe order) whose values are not the same in all ``recipes``; where a recipe is unknown,
    only the keys every recipe has, and the marker."""
    keys = list(dict.fromkeys(k for recipe in recipes for k in recipe))
    if any(recipe[UNKNOWN] == MISSING for recipe in recipes):
        keys = [k for k in keys if k == UNKNOWN or all(k in recipe for recipe in recipes)]
    return [k for k in keys if len({_digest({"v": recipe.get(k)}) for recipe in recipes}) > 1]


def _short_names(keys: list[str], every: list[str]) -> dict[str, str]:
    """Each dotted key's shortest tail that no other of ``every`` key ends with: ``lr`` for
    training.optimizer.init_args.lr, ``sampler.class_path`` (not ``class_path``, which data has too)."""
    short = {}
    for key in keys:
        parts = [key] if key == UNKNOWN else key.split(".")
        for n in range(1, len(parts) + 1):
            tail = ".".join(parts[-n:])
            if not any(other != key and (other == tail or other.endswith("." + tail)) for other in every):
                break
        short[key] = tail
    return short


def _label(name: str, recipe: dict[str, Any], keys: list[str], short: dict[str, str]) -> str:
    parts = []
    for key in keys[:SHOWN_IN_LABEL]:
        text = value_text(recipe.get(key, "absent"))
        parts.append(f"{short[key]}={text if len(text) <= VALUE_CHARS else text[: VALUE_CHARS - 1] + '…'}")
    if len(keys) > SHOWN_IN_LABEL:
        parts.append(f"+{len(keys) - SHOWN_IN_LABEL} more")
    return f"{name} ({', '.join(parts)})"


def group_experiments(runs: list[dict]) -> list[dict[str, Any]]:
    """The runs' experiments, sorted by label: ``label`` (the name, plus the differing keys where one name
    has several experiments), ``name``, ``experiment`` (a short hash of the recipe), ``differs`` ({key: this
    experiment's value} for the keys its name's experiments differ in), ``runs`` (one per seed) and
    ``duplicates`` (further runs of a counted seed)."""
    ignored = ignored_keys()
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for run in runs:
        name = str(run["summary"].get("name") or run["root"].name)
        recipe = recipe_of(run, ignored)
        digest = _digest(recipe)
        group = groups.setdefault((name, digest), {"name": name, "experiment": digest, "recipe": recipe, "all": []})
        group["all"].append(run)
    by_name: dict[str, list[dict]] = {}
    for group in groups.values():
        by_name.setdefault(group["name"], []).append(group)
    for name, variants in by_name.items():
        keys = _differences([g["recipe"] for g in variants]) if len(variants) > 1 else []
        short = _short_names(keys, list(dict.fromkeys(k for g in variants for k in g["recipe"])))
        for group in variants:
            group["differs"] = {k: group["recipe"].get(k, "absent") for k in keys}
            group["label"] = _label(name, group["recipe"], keys, short) if keys else name
        if len({g["label"] for g in variants}) < len(variants):  # values cut short alike: the hash tells them apart
            for group in variants:
                group["label"] += f" #{group['experiment']}"
    for group in groups.values():
        group["runs"], group["duplicates"] = one_per_seed(group.pop("all"))
        del group["recipe"]
    return sorted(groups.values(), key=lambda g: (g["label"], g["experiment"]))


def group_warnings(group: dict[str, Any]) -> list[str]:
    """One sentence per run not counted (its seed is counted already) and for differing reference blocks."""
    warnings = []
    for dup in group["duplicates"]:
        counted = next(r for r in group["runs"] if _seed(r) == _seed(dup))
        warnings.append(
            f"{dup['root']} is seed {value_text(dup['summary'].get('seed'))} of {group['label']} again "
            f"(as {counted['root']}): "
            "counted once; remove the copy or give it another seed."
        )
    references = {_digest({"r": r["summary"].get("reference")}) for r in group["runs"]}
    if len(references) > 1:
        warnings.append(
            f"the runs of {group['label']} name different reference blocks; the paper's numbers shown are "
            f"those of {group['runs'][0]['root']}."
        )
    return warnings
