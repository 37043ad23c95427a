"""Every method resumes exactly: a run stopped after round 2 and resumed equals an uninterrupted one.

Server state (banks, server optimizers, Velo's CVAE) is saved as plain tensors and containers, so this
also checks that each strategy's state survives the round trip through a checkpoint.
"""

import pytest
from conftest import ROOT, assert_resumed_equals, read_summary, run_cli

pytestmark = pytest.mark.slow  # two runs of every digits recipe (test_fit covers resume in the default suite)

DIGITS_RECIPES = sorted(p.stem for p in (ROOT / "recipes").glob("digits_*.yaml"))


@pytest.mark.parametrize("recipe", DIGITS_RECIPES)
def test_stopped_and_resumed_run_equals_the_uninterrupted_one(tmp_path, recipe):
    common = ["--config", str(ROOT / "recipes" / f"{recipe}.yaml"), "--rounds", "4", "--eval_every", "2"]
    common += ["--runtime.progress", "false"]
    assert run_cli("fit", *common, "--output_dir", str(tmp_path / "full")) == 0
    assert run_cli("fit", *common, "--output_dir", str(tmp_path / "cut"), "--stop_after", "2") == 0
    assert run_cli("fit", *common, "--output_dir", str(tmp_path / "cut"), "--resume", "auto") == 0
    assert read_summary(tmp_path / "full")["final"]
    assert_resumed_equals(tmp_path / "cut", tmp_path / "full")
