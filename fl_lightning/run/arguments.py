"""From ``flrun fit`` arguments to a run: the parser generated from :func:`fl_lightning.run.fit.fit`'s signature.

Shared by the command line (``cli``) and sweep trials (``sweep.trial``), which both import it; it imports
neither, so the two never import each other.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

from ..federation.bounds import bound_text, option_hints
from ..federation.errors import ConfigError
from .input_errors import config_paths, long_config


class UserError(ConfigError):
    """A mistake in what the user gave (a recipe, an option): one sentence, exit status 2 (from Python, a
    ConfigError like any other)."""


# the optimizer of a recipe that names no optimizer class, put first on the command line; as a parser default,
# its lr would be carried into any class a recipe names without one (jsonargparse keeps given init_args the
# new class accepts)
DEFAULT_OPTIMIZER = "{class_path: torch.optim.SGD, init_args: {lr: 0.05}}"


USAGE = "%(prog)s [-c RECIPE ...] [--KEY VALUE ...] [--print_config] [-h|--help]"

FIT_SUMMARY = """Run a federated experiment from a recipe, a YAML file whose keys are this
command's options. The recipe (-c; several are merged in order) sets data,
models and strategy; an option given here overrides it, nested keys with dots
(--training.batch_size 32).

common options:
  -c, --config RECIPE   recipe YAML file, e.g. recipes/quickstart.yaml
  --seed N              the run seed (default 0)
  --rounds N            communication rounds
  --output_dir DIR      the run folder (default runs/<recipe>/seed<seed>)
  --resume auto         continue the run in output_dir from its last checkpoint
  --logger wandb        W&B (or tensorboard) besides the CSV and JSON files
  --print_config        print the resolved recipe and exit
  --json                print the summary as JSON at the end, not as text

`flrun fit -h` prints this summary; `flrun fit --help` adds every option;
`flrun fit --strategy.help FedAvg` the options of one component (also
--data.help DigitsData, --training.optimizer.help SGD)."""


def fit_parser(prog: str = "flrun fit"):
    """The parser of ``flrun fit``'s options (``prog`` names the command in ``--help``), built once per process
    and command: a parse leaves it as it was (but for the ``--print_shtab`` option jsonargparse adds at the first),
    and building it is a fifth of a parse's time. The YAML loader and the trusted class paths are set again on each
    call (``FLRUN_TRUSTED_MODULES`` may change between runs)."""
    from .safe_yaml import use_for_jsonargparse

    use_for_jsonargparse()  # option values and the files jsonargparse reads: bounded, duplicate keys refused
    trust_class_paths()
    return _built_fit_parser(prog)


@functools.lru_cache(maxsize=4)
def _built_fit_parser(prog: str):
    from jsonargparse import ArgumentParser

    from .fit import fit
    from .recipes import RecipeConfigFile

    class FitParser(ArgumentParser):
        """jsonargparse makes the parser of ``--strategy.help NAME`` as ``type(parser)(description=...)``: this
        class gives it the command's name for its usage line and the formatter that shows the bounds."""

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("prog", prog)
            kwargs.setdefault("formatter_class", help_formatter())
            super().__init__(*args, **kwargs)

        def add_class_arguments(self, theclass, nested_key=None, *args, **kwargs):
            """jsonargparse drops the bounds of ``Annotated`` options: each option's action keeps its text."""
            added = super().add_class_arguments(theclass, nested_key, *args, **kwargs)
            hints = option_hints(theclass) if isinstance(theclass, type) else {}
            prefix = f"{nested_key}." if nested_key else ""
            for action in self._actions:
                name = action.dest.removeprefix(prefix)
                if action.dest.startswith(prefix) and name in hints:
                    action.bound = bound_text(hints[name])  # type: ignore[attr-defined]
            return added

    parser = FitParser(
        usage=USAGE,
        description=FIT_SUMMARY if prog == "flrun fit" else "Run a federated experiment from a recipe.",
        exit_on_error=False,
        env_prefix="FLRUN",
        default_env=False,
        allow_abbrev=False,  # `--round 10` must not silently mean --rounds: an unknown option gets "did you mean"
    )
    parser.add_argument(
        "-c",
        "--config",
        action=RecipeConfigFile,
        metavar="RECIPE",
        help="recipe YAML file (may be given more than once; `base:` inherits)",
    )
    parser.add_function_arguments(fit, skip={"resolved_config"})
    return parser


def help_formatter():
    """jsonargparse's help formatter, but the summary keeps its lines, and data, models and strategy, which fit's
    signature requires, read as what a recipe sets rather than as options required on the command line."""
    from jsonargparse import DefaultHelpFormatter

    class FitHelpFormatter(DefaultHelpFormatter):
        def _fill_text(self, text, width, indent):
            return "".join(indent + line for line in text.splitlines(keepends=True))

        def _get_help_string(self, action):
            return super()._get_help_string(action).replace("(required, ", "(set by the recipe or here, ", 1)

        def _get_type_str(self, action):
            """The type, then the bound a strategy declares (``int, >= 1``): the value the class would refuse."""
            text = super()._get_type_str(action)
            bound = getattr(action, "bound", None)
            return f"{text}, {bound}" if text and bound else text

    return FitHelpFormatter


# class paths a recipe or option may name without being trusted explicitly: what the project and torch ship
TRUSTED_CLASS_PATHS = ("fl_lightning", "torch.optim")
_trusted_before: set[str] = set()


