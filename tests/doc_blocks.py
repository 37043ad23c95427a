"""The code blocks of a Markdown page, in the page's order, and a runner that follows them as a user would.

Blocks come from ``mktestdocs.grab_code_blocks`` (one list per fence language, merged back into the page's
order). A user sits at the root of a clone, in one terminal:

- a ``bash`` block runs in ``bash -euo pipefail`` in the page's folder; the variables it exports carry over
  to the blocks after it, as in one terminal;
- a ``python`` block runs as ``python -c`` there, with that environment; a ``python`` or ``yaml`` block whose
  first line is a file name comment (``# my_data.py``, ``# sweeps/my_sweep.yaml``) is the file the page asks
  to save, and is saved there instead;
- other ``yaml`` and ``toml`` blocks are excerpts of files, not commands.

A command that cannot run here (a GPU, an account, the network) is named, with the reason, in the page's
``skipped`` list: it is replaced where it stands by ``:`` (a no-op that keeps a loop around it valid).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mktestdocs import grab_code_blocks

LANGUAGES = ("bash", "python", "yaml", "toml")
FILE_COMMENT = re.compile(r"# ([\w./-]+\.(?:py|yaml))\n")
BLOCK_TIMEOUT_S = 1800  # a page's slowest block (a sweep) takes minutes on a loaded 2-core machine


@dataclass(frozen=True)
class Block:
    language: str
    code: str

    @property
    def file_name(self) -> str | None:
        """The file a ``python`` / ``yaml`` block is to be saved as, from its first line; None for a command."""
        match = FILE_COMMENT.match(self.code)
        return match.group(1) if match and self.language in ("python", "yaml") else None

    @property
    def runs(self) -> bool:
        return self.language == "bash" or (self.language == "python" and self.file_name is None)


def page_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text`` in order; a language outside LANGUAGES fails (it would go unrun)."""
    queues = {language: grab_code_blocks(text, lang=language) for language in LANGUAGES}
    blocks = []
    for code in grab_code_blocks(text, lang=None):
        language = next((lang for lang, queue in queues.items() if queue and queue[0] == code), None)
        assert language is not None, f"a code block in a language the docs tests do not run: {code[:80]!r}"
        queues[language].pop(0)
        blocks.append(Block(language, code))
    return blocks


def logical_lines(code: str) -> list[tuple[int, int]]:
    """``(first, last)`` physical line of each logical line of a bash block (``\\`` continues a line)."""
    lines, spans, start = code.split("\n"), [], 0
    for i, line in enumerate(lines):
        if not line.endswith("\\"):
            spans.append((start, i))
            start = i + 1
    return spans


def command_words(text: str) -> list[str]:
    """A command's words as bash splits them, its comment dropped: two spellings of one command compare equal."""
    try:
        return shlex.split(text.replace("\\\n", " "), comments=True)
    except ValueError:  # an unfinished quote: a line of a multi-line construct; compared as written
        return text.split()


def commands(code: str) -> list[list[str]]:
    """The commands (as words) of a bash block, one per logical line, blank and comment lines left out."""
    lines = code.split("\n")
    words = [command_words("\n".join(lines[a : b + 1])) for a, b in logical_lines(code)]
    return [w for w in words if w]


def without_skipped(code: str, skipped: dict[str, str], stand_ins: dict[str, str] | None = None) -> str:
    """``code`` with each command named in ``skipped`` replaced by ``:`` and its reason, and each named in
    ``stand_ins`` by the command run in its place (the page's ``R`` as a digits recipe, 2 ranks for 4 GPUs)."""
    keys = {tuple(command_words(key)): reason for key, reason in skipped.items()}
    replaced = {tuple(command_words(key)): command for key, command in (stand_ins or {}).items()}
    lines, out = code.split("\n"), []
    for a, b in logical_lines(code):
        words = tuple(command_words("\n".join(lines[a : b + 1])))
        reason, stand_in = keys.get(words), replaced.get(words)
        indent = lines[a][: len(lines[a]) - len(lines[a].lstrip())]
        if stand_in is not None:
            out += [f"{indent}{stand_in}"]
        else:
            out += [f"{indent}:  # not run here: {reason}"] if reason else lines[a : b + 1]
    return "\n".join(out)


@dataclass
class Terminal:
    """One user's terminal in ``folder``: its environment, and everything printed so far."""

    folder: Path
    env: dict[str, str]
    log: list[str] = field(default_factory=list)

    @classmethod
    def open(cls, folder: Path) -> Terminal:
        env = {k: v for k, v in os.environ.items() if k not in ("FLRUN_TRUSTED_MODULES", "PYTEST_CURRENT_TEST")}
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # flrun, python
        env["WANDB_MODE"] = "offline"  # no W&B account here: every W&B run is an offline one
        return cls(folder, env)

    def bash(self, code: str, where: str) -> str:
        dump = self.folder / ".terminal-env"
        script = f"{code}\nenv -0 > {shlex.quote(str(dump))}\n"
        out = self._run(["bash", "-euo", "pipefail", "-c", script], where, code)
        self.env = dict(item.split("=", 1) for item in dump.read_text().split("\0") if "=" in item)
        dump.unlink()
        return out

    def python(self, code: str, where: str) -> str:
        return self._run(["python", "-c", code], where, code)

    def save(self, name: str, code: str) -> None:
        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)

    def _run(self, argv: list[str], where: str, code: str) -> str:
        done = subprocess.run(argv, cwd=self.folder, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, timeout=BLOCK_TIMEOUT_S)  # fmt: skip
        self.log.append(done.stdout)
        if done.returncode != 0:
            raise AssertionError(
                f"{where} failed with exit status {done.returncode}:\n{code}\n--- its output, last lines ---\n"
                + done.stdout[-4000:]
            )
        return done.stdout
