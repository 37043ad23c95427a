"""One sentence for every way ``flrun fit``'s input can be wrong: config files checked before parsing, and
jsonargparse's nested error text turned into what is wrong, where, and how to fix it (with "did you mean").

Nothing here imports torch or Lightning at module level: an error must come as fast as ``--help``.
"""

from __future__ import annotations

import collections.abc
import difflib
import importlib
import inspect
import re
import typing
from typing import Any

from ..federation.errors import ConfigError
from .safe_yaml import clip

EXAMPLE_RECIPE = "recipes/quickstart.yaml"


# ---------------------------------------------------------------------------------------------- config files
def long_config(argv: list[str]) -> list[str]:
    """``argv`` with ``-c`` (LightningCLI's short form of ``--config``) written as ``--config``, so that every
    check and the parser see one spelling."""
    return ["--config" if arg == "-c" else f"--config={arg[3:]}" if arg.startswith("-c=") else arg for arg in argv]


def config_paths(argv: list[str]) -> list[str]:
    """The files given with ``--config PATH`` or ``--config=PATH``, in order."""
    paths = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--config"]
    return paths + [arg.partition("=")[2] for arg in argv if arg.startswith("--config=")]


def check_config_file(path: str) -> None:
    """Raises ConfigError unless ``path`` is a readable YAML file holding a mapping of options."""
    from .safe_yaml import load_text, read_text

    text = read_text(path, f"config file {path!r}", f"an existing recipe, e.g. --config {EXAMPLE_RECIPE}")
    recipe = load_text(text, f"config file {path}")
    if recipe is None:
        raise ConfigError(
            f"config file {path} is empty; a recipe sets at least data, models and strategy (see {EXAMPLE_RECIPE})."
        )
    if not isinstance(recipe, dict):
        raise ConfigError(
            f"config file {path} must be a YAML mapping of `flrun fit` options (`key: value` lines), "
            f"not a {type(recipe).__name__}; see {EXAMPLE_RECIPE}."
        )
    if "parameters" in recipe or "metric" in recipe:  # keys of a sweep file, never of a recipe
        raise ConfigError(f"{path} is a sweep file, not a recipe; run it with `flrun sweep --config {path}`.")