def trust_class_paths() -> None:
    """Makes jsonargparse refuse, before importing it, a ``class_path`` outside :data:`TRUSTED_CLASS_PATHS` and
    the modules of ``FLRUN_TRUSTED_MODULES``: a recipe is a file one may be handed, and importing a module named
    there runs its code (the rule of the models' builders, ``models/registry.py``)."""
    from jsonargparse import set_parsing_settings

    from ..models.registry import trusted_modules

    trusted = {m for m in (*TRUSTED_CLASS_PATHS, *trusted_modules()) if _importable_name(m)}
    revoked = sorted(_trusted_before - trusted)  # FLRUN_TRUSTED_MODULES changed in this process (tests)
    set_parsing_settings(import_path_denylist=["*", *revoked], import_path_allowlist=sorted(trusted))
    _trusted_before.clear()
    _trusted_before.update(trusted)


def _importable_name(module: str) -> bool:
    return all(part.isidentifier() for part in module.split(".")) and module.split(".")[0] != "jsonargparse"


def parse_fit(argv: list[str], prog: str = "flrun fit"):
    """Parses ``flrun fit`` arguments; returns (namespace, instantiated objects, resolved YAML).

    ``prog`` is the command shown by ``--help`` (``flrun data inspect`` takes the same options).
    """
    from .precheck import precheck

    argv = long_config(argv)
    precheck(argv)  # the common mistakes, answered before the parser's imports (torch)
    from jsonargparse import ArgumentError

    from ..federation.user_code import failed_import
    from .input_errors import root_cause

    parser = fit_parser(prog)
    if not _optimizer_given(argv):  # first, so that --training.optimizer.init_args.lr 0.01 can change it
        argv = ["--training.optimizer", DEFAULT_OPTIMIZER, *argv]
    try:
        cfg = parser.parse_args(argv)
    except Exception as err:  # noqa: BLE001 - a class_path's module runs any code when jsonargparse imports it
        failed = failed_import(err)
        if failed is not None:
            raise failed from None
        if isinstance(err, ArgumentError):
            raise UserError(root_cause(err, parser)) from None
        raise
    refuse_non_finite(cfg.as_dict())
    if cfg.get("name") is None:
        cfg.name = recipe_name(argv)
    resolved = parser.dump(cfg, skip_unset=False, skip_validation=True)  # validated by parse_args just now
    try:
        init = parser.instantiate(cfg)
    except Exception as err:  # noqa: BLE001 - a component's own validation, wrapped by jsonargparse in any type
        raise UserError(root_cause(err, parser)) from None
    return cfg, init, resolved


def refuse_non_finite(options: object, key: str = "") -> None:
    """Refuses NaN and infinities anywhere in the parsed options (YAML's ``.nan`` and ``.inf``, ``--x nan``),
    naming the key, before anything is built: no option means either, and each would fail late and elsewhere
    (``lr: .nan`` trains a round, then blames divergence; a Dirichlet ``alpha: .nan`` fails inside numpy)."""
    if isinstance(options, dict):
        for name, value in options.items():
            refuse_non_finite(value, f"{key}.{name}" if key else str(name))
    elif isinstance(options, (list, tuple)):
        for i, value in enumerate(options):
            refuse_non_finite(value, f"{key}[{i}]")
    elif isinstance(options, float) and not math.isfinite(options):
        raise UserError(
            f"{key} is {options}, not a finite number; give it a number in the recipe or on the command line."
        )


def _optimizer_given(argv: list[str]) -> bool:
    """Whether a recipe (its bases included) or an option names the clients' optimizer class; options of an
    unnamed one (``init_args`` alone, as a sweep's best_recipe.yaml writes them) are the default's."""
    from jsonargparse import get_loader

    from .recipes import load_recipe

    options = {
        "--training.optimizer": "optimizer",
        "--training.optimizer.class_path": "class",
        "--training": "training",
    }
    for i, arg in enumerate(argv):
        key, _, value = arg.partition("=")
        if key not in options:
            continue
        value = value if "=" in arg else (argv[i + 1] if i + 1 < len(argv) else "")
        if options[key] == "class":
            return True
        try:
            parsed = get_loader("yaml")(value)
        except Exception:  # noqa: BLE001 - not YAML: a class name, or an error the parse reports in its words
            return True
        if options[key] == "training":
            parsed = parsed.get("optimizer") if isinstance(parsed, dict) else None
        if _names_class(parsed):
            return True
    for path in config_paths(argv):
        try:
            training = load_recipe(Path(path)).get("training")
        except Exception:  # noqa: BLE001 - a broken recipe is reported by the parse itself, in its own words
            return True
        if isinstance(training, dict) and _names_class(training.get("optimizer")):
            return True
    return False


def _names_class(optimizer: object) -> bool:
    return isinstance(optimizer, str) or (isinstance(optimizer, dict) and "class_path" in optimizer)


def fit_from_argv(argv: list[str], extra_loggers: list | None = None) -> dict:
    """Runs ``flrun fit`` in-process (sweep trials add a pruning logger) and returns the summary."""
    from ..tracking import resolve_loggers
    from .fit import fit

    _, init, resolved = parse_fit(argv)
    kwargs = {k: v for k, v in vars(init).items() if k not in ("config", "__path__")}
    if extra_loggers:
        kwargs["logger"] = resolve_loggers(kwargs["logger"]) + list(extra_loggers)
    return fit(**kwargs, resolved_config=resolved)


def recipe_name(argv: list[str]) -> str:
    """The run's default name: the stem of the last ``--config`` file."""
    configs = config_paths(argv)
    return Path(configs[-1]).stem if configs else "run"
