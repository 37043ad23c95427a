"""Every number the README and the tutorial quote is what its command prints today.

Each case runs the documented command on digits and checks that the document states the result, at the
precision it quotes, in the sentence that quotes it. A number appears in one place only: a change that
moves a result fails here until the sentence is rerun and updated.
"""

import json
import re

import pytest
from conftest import ROOT, run_cli

pytestmark = pytest.mark.slow

README = ROOT / "README.md"
TUTORIAL = ROOT / "docs" / "tutorial.md"


def _fit(tmp_path, name: str, recipe: str, *extra: str) -> dict:
    out = tmp_path / name
    args = ["fit", "--config", str(ROOT / "recipes" / recipe), "--output_dir", str(out), "--runtime.progress", "false"]
    assert run_cli(*args, *extra) == 0
    return json.loads((out / "summary.json").read_text())


def _quoted(path, pattern: str) -> list[str]:
    """The numbers ``pattern`` (a regular expression with groups around them) finds in ``path``."""
    match = re.search(pattern, " ".join(path.read_text().split()))  # sentences as they read, not as wrapped
    assert match, f"{path.name} no longer has the sentence {pattern!r}"
    return list(match.groups())


def test_the_readme_quotes_the_quickstart_of_three_seeds(tmp_path):
    from fl_lightning.tracking.progress import run_summary

    quoted = _quoted(README, r"\((\d\.\d{3}) on a CPU; (\d\.\d{3}) and (\d\.\d{3}) with `--seed 1` and `--seed 2`\)")
    summaries = [_fit(tmp_path, f"seed{seed}", "quickstart.yaml", "--seed", str(seed)) for seed in (0, 1, 2)]
    assert [f"{summary['final']['global/test_acc']:.3f}" for summary in summaries] == quoted
    # the end of the quickstart as docs/reference/cli.md shows it (the time aside)
    shown = (ROOT / "docs" / "reference" / "cli.md").read_text().split("\nquickstart seed 0: ", 1)[1].split("```")[0]
    printed = run_summary({**summaries[0], "output_dir": "runs/quickstart/seed0"}).split("\n", 1)[1]
    assert shown.split("\n", 1)[1] == printed + "\n"


def test_the_tutorial_quotes_what_its_commands_print(tmp_path):
    skewed = _fit(tmp_path, "alpha", "quickstart.yaml", "--data.init_args.partitioner.init_args.alpha", "0.1")
    assert _quoted(TUTORIAL, r"final test accuracy drops to (\d\.\d{3})") == [
        f"{skewed['final']['global/test_acc']:.3f}"
    ]

    kd = _fit(tmp_path, "kd", "digits_ondevice_kd.yaml")["final"]["target/test_acc"]
    alone = _fit(tmp_path, "alone", "digits_strong_only.yaml")["final"]["target/test_acc"]
    assert _quoted(
        TUTORIAL, r"target model reaches (\d\.\d{3}) with distillation .* and (\d\.\d{3}) when the four"
    ) == [
        f"{kd:.3f}",
        f"{alone:.3f}",
    ]

    sweep = tmp_path / "sweep"
    assert (
        run_cli("sweep", "--config", str(ROOT / "sweeps" / "digits_quickstart.yaml"), "--output_dir", str(sweep)) == 0
    )
    result = json.loads((sweep / "sweep.json").read_text())
    quoted = _quoted(TUTORIAL, r"\(validation accuracy (\d\.\d{4}); on the test set, (\d\.\d{4})\)")
    assert quoted == [f"{result['best_value']:.4f}", f"{result['best_test']['value']:.4f}"]