# ---------------------------------------------------------------------------------------------- parser errors
def readable(message: str, parser: Any = None) -> str:
    """One sentence from jsonargparse's nested error text, with a hint of how to fix it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    text = " ".join(lines)
    keys = re.findall(r'Parser key "([^"]+)"', text)
    key = ""
    for part in keys:  # a group given as a mapping (--training '{...}') names its keys in full: training.batch_size
        key = part if part.startswith(f"{key}.") or not key else f"{key}.{part}"
    for explain in (_unknown_argument, _unknown_key, _unknown_init_option, _missing_required):
        sentence = explain(text, keys, parser)
        if sentence:
            return sentence
    for explain_at_key in (_init_args_not_mapping, _untrusted_class, _unknown_class, _dotted_mapping, _bad_value):
        sentence = explain_at_key(text, key, keys, parser)
        if sentence:
            return sentence
    return f"{_first_reason(lines)}; see `flrun fit --help`."


def root_cause(err: BaseException, parser: Any = None) -> str:
    """The message of the first ConfigError in an exception chain, else a readable jsonargparse message."""
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, ConfigError):
            return str(seen)
        seen = seen.__cause__ or seen.__context__
    return readable(str(err), parser)


def _unknown_argument(text: str, keys: list[str], parser: Any) -> str | None:
    match = re.search(r"unrecognized arguments: (.+)", text)
    if not match:
        return None
    token = match.group(1).split()[0]
    if not token.startswith("-"):
        return (
            f"unexpected argument {token!r}; options start with --: give a recipe with --config, "
            f"e.g. --config {EXAMPLE_RECIPE}."
        )
    option = token.partition("=")[0]
    options = [o for o in _option_strings(parser) if not o.endswith((".help", "+"))]
    return f"unknown option {option}{_did_you_mean(option, options)}; see `flrun fit --help` for the options."


def _unknown_key(text: str, keys: list[str], parser: Any) -> str | None:
    """A recipe key the schema does not have, at the top level or inside a group such as ``training``."""
    match = re.search(r"Group '([^']+)' does not accept (?:nested key|option) '([^']+)'", text) or re.search(
        r"^(?:Option|Key) '([^']+)' is not (?:accepted|expected)()", text
    )
    if not match or "class_path" in text:
        return None
    group, name = (match.group(1), match.group(2)) if match.group(2) else ("", match.group(1))
    full = f"{group}.{name}" if group else name
    known = [o[2:] for o in _option_strings(parser) if o.startswith("--") and not o.endswith((".help", "+"))]
    siblings = [k for k in known if k.rpartition(".")[0] == group] if group else [k for k in known if "." not in k]
    hint = _did_you_mean(full, siblings, quote=True)
    return f"unknown key {full!r} in the recipe{hint}; check its spelling against `flrun fit --help`."


def _unknown_init_option(text: str, keys: list[str], parser: Any) -> str | None:
    """An ``init_args`` key (or ``--key.init_args.x``) that the named class does not take."""
    match = re.search(
        r"Problem with given class_path '([^']+)': (?:Option|Key) '([^']+)' is not (?:accepted|expected)", text
    ) or re.search(r"Problem with given class_path '([^']+)': Group '[^']*' does not accept \w+ '([^']+)'", text)
    # a class behind a callable type (training.optimizer: Callable[[Iterable], Optimizer]): the code gives the
    # callable's argument (an optimizer's params), so it is no option of the recipe's
    behind_callable = re.search(
        r"callable class: (?:Option|Key) '([^']+)' is not (?:accepted|expected)\. "
        r"Got value: Namespace\(class_path='([^']+)'",
        text,
    )
    if match:
        class_path, option = match.groups()
    elif behind_callable:
        class_path, option = behind_callable.group(2, 1)
    else:
        return None
    params = _init_params(class_path)[0 if match else 1 :]
    hint = _did_you_mean(option, params, quote=True)
    where = f" ({'.'.join(keys)})" if keys else ""
    takes = f"; its options: {', '.join(params)}" if params else ""
    if len(keys) == 1:  # jsonargparse documents a top-level component's options with --key.help CLASS
        takes += f" (see `flrun fit --{keys[0]}.help {class_path}`)"
    return f"{class_path}{where} has no option {option!r}{hint}{takes}."


def _missing_required(text: str, keys: list[str], parser: Any) -> str | None:
    match = re.search(r"the following arguments are required: (.+)", text)
    if not match:
        return None
    return (
        f"no {match.group(1).rstrip('.')} given; pass a recipe that sets them with --config, "
        f"e.g. --config {EXAMPLE_RECIPE}."
    )


def _unknown_class(text: str, key: str, keys: list[str], parser: Any) -> str | None:
    """A component named by a short name or class_path that is unknown or of the wrong kind."""
    short = re.search(r"Expected a dot import path string: (\S+)", text)
    path = re.search(r"Problem with given class_path '([^']+)': (No module named '[^']+')", text)
    no_attr = re.search(r"(module '([\w.]+)' has no attribute '(\w+)')", text)
    wrong_kind = re.search(r"Import path ([\w.]+) does not correspond to a subclass of (\w+)", text)
    if not (short or path or no_attr or wrong_kind):
        return None
    innermost = (re.findall(r"Subtypes: \[([^\]]*)\]", text) or [""])[-1]
    if short and re.search(r"<class '(float|int|str|bool)'>", innermost):
        return None  # a plain value (lr: fast) that could also have been a class: a bad value, not a bad class
    base = _base_class(text, keys, parser)
    names = _subclass_names(base) if base is not None else []
    kind = base.__name__ if base is not None else "component"
    where = f" for {key}" if key else ""
    if short:
        given, reason = short.group(1), f"unknown {kind} {short.group(1)!r}"
    elif wrong_kind:
        given, reason = wrong_kind.group(1), f"{wrong_kind.group(1)} is not a {wrong_kind.group(2)}"
    elif no_attr:
        given = f"{no_attr.group(2)}.{no_attr.group(3)}"
        reason = f"class_path {given!r} cannot be imported ({no_attr.group(1)})"
        names = names or _public_names(no_attr.group(2))
    else:
        assert path is not None, "one of the four matched"
        given, reason = path.group(1), f"class_path {path.group(1)!r} cannot be imported ({path.group(2)})"
    hint = _did_you_mean(given.rpartition(".")[2], names)
    available = f"; available: {', '.join(names)}" if names and len(names) <= 40 else ""
    return f"{reason}{where}{hint}{available} (or give the dotted class_path of your own {kind})."


def _init_args_not_mapping(text: str, key: str, keys: list[str], parser: Any) -> str | None:
    """``init_args: [0.1]``: a class's options given as a list (or a value), not a mapping of names."""
    kind = re.search(r"'(\w+)' object has no attribute 'keys'", text)
    class_path = re.findall(r"class_path[ =]'([^']+)'", text)
    if not (kind and class_path):
        return None
    behind_callable = "callable class" in text  # an optimizer: the code gives its first argument (params)
    params = _init_params(class_path[-1])[1 if behind_callable else 0 :]
    example = f"init_args: {{{params[0]}: ...}}" if params else "init_args: {name: value}"
    takes = f" (its options: {', '.join(params)})" if params else ""
    return (
        f"{key or 'a component'}.init_args must be a mapping of option names to values, not a {kind.group(1)}; "
        f"give e.g. {example}{takes}."
    )


