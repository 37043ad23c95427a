"""YAML a user hands over, read in bounded time and memory: the one loader of recipes and their ``base:`` files,
of ``flrun fit``'s ``--config`` check, of sweep files, of the config.yaml that ``flrun report`` reads back, and of
jsonargparse itself (:func:`use_for_jsonargparse`: the files and option values it parses).

PyYAML alone lets a 1 KB file grow to gigabytes through aliases (ten levels of ten ``*a`` are 10^10 values once
something walks them), recurse until Python's stack ends on deep nesting, and keeps the last of two equal keys
without a word. Here, before anything walks the document:

- aliases are counted, never expanded: a document whose aliases stand for more than :data:`MAX_ALIAS_NODES`
  values beyond those written out is refused, and so is one that refers to itself;
- nesting deeper than :data:`MAX_DEPTH` is refused while it is read;
- a key given twice in one mapping is refused, naming both lines (a ``<<`` merge may still override keys);
- a file is read only when it is a regular file of at most :data:`MAX_BYTES` of UTF-8 text: a directory, a FIFO
  (whose reading would block), a symbolic-link loop or a URL is named as such;
- no message quotes more than :data:`QUOTE` characters of the input.

Scalars resolve as jsonargparse resolves them (``1e-3`` is a float, dates stay strings), so a file means the same
here as in ``flrun fit``. Nothing here imports torch: an error must come as fast as ``--help``.
"""

from __future__ import annotations

import copy
import functools
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from ..federation.errors import ConfigError
from ..federation.files import not_utf8, path_problem

MAX_BYTES = 4 * 2**20  # recipes and sweep files are a few KB; a resolved config.yaml tens of KB
MAX_DEPTH = 100  # recipes nest 6 levels deep
MAX_ALIAS_NODES = 10_000  # values an alias may stand for, over the whole document
QUOTE = 160  # characters of input a message may quote


class _Refused(yaml.YAMLError):
    """A document this loader will not build; ``str`` is the rest of a sentence (``what`` + this)."""


if TYPE_CHECKING:  # the mixin meets a parser and a constructor in its loaders
    from yaml import SafeLoader as _Composer
else:
    from yaml.composer import Composer as _Composer


class _Checks(_Composer):
    """What this module adds to PyYAML's composer: a depth bound, duplicate keys refused, aliases counted."""

    _depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Refused(
                    f"nests deeper than {MAX_DEPTH} levels (at line {mark.line + 1}); no recipe needs more than a few, "
                    "so flatten it"
                )
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def compose_mapping_node(self, anchor):
        node = super().compose_mapping_node(anchor)
        lines: dict[Any, int] = {}
        for key_node, _ in node.value:
            if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key, line = self.construct_object(key_node), key_node.start_mark.line + 1
            if key in lines:
                where = f"lines {lines[key]} and {line}" if lines[key] != line else f"both on line {line}"
                raise _Refused(
                    f"gives the key {clip(repr(key), 60)} twice ({where}); the second would silently replace the "
                    "first, so remove one of them"
                )
            lines[key] = line
        return node

    def compose_document(self):
        node = super().compose_document()
        check_aliases(node)
        return node


class _Loader(_Checks, yaml.SafeLoader):
    """PyYAML's safe loader, all in Python, with jsonargparse's scalars and the checks of :class:`_Checks`: it
    reads a document that :class:`_FastLoader` refused again, for PyYAML's own wording of the problem."""


if yaml.__with_libyaml__:

    class _FastLoader(
        _Checks,
        yaml.cyaml.CParser,
        yaml.constructor.SafeConstructor,
        yaml.resolver.Resolver,
    ):
        """:class:`_Loader`'s composer, checks, constructor and scalars over libyaml's scanner and parser: a recipe
        read several times faster (``flrun table`` reads every recipe)."""

        def __init__(self, stream: str):
            yaml.cyaml.CParser.__init__(self, stream)
            yaml.constructor.SafeConstructor.__init__(self)
            yaml.resolver.Resolver.__init__(self)
            yaml.composer.Composer.__init__(self)

else:  # a PyYAML built without libyaml
    _FastLoader = _Loader  # type: ignore[misc]


# the scalars of jsonargparse's loader: YAML 1.1's floats need a dot (1e-3 would be a string) and dates stay strings
_Loader.yaml_implicit_resolvers = {
    first: [
        (tag, regexp)
        for tag, regexp in resolvers
        if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")
    ]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+][0-9]+)?
        |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.VERBOSE,
    ),
    list("-+0123456789."),
)


_FastLoader.yaml_implicit_resolvers = _Loader.yaml_implicit_resolvers


def check_aliases(root: yaml.Node) -> None:
    """Refuses a node graph whose aliases stand for more than :data:`MAX_ALIAS_NODES` values, or for themselves.

    Each node is visited once (aliases share the node they name), so the count costs the file's size, not the
    expansion's.
    """
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        children = _children(node)
        if children_done:
            open_nodes.discard(key)
            sizes[key] = 1 + sum(sizes[id(child)] for child in children)
            continue
        if key in sizes:
            continue
        if key in open_nodes:
            raise _Refused(f"holds an alias inside the value it names (line {node.start_mark.line + 1}); remove it")
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in children if id(child) not in sizes)
    through_aliases = sizes[id(root)] - len(sizes)
    if through_aliases > MAX_ALIAS_NODES:
        raise _Refused(
            f"uses aliases (*name) that stand for {through_aliases:,} values, more than the {MAX_ALIAS_NODES:,} "
            "allowed; write the values out or use fewer aliases"
        )


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    return []


