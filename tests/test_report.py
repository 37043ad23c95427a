"""flrun report: paper-vs-measured tables, plots and provenance from run directories."""

from html.parser import HTMLParser

import pytest

from conftest import read_summary, run_cli, write_recipe

REFERENCE = {
    "paper": "paper-001 (test)",
    "table": "Table 4",
    "column": "Proposed",
    "metric": "global/test_acc",
    "value": 0.9,
}


@pytest.fixture
def runs(tmp_path):
    recipe = write_recipe(tmp_path / "cell.yaml", reference=REFERENCE)
    for seed in (0, 1):
        assert (
            run_cli(
                "fit",
                "--config",
                str(recipe),
                "--seed",
                str(seed),
                "--output_dir",
                str(tmp_path / "runs" / f"seed{seed}"),
            )
            == 0
        )
    return tmp_path / "runs"


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.cells = 0, []

    def handle_starttag(self, tag, attrs):
        self.images += tag == "img" and dict(attrs).get("src", "").startswith("data:image/png;base64,")

    def handle_data(self, data):
        self.cells.append(data.strip())


def test_html_report_compares_the_mean_over_seeds_with_the_paper(runs, tmp_path):
    assert run_cli("report", str(runs), "--output", str(tmp_path / "report.html")) == 0
    accs = [read_summary(runs / f"seed{s}")["final"]["global/test_acc"] for s in (0, 1)]
    parser = _Collector()
    parser.feed((tmp_path / "report.html").read_text())
    mean = sum(accs) / 2
    assert "cell" in parser.cells and "0.9000" in parser.cells and f"{mean:.4f}" in parser.cells
    assert f"{mean - 0.9:.4f}" in parser.cells
    assert parser.images >= 1  # the learning curve, embedded
    commit = read_summary(runs / "seed0")["versions"].get("git_commit", "n/a")[:12]
    assert commit in parser.cells


def test_markdown_report_writes_figures_and_wandb_logs_offline(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    assert run_cli("report", str(runs), "--output", "out/report.md", "--wandb") == 0
    text = (tmp_path / "out/report.md").read_text()
    assert "| cell | global/test_acc | 0.9000 |" in text
    assert (tmp_path / "out/report_figures/cell_curve.png").read_bytes()[:4] == b"\x89PNG"
    assert list((tmp_path / "out/wandb").glob("offline-run-*"))  # the W&B run beside the report


def test_wandb_run_gets_the_partition_chart(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    recipe = write_recipe(tmp_path / "r.yaml", rounds=1)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run"), "--logger", "wandb") == 0
    assert (tmp_path / "run/partition.png").read_bytes()[:4] == b"\x89PNG"
    media = list((tmp_path / "run/wandb").glob("offline-run-*/files/media/images/partition/*.png"))
    assert media, "the partition chart was not logged to W&B"


def test_report_without_runs_is_a_clear_error(tmp_path, capsys):
    assert run_cli("report", str(tmp_path), "--output", str(tmp_path / "r.html")) == 2
    assert "no run directory" in capsys.readouterr().err
