"""Hostile or broken files and environments: nothing a user has is overwritten, and every case ends in one sentence
(exit status 2, or the signal's), in bounded time and memory, never a traceback or a silently wrong result.

The one-sentence cases that need no more than a file are rows of test_bad_inputs.py; these need a run, several
processes, a symbolic link, a FIFO or a check of what is on disk afterwards.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from conftest import ROOT, TINY, read_summary, run_cli, write_recipe

FAST = {"rounds": 4, "eval_every": 1}


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert len(lines[0]) < 700, lines[0][:300]  # no message quotes more than a few hundred characters of input
    return lines[0]


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (what must stay as it was)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _final(run: Path) -> dict:
    return read_summary(run)["final"]


# ---------------------------------------------------------------------------------------------- YAML
def _bomb(levels: int) -> str:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "anchors:\n" + "".join(f"  {line}\n" for line in lines)


PROBLEMS = {  # YAML lines added to a file, and what its message says
    "alias bomb": (_bomb(6), "aliases (*name) that stand for"),
    "deep nesting": ("deep: " + "[" * 100_000 + "]" * 100_000 + "\n", "nests deeper than 100 levels"),
    "key given twice": ("seed: 1\nseed: 2\n", "gives the key 'seed' twice"),
}


@pytest.mark.parametrize("where", ["recipe", "base file", "sweep file"])
@pytest.mark.parametrize("problem", PROBLEMS)
def test_hostile_yaml_is_one_sentence_wherever_it_is(tmp_path, capsys, where, problem):
    text, said = PROBLEMS[problem]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**TINY, "rounds": 1}) + (text if where == "recipe" else ""))
    if where == "base file":
        (tmp_path / "shared.yaml").write_text(text)
        recipe.write_text(f"base: shared.yaml\n{recipe.read_text()}")
    if where == "sweep file":
        sweep = tmp_path / "sweep.yaml"
        sweep.write_text(
            f"base: {recipe}\nmetric: global/test_acc\nparameters: {{seed: {{type: int, low: 0, high: 3}}}}\n{text}"
        )
        command = ["sweep", "--config", str(sweep), "--output_dir", str(tmp_path / "sweep")]
    else:
        command = ["fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")]
    assert run_cli(*command) == 2
    message = _one_line(capsys)
    assert said in message and ("shared.yaml" if where == "base file" else Path(command[2]).name) in message
    assert not (tmp_path / "run").exists()


def test_a_diamond_of_base_files_reads_each_file_once(tmp_path):
    for i in range(30):  # each file builds on the next one twice: 2^30 paths to the last file
        (tmp_path / f"d{i}.yaml").write_text(f"base: [d{i + 1}.yaml, d{i + 1}.yaml]\nk{i}: {i}\n")
    (tmp_path / "d30.yaml").write_text("rounds: 3\n")
    program = (
        "from fl_lightning.run.recipes import base_files, load_recipe; "
        f"r = load_recipe('{tmp_path}/d0.yaml'); print(len(r), len(base_files('{tmp_path}/d0.yaml')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=60, cwd=ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["31", "30"]  # k0..k29 and rounds; d1..d30


BASES = {  # what `base:` names, how to make it, what the message says
    "binary": ("model.ckpt", lambda p: p.write_bytes(bytes(range(256)) * 8), "is not a text (YAML) file"),
    "symlink loop": ("loop.yaml", lambda p: os.symlink(p.name, p), "symbolic link that leads back to itself"),
    "invalid YAML": ("broken.yaml", lambda p: p.write_text("rounds: [1, 2\n"), "is not valid YAML"),
    "python tag": (
        "tag.yaml",
        lambda p: p.write_text("rounds: !!python/object/apply:os.getpid []\n"),
        "remove the tag",
    ),
    "directory": ("shared", lambda p: p.mkdir(), "is a directory"),
    "URL": ("https://example.org/shared.yaml", lambda p: None, "is a URL"),
    "FIFO": ("pipe.yaml", lambda p: os.mkfifo(p), "is not a regular file"),
}


@pytest.mark.parametrize("kind", BASES)
def test_a_base_file_that_is_not_a_recipe_is_named_in_one_sentence(tmp_path, capsys, kind):
    name, make, said = BASES[kind]
    make(tmp_path / name)
    recipe = tmp_path / "variant.yaml"
    recipe.write_text(f"base: {name}\n" + yaml.safe_dump(TINY))
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")) == 2
    message = _one_line(capsys)
    assert said in message and name in message and "variant.yaml" in message


# ---------------------------------------------------------------------------------------------- class paths
def test_a_class_path_outside_the_trusted_modules_is_refused_before_its_module_is_imported(
    tmp_path, capsys, monkeypatch
):
    marker = tmp_path / "imported.txt"
    (tmp_path / "lab_strategies.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("FLRUN_TRUSTED_MODULES", raising=False)
    recipe = write_recipe(tmp_path / "r.yaml", **FAST)
    argv = ["fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run"), "--strategy", "lab_strategies.Nope"]
    try:
        assert run_cli(*argv) == 2
        message = _one_line(capsys)
        assert "not in a trusted module" in message and "FLRUN_TRUSTED_MODULES=lab_strategies" in message
        assert not marker.exists()
        monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "conftest,lab_strategies")
        assert run_cli(*argv) == 2  # trusted: imported, and the missing class named
        assert "has no attribute 'Nope'" in _one_line(capsys) and marker.exists()
    finally:
        sys.modules.pop("lab_strategies", None)