# ---------------------------------------------------------------------------------------------- text and files
@functools.lru_cache(maxsize=16)
def _parsed(text: str) -> Any:
    try:
        return yaml.load(text, Loader=_FastLoader)
    except _Refused:
        raise
    except yaml.YAMLError:  # read again in Python, whose messages the errors quote (and tests know)
        return yaml.load(text, Loader=_Loader)


def _load(text: str) -> Any:
    """The document in ``text``: parsed once per process (a recipe is read by the check, the ``base:`` walk and
    jsonargparse), a copy each time (callers may change what they get)."""
    return copy.deepcopy(_parsed(text))


def load_text(text: str, what: str) -> Any:
    """The YAML document in ``text``; a ConfigError starting with ``what`` (e.g. ``recipe x.yaml``) if refused."""
    try:
        return _load(text)
    except _Refused as err:
        raise ConfigError(f"{what} {err}.") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} is not valid YAML: {yaml_problem(err)}.") from None
    except RecursionError:  # a construct deeper than the composer saw (never expected; a last guard)
        raise ConfigError(f"{what} nests too deeply to be read; flatten it.") from None


def read_file(path: str | Path, what: str, give: str) -> Any:
    """The YAML document in the file ``path``; ``what`` names it in messages, ``give`` says what to give instead
    (``a recipe, e.g. --config recipes/quickstart.yaml``)."""
    return load_text(read_text(path, what, give), what)


def read_text(path: str | Path, what: str, give: str) -> str:
    """The text of a YAML file, refused (one sentence) unless it is a regular file of UTF-8 text."""
    text = str(path)
    if "://" in text:
        raise ConfigError(f"{what} is a URL, and files are not downloaded; save it and give its path, or give {give}.")
    problem = path_problem(path)
    if problem is not None:
        shown = clip(what, 200).replace("\x00", "\\0")
        raise ConfigError(f"{shown} {problem}; give {give}.")
    size = os.stat(path).st_size
    if size > MAX_BYTES:
        raise ConfigError(f"{what} is {size:,} bytes, more than a YAML file here may be ({MAX_BYTES:,}); give {give}.")
    try:
        data = Path(path).read_bytes()[: MAX_BYTES + 1]
    except OSError as err:
        raise ConfigError(f"{what} cannot be read ({err.strerror}); check its permissions or give {give}.") from None
    binary = not_utf8(data)
    if binary is not None:
        raise ConfigError(f"{what} {binary.replace('a text file', 'a text (YAML) file')}; give {give}.")
    decoded = data.decode("utf-8-sig")
    return decoded


def yaml_problem(err: Exception) -> str:
    """``problem at line L, column C`` (1-based) and the fix, from PyYAML's multi-line message."""
    mark, start = getattr(err, "problem_mark", None), getattr(err, "context_mark", None)
    problem = clip(getattr(err, "problem", None) or str(err).splitlines()[0])
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    context = getattr(err, "context", None)
    if context and start is not None:  # an unclosed bracket is reported where the file ends: say where it opened
        where += f" ({clip(context, 60)} that starts at line {start.line + 1}, column {start.column + 1})"
    if "'\\t'" in problem:
        fix = "use spaces to indent, never tabs"
    elif "constructor for the tag" in problem:
        fix = "remove the tag (!!...): these files hold plain values only"
    else:
        fix = "check the indentation, colons, brackets and quotes there"
    return f"{problem}{where}; {fix}"


def clip(text: str, limit: int = QUOTE) -> str:
    """``text`` cut to ``limit`` characters (the cut marked with ``...``), for messages that quote input."""
    return text if len(text) <= limit else f"{text[: limit - 3]}..."


# ---------------------------------------------------------------------------------------------- jsonargparse
def jsonargparse_load(text: str) -> Any:
    """jsonargparse's ``yaml_load`` (same special cases) on this loader: option values and the files it reads."""
    try:
        value = _load(text)
    except _Refused as err:  # never taken for plain text, as jsonargparse takes a value that is not YAML
        raise ConfigError(f"the value {clip(repr(text), 60)} {err}.") from None
    if isinstance(value, dict) and value and all(v is None for v in value.values()):
        # jsonargparse's rule: "a" or "{a, b}" given as a value is the text itself, not a mapping of nulls
        if len(value) == 1 and text.strip() == f"{next(iter(value))}:":
            return text
        keys = set(text.strip(" {}").replace(" ", "").split(","))
        if keys and keys == set(value):
            return text
    return value


def use_for_jsonargparse() -> None:
    """Makes jsonargparse read YAML (config files, option values) with this loader."""
    from jsonargparse import set_loader

    set_loader("yaml", jsonargparse_load, exceptions=(yaml.YAMLError,))
