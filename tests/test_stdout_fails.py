"""A standard output that refuses writes (``> /dev/full``) is named as such, not as a file system error without a
file; a complete run whose summary cannot be printed says the run is complete, not to resume it."""

import os
import subprocess
import sys

import pytest
from conftest import ROOT, write_recipe

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")


def flrun_to_dev_full(*argv: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"}
    with open("/dev/full", "w") as full:
        return subprocess.run(
            [sys.executable, "-m", "fl_lightning", *argv], stdout=full, stderr=subprocess.PIPE, text=True,
            env=env, cwd=cwd, timeout=300,
        )  # fmt: skip


@pytest.mark.parametrize("argv", [["models"], ["--version"]], ids=["models", "version"])
def test_a_full_standard_output_is_named(argv, tmp_path):
    done = flrun_to_dev_full(*argv, cwd=tmp_path)
    prefix = "flrun models" if argv == ["models"] else "flrun"
    assert done.returncode == 2
    assert done.stderr == (
        f"{prefix}: error: could not write to the standard output (the disk it goes to is full); free space "
        "there, or send the output elsewhere.\n"
    )


def test_a_complete_run_whose_json_cannot_be_printed_is_not_told_to_resume(tmp_path):
    recipe = write_recipe(tmp_path / "recipe.yaml", rounds=1)
    out = tmp_path / "run"
    done = flrun_to_dev_full("fit", "--config", str(recipe), "--output_dir", str(out), "--json", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.splitlines()[-1] == (
        "flrun fit: error: could not write to the standard output (the disk it goes to is full); the run itself is "
        f"complete and {out / 'summary.json'} holds its summary."
    )
    assert "--resume" not in done.stderr and (out / "summary.json").is_file()
