"""What ``flrun fit`` can tell about its arguments before torch is imported: the recipe files (present, YAML,
a recipe and not a sweep file), the names of top-level options and recipe keys and of the fields of the
``training``, ``runtime`` and ``population`` groups, and ``--seed`` given several values.

The parser itself is built from :func:`fl_lightning.run.fit.fit`'s signature, whose types import torch (a second
or more); these checks read the same names from the source files instead (``ast``), so that the most common
mistakes are answered at once, in the parser's own words. Anything they cannot tell is left to the parser.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

from ..federation.errors import ConfigError
from .input_errors import _did_you_mean, check_config_file, config_paths

PACKAGE = Path(__file__).resolve().parents[1]
# the groups whose fields are a dataclass's (jsonargparse expands them into --group.field options)
GROUPS = {
    "training": ("client/training.py", "LocalTraining"),
    "runtime": ("run/runtime.py", "Runtime"),
    "population": ("federation/population.py", "Population"),
}
PARSER_OPTIONS = ("config", "print_config", "help")


@cache
def _fields(relative: str, name: str) -> tuple[str, ...]:
    """The annotated fields of the dataclass ``name`` in the package file ``relative``."""
    tree = ast.parse((PACKAGE / relative).read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return tuple(
                item.target.id
                for item in node.body
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
            )
    raise LookupError(f"{name} is not defined in {relative}")


@cache
def fit_options() -> tuple[str, ...]:
    """The parameters of :func:`fl_lightning.run.fit.fit`, read from its source."""
    for node in ast.parse((PACKAGE / "run" / "fit.py").read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == "fit":
            return tuple(a.arg for a in node.args.args + node.args.kwonlyargs if a.arg != "resolved_config")
    raise LookupError("fit is not defined in run/fit.py")


def group_fields(group: str) -> tuple[str, ...]:
    return _fields(*GROUPS[group])


def precheck(argv: list[str]) -> None:
    """Raises ConfigError for a mistake the parser would find later; returns when it finds none."""
    for path in config_paths(argv):
        check_config_file(path)
    _check_seed(argv)
    for arg in argv:
        if arg.startswith("--") and len(arg) > 2:
            _check_option(arg[2:].split("=", 1)[0])
    for path in config_paths(argv):
        _check_recipe_keys(path)


def _check_option(option: str) -> None:
    head, _, rest = option.rstrip("+").partition(".")  # `--logger+ X` appends to a list
    if option.endswith(".help") or head in PARSER_OPTIONS:
        return
    if head not in fit_options():
        hint = _did_you_mean(f"--{head}", [f"--{name}" for name in fit_options()])
        raise ConfigError(f"unknown option --{option}{hint}; see `flrun fit --help` for the options.")
    field = rest.split(".", 1)[0]
    if head in GROUPS and field and field not in group_fields(head):
        hint = _did_you_mean(f"--{head}.{field}", [f"--{head}.{name}" for name in group_fields(head)])
        raise ConfigError(f"unknown option --{head}.{field}{hint}; see `flrun fit --help` for the options.")


def _check_recipe_keys(path: str) -> None:
    from .recipes import load_recipe

    try:
        recipe = load_recipe(path)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - what the parser reports in its own words
        return
    for key, value in recipe.items():
        if key not in fit_options():
            hint = _did_you_mean(key, list(fit_options()), quote=True)
            raise ConfigError(
                f"unknown key {key!r} in the recipe{hint}; check its spelling against `flrun fit --help`."
            )
        if key in GROUPS and isinstance(value, dict):
            for field in value:
                if field not in group_fields(key):
                    hint = _did_you_mean(f"{key}.{field}", [f"{key}.{name}" for name in group_fields(key)], quote=True)
                    raise ConfigError(
                        f"unknown key '{key}.{field}' in the recipe{hint}; "
                        "check its spelling against `flrun fit --help`."
                    )


def _check_seed(argv: list[str]) -> None:
    """``--seed 0 1 2``: one seed per run; several are several runs."""
    if "--seed" not in argv:
        return
    start = argv.index("--seed") + 1
    values = []
    for arg in argv[start:]:
        if arg.startswith("--"):
            break
        values.append(arg)
    if len(values) > 1:
        configs = config_paths(argv)
        recipe = configs[-1] if configs else "RECIPE"
        seeds = " ".join(values)
        raise ConfigError(
            f"--seed takes one seed per run, got {seeds}; run the seeds one after another, e.g. "
            f"`for seed in {seeds}; do flrun fit --config {recipe} --seed $seed; done`, or a paper table's recipes "
            f"at several seeds with `flrun table PAPER/TABLE --seeds {seeds}`."
        )