def _untrusted_class(text: str, key: str, keys: list[str], parser: Any) -> str | None:
    """A class path outside the trusted modules, refused by jsonargparse's import policy before its import."""
    denied = re.search(r"Importing '([\w.]+)' is not allowed", text)
    if not denied:
        return None
    path = denied.group(1)
    module = path.rpartition(".")[0]
    where = f" for {key}" if key else ""
    return (
        f"class_path {path!r}{where} is not in a trusted module (fl_lightning, torch.optim or one named in "
        f"FLRUN_TRUSTED_MODULES), so it was not imported: importing a module runs its code; if you trust it, set "
        f"FLRUN_TRUSTED_MODULES={module}."
    )


def _dotted_mapping(text: str, key: str, keys: list[str], parser: Any) -> str | None:
    """A mapping option given one key at a time (``--models.global.args.width 0.5``), which jsonargparse passes
    on as a Namespace instead of merging it into the mapping: name the option and show the mapping to give."""
    match = re.search(r"Expected a <class 'dict'>\. Got value: Namespace\((.*?)\)(?: - |$)", text)
    if not match or not keys:
        return None
    argv = list(getattr(parser, "args", None) or [])
    given: dict[str, dict[str, str]] = {}
    for i, arg in enumerate(argv):
        found = _typed_option(keys, r"\.(\w+)(?:=(.*))?$").match(arg)
        if found:
            value = found.group(3) if found.group(3) is not None else (argv[i + 1] if i + 1 < len(argv) else "")
            given.setdefault(found.group(1), {})[found.group(2)] = value
    option, pairs = next(iter(given.items()), (key, {}))
    if not pairs:  # not typed here (a sweep's trial): the keys jsonargparse reports
        pairs = {k: v.strip("'") for k, v in re.findall(r"(\w+)=('(?:[^'\\]|\\.)*'|[^,]+)", match.group(1))}
    mapping = "{" + ", ".join(f"{name}: {value}" for name, value in pairs.items()) + "}"
    return f"{option} takes a mapping, not one key at a time: give --{option} '{mapping}' (or set it in the recipe)."


def _typed_option(keys: list[str], tail: str) -> re.Pattern:
    """``--<first key>[.<middle>...].<last key><tail>``: jsonargparse's error names ``models`` and ``args`` but
    not the role between them (``models.global.args``), which the option as typed has."""
    return re.compile(rf"--({re.escape(keys[0])}(?:\.[\w-]+)*\.{re.escape(keys[-1])}){tail}")


def _typed_key(key: str, keys: list[str], parser: Any) -> str:
    """``key`` with the middle part the user typed (``models.global.args`` for ``models.args``), if typed."""
    if len(keys) < 2:
        return key
    pattern = _typed_option(keys, r"(?:=|$)")
    typed = [m.group(1) for m in (pattern.match(arg) for arg in getattr(parser, "args", None) or []) if m]
    return typed[0] if typed else key


