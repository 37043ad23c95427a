"""CI runs the README's commands as written and in the README's order, so that what a new user does first
(install, the quickstart into its default folder, then the tests) is what CI checks; and the tests leave the
working directory's runs/ alone (the guard in conftest.py)."""

import re

from conftest import ROOT, runs_changes, runs_snapshot


def readme_commands(section: str, blocks: int = 1) -> list[str]:
    """The commands of the first ``blocks`` bash blocks of a README section, comments stripped."""
    text = (ROOT / "README.md").read_text()
    body = text.split(f"\n## {section}", 1)[1].split("\n## ", 1)[0]
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", body, flags=re.DOTALL)[:blocks]:
        lines = [line.split("  #", 1)[0].strip() for line in block.splitlines()]
        commands += [line for line in lines if line and not line.startswith("#")]
    return commands


def test_ci_runs_the_readme_commands_as_written_in_its_order():
    wanted = readme_commands("Install") + readme_commands("Quickstart")[:1] + readme_commands("Tests")
    assert wanted[:4] == [
        "python3 -m venv .venv",
        ". .venv/bin/activate",
        'pip install -e ".[dev]"',
        "flrun fit --config recipes/quickstart.yaml",
    ]
    assert "python -m pytest -q -n 2" in wanted
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    positions = [ci.index(command) if command in ci else None for command in wanted]
    assert None not in positions, [c for c, p in zip(wanted, positions) if p is None]
    assert positions == sorted(positions)
    # nothing else of the README's quickstart folder: it is the default one, which the tests must leave alone
    assert not [line for line in ci if line.startswith("flrun fit") and line != wanted[3]]


def test_ci_checks_lint_format_layers_and_types_before_the_suites():
    tests = readme_commands("Tests")
    checks = ["ruff check .", "ruff format --check .", "lint-imports", "mypy"]
    assert [c for c in tests if c in checks] == checks
    # a lint or type error fails CI in seconds, before the suites' many minutes (.ci/run runs with set -e)
    assert max(tests.index(c) for c in checks) < tests.index("python -m pytest -q -n 2")
    assert "set -euo pipefail" in (ROOT / ".ci" / "run").read_text()


def test_the_runs_guard_sees_a_folder_created_changed_or_removed(tmp_path):
    runs = tmp_path / "runs"
    assert runs_changes(runs_snapshot(runs), runs_snapshot(runs)) == []
    before = runs_snapshot(runs)
    (runs / "quickstart" / "seed0").mkdir(parents=True)
    assert runs_changes(before, runs_snapshot(runs)) == ["the folder was created"]
    (runs / "quickstart" / "seed0" / "summary.json").write_text("{}")
    before = runs_snapshot(runs)
    (runs / "quickstart" / "seed0" / "summary.json").write_text('{"rounds": 40}')
    assert runs_changes(before, runs_snapshot(runs)) == ["changed ['quickstart/seed0/summary.json']"]
    (runs / "other").mkdir()
    after = runs_snapshot(runs)
    assert runs_changes(before, after)[0] == "added ['other']"
