"""The argument parsers of ``flrun``'s commands other than ``fit`` (whose parser is generated from ``fit``'s
signature): an unknown, abbreviated or malformed option is refused in one sentence with exit status 2, as
``flrun fit`` refuses one, instead of being ignored or answered with a usage block."""

from __future__ import annotations

import argparse

from ..run.arguments import UserError


class CommandParser(argparse.ArgumentParser):
    """``argparse`` without abbreviations, whose errors are :class:`UserError` sentences (``--help`` unchanged)."""

    def __init__(self, prog: str, description: str, **kwargs):
        super().__init__(prog=prog, description=description, allow_abbrev=False, **kwargs)

    def parse_args(self, args=None, namespace=None):
        """Names an unknown option first, before argparse would report a missing argument instead."""
        for arg in args or []:
            if arg == "--":
                break
            option = arg.split("=", 1)[0]
            if option.startswith("-") and not option[1:2].isdigit() and option not in self._option_string_actions:
                self.error(f"unrecognized arguments: {option}")
        return super().parse_args(args, namespace)

    def error(self, message: str):
        unknown = message.removeprefix("unrecognized arguments: ")
        if unknown != message:
            words = unknown.split()
            kind = "option" if all(word.startswith("-") for word in words) else "argument"
            message = f"unknown {kind}{'s' * (len(words) > 1)} {unknown}"
        raise UserError(f"{message}; see `{self.prog} --help` for its options.")