def _bad_value(text: str, key: str, keys: list[str], parser: Any) -> str | None:
    literal = re.search(r"Expected a typing\.Literal\[(.*?)\]\. Got value: (\S+)", text)
    if literal:
        choices = ", ".join(c.strip().strip("'\"") for c in literal.group(1).split(","))
        return f"bad value {literal.group(2)!r} for {key}: use one of {choices}."
    # the innermost "Given value" is the one the user wrote (outer ones repeat the enclosing mapping)
    given = re.search(r"Given value: (.*?)(?:\. Got value| - |$)", text) or re.search(
        r"Got value: (.*?)(?: - |$)", text
    )
    expected = [t for t in re.findall(r"Expected a <class '([\w.]+)'>", text) if t != "NoneType"]
    if not (given and expected):
        return None
    value = clip(given.group(1).strip())
    key = _typed_key(key, keys, parser)
    kinds = " or ".join(dict.fromkeys({"dict": "a mapping (key: value)"}.get(t, t) for t in expected))
    return f"bad value {value!r} for {key or 'an option'}: expected {kinds}; fix it in the recipe or the command line."


# ---------------------------------------------------------------------------------------------- helpers
def _did_you_mean(given: str, candidates: list[str], quote: bool = False) -> str:
    """`` (did you mean X?)`` for the closest candidate, compared without the leading dashes."""
    bare = {candidate.lstrip("-"): candidate for candidate in candidates}
    close = difflib.get_close_matches(given.lstrip("-"), list(bare), n=1, cutoff=0.6)
    if not close:
        return ""
    match = bare[close[0]]
    return f" (did you mean {match!r}?)" if quote else f" (did you mean {match}?)"


def _option_strings(parser: Any) -> list[str]:
    if parser is None:
        return []
    return [option for action in parser._actions for option in action.option_strings]


def _base_class(text: str, keys: list[str], parser: Any) -> type | None:
    """The class a key's value must subclass: from jsonargparse's ``Subtypes`` list or the parser's type hint."""
    subtypes = re.findall(r"Subtypes: \[([^\]]*)\]", text)
    for listing in reversed(subtypes):  # the innermost union is the one the bad value was checked against
        for class_path in re.findall(r"<class '([\w.]+)'>", listing):
            cls = _import(class_path)
            if isinstance(cls, type) and cls is not type(None):
                return cls
    if parser is None or not keys:
        return None
    action = parser._option_string_actions.get(f"--{keys[0]}")
    return _first_class(getattr(action, "_typehint", None))


def _first_class(hint: Any) -> type | None:
    """The first class in a type hint; for a callable (``Callable[[Iterable], Optimizer]``) its return type."""
    if isinstance(hint, type) and hint.__module__ != "builtins":
        return hint
    args = typing.get_args(hint)
    if typing.get_origin(hint) is collections.abc.Callable and args:
        return _first_class(args[-1])
    for arg in args:
        found = _first_class(arg)
        if found is not None:
            return found
    return None


def _subclass_names(base: type) -> list[str]:
    """Names a recipe can use for subclasses of ``base``: short names for ours, dotted paths otherwise."""
    found: dict[str, None] = {}
    stack: list[type] = list(base.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__name__.startswith("_") or "LazyInstance" in cls.__name__:  # jsonargparse's lazy_instance wrappers
            continue
        if inspect.isabstract(cls):  # a base for methods (CodistillationPools), not one a recipe can name
            continue
        ours = cls.__module__.startswith(("fl_lightning", "torch.optim"))
        found[cls.__name__ if ours else f"{cls.__module__}.{cls.__qualname__}"] = None
    return sorted(found, key=str.lower)


def _public_names(module_name: str) -> list[str]:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return []
    return [n for n in dir(module) if not n.startswith("_") and isinstance(getattr(module, n, None), type)]


def _import(class_path: str) -> Any:
    module_name, _, name = class_path.rpartition(".")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError):
        return None


def _init_params(class_path: str) -> list[str]:
    """Keyword options of a class, following ``**kwargs`` up the base classes as jsonargparse does."""
    cls = _import(class_path)
    params: list[str] = []
    for klass in inspect.getmro(cls) if isinstance(cls, type) else ():
        if "__init__" not in vars(klass) or klass is object:
            continue
        signature = inspect.signature(vars(klass)["__init__"])  # its own (checked above), not an instance's
        params += [p.name for p in signature.parameters.values() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
            break
    return [p for p in dict.fromkeys(params) if p != "self"]


def _first_reason(lines: list[str]) -> str:
    interesting = [
        line
        for line in lines
        if not line.startswith("- ") and "expect one of" not in line and not line.startswith("Given value type")
    ]
    reason = interesting[-1] if interesting else (lines[0] if lines else "invalid configuration")
    return reason.rstrip(".")[:300]
