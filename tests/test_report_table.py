"""flrun report --table: a paper table rebuilt from real tiny digits runs whose reference blocks name paper
001's Table 5 (and Table 4) cells; cells, 'not run', the same-experiment recipes, ranking lines, escaping."""

import json
import shutil
import subprocess

import pytest
from conftest import fit_recipe, read_summary, run_cli
from test_report import Page

PAPER = "paper-001 (Lim et al., on-device KD)"


def _reference(table, column, metric, value, row="CIFAR-10"):
    return json.dumps({"paper": PAPER, "table": table, "row": row, "column": column, "metrics": {metric: value}})


def _fit(recipe, seed, out, reference):
    """Two rounds of ``recipe`` at ``seed`` into ``out``, measuring the table cell ``reference``."""
    fit_recipe(out, recipe, "--seed", str(seed), "--rounds", "2", "--eval_every", "1", "--reference", reference)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four real runs: FedAvg as Table 5's cell (seed 0) and as Table 4's weak-only, the same experiment
    (seed 1), the proposed method and DS-FL; plus a copy of the first, the same seed again."""
    root = tmp_path_factory.mktemp("table") / "runs"
    _fit("digits_weak_only", 0, root / "fedavg/seed0", _reference("Table 5", "FedAvg (homo)", "aux/test_acc", 0.5747))
    _fit("digits_weak_only", 1, root / "weak_only/seed1", _reference("Table 4", "Weak-only", "aux/test_acc", 0.5747))
    _fit("digits_ondevice_kd", 0, root / "kd/seed0", _reference("Table 5", "Proposed (hetero)", "target/test_acc", 0.6))
    # a run measures a cell with the metrics its own reference names: here DS-FL's mean over all clients
    dsfl = _reference("Table 5", "DS-FL (hetero)", "personal/test_acc", 0.2)
    _fit("digits_dsfl", 0, root / "dsfl/seed0", dsfl)
    shutil.copytree(root / "fedavg/seed0", root / "zz_copy/seed0")
    return root


def _final(runs, path, metric):
    return read_summary(runs / path)["final"][metric]


def _pct(value):
    return f"{100 * value:.2f}"


def test_paper_001_table_5_shows_paper_and_measured_cells_and_the_ranking(runs, tmp_path):
    out = tmp_path / "table5.html"
    assert run_cli("report", str(runs), "--table", "paper-001/table-5", "--output", str(out)) == 0
    page = Page(out.read_text())
    # columns: the methods, by their mean rank in the paper (DS-FL lowest, Proposed highest); rows: data sets
    assert page.rows[0] == [
        "DS-FL (hetero)",
        "FedGEM (hetero)",
        "FedAvg (homo)",
        "MOON (homo)",
        "FedDF (homo)",
        "FedMD (hetero)",
        "Proposed (hetero)",
    ]
    fedavg = [_final(runs, "fedavg/seed0", "aux/test_acc"), _final(runs, "weak_only/seed1", "aux/test_acc")]
    kd = _final(runs, "kd/seed0", "target/test_acc")
    dsfl = _final(runs, "dsfl/seed0", "personal/test_acc")
    assert dsfl != _final(runs, "dsfl/seed0", "personal/strong/test_acc")  # the run's metric, not the recipe's
    mean, std = sum(fedavg) / 2, abs(fedavg[0] - fedavg[1]) / 2**0.5  # the sample std of two values
    assert page.rows[1] == [
        "CIFAR-10",
        "paper 25.95 ± 0.10",
        f"ours {_pct(dsfl)} (n=1)",
        "paper 34.27 ± 0.10",
        "not run",
        "fedgems_cifar10.yaml",
        "paper 57.47 ± 0.80",
        f"ours {_pct(mean)} ± {_pct(std)} (n=2)",  # seed 1 ran as Table 4's weak-only: the same experiment
        "paper 58.38 ± 0.10",
        "not run",
        "moon_cifar10.yaml",
        "paper 41.62 ± 0.10",
        "not run",
        "feddf_cifar10.yaml",
        "paper 61.13 ± 0.10",
        "not run",
        "fedmd_cifar10.yaml",
        "paper 62.43 ± 0.10",  # the recipe's number, not the run's own reference (0.6)
        f"ours {_pct(kd)} (n=1)",
    ]
    speech = page.rows[3]
    assert speech[:4] == ["Google Speech", "paper 19.14 ± 0.10", "not run", "dsfl_speech.yaml"]
    moon = speech.index("moon_speech.yaml")  # MOON is not run on audio in the paper: a cell without its number
    assert speech[moon - 2 : moon] == ["paper –", "not run"] and "no recipe" not in speech
    assert page.rows[4][0] == "ranking in our runs"
    best = int(kd > max(mean, dsfl))
    assert page.rows[4][7] == (
        f"best in the paper in 3 of 3 rows, in our runs in {best} of 1 measured (2 not run yet); "
        f"pairwise order as in the paper: {int(kd > mean) + int(kd > dsfl)} of 2"
    )
    assert page.rows[4][3] == f"pairwise order as in the paper: {int(mean > dsfl) + int(mean < kd)} of 2"
    assert page.rows[4][1] == f"pairwise order as in the paper: {int(dsfl < mean) + int(dsfl < kd)} of 2"
    assert page.rows[4][2] == "nothing to compare yet"
    assert "paper-001/table-5: 21 cells, 3 with runs, 4 runs." in page.cells
    assert "0 (same seed again, not counted)" in page.cells  # the copied run


def test_markdown_table_has_the_same_cells(runs, tmp_path):
    out = tmp_path / "table5.md"
    assert run_cli("report", str(runs), "--table", "paper-001/table-5", "--output", str(out)) == 0
    text = out.read_text()
    kd = _final(runs, "kd/seed0", "target/test_acc")
    assert text.startswith(f"# {PAPER}, Table 5\n")
    row = next(line for line in text.splitlines() if line.startswith("| **CIFAR-10** |"))
    assert f"paper 62.43 ± 0.10<br>ours {_pct(kd)} (n=1) |" in row
    assert "| paper 41.62 ± 0.10<br>not run<br>feddf_cifar10.yaml |" in row


def test_cells_and_labels_from_files_are_escaped(runs, tmp_path):
    evil = "<script>alert(1)</script>"
    copy = tmp_path / "runs" / "evil"
    shutil.copytree(runs / "kd/seed0", copy)
    summary = read_summary(copy)
    summary["reference"] = {"paper": PAPER, "table": "Table 5", "row": evil, "column": evil, "metrics": {evil: 0.5}}
    summary["name"] = evil
    (copy / "summary.json").write_text(json.dumps(summary))
    html_out, md_out = tmp_path / "t.html", tmp_path / "t.md"
    for out in (html_out, md_out):
        assert run_cli("report", str(tmp_path / "runs"), "--table", "paper-001/table-5", "--output", str(out)) == 0
    page = Page(html_out.read_text())
    assert "script" not in page.tags and evil in page.cells  # shown as text, a row and a column of its own
    assert "<script>" not in md_out.read_text() and "&lt;script&gt;" in md_out.read_text()


def test_an_unknown_table_lists_the_known_ones(runs, tmp_path, capsys):
    assert run_cli("report", str(runs), "--table", "paper-001/table-9", "--output", str(tmp_path / "t.html")) == 2
    err = capsys.readouterr().err
    assert "no recipe or run names the table 'paper-001/table-9'" in err and "paper-001/table-5" in err
    assert "paper-004/table-3" in err and "paper-000/sec-v-c" in err
    assert run_cli("report", str(runs), "--table", "paper-001/table-5", "--wandb") == 2
    assert "leave out --wandb" in capsys.readouterr().err
    assert run_cli("report", str(runs), "--table", "paper-001/table-5", "--recipes", str(tmp_path / "nope")) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_table_ids_slug_the_paper_and_table_labels():
    from fl_lightning.report.tables import table_id

    assert table_id({"paper": PAPER, "table": "Table 5"}) == "paper-001/table-5"
    assert table_id({"paper": "paper-000 (Chan & Ngai, FedHe)", "table": "Sec. V-C (text; Fig. 3-4)"}) == (
        "paper-000/sec-v-c"
    )
    assert table_id({"paper": "", "table": "Table 1"}) is None


def _cell(method, setting, paper, mean):
    value = {"metric": "m/test_acc", "paper": paper, "paper_std": None, "mean": mean, "std": None, "n": 1}
    return {"key": ("p", "t", method, setting), "values": [value]}


def test_ranking_counts_first_places_and_pairwise_orders_by_hand():
    from fl_lightning.report.tables import ranking

    cells = [
        _cell("A", "s1", 0.9, 0.8),  # A is the paper's best in s1 and s2, ours only in s1
        _cell("B", "s1", 0.7, 0.6),
        _cell("C", "s1", 0.5, 0.7),  # C above B in our runs, below in the paper
        _cell("A", "s2", 0.9, 0.5),
        _cell("B", "s2", 0.8, 0.6),
        _cell("C", "s2", None, 0.9),  # the paper prints no number: counts against A's first place only
        _cell("A", "s3", 0.9, None),  # not run
        _cell("B", "s3", 0.6, 0.4),
    ]
    lines = ranking(cells, "row")
    # A: first in s1, s2, s3 in the paper; ours: s1 yes (0.8 > 0.6, 0.7), s2 no (0.9 from C), s3 not run.
    # pairs with numbers on both sides: s1 A-B, A-C, s2 A-B: held 2 (s2: 0.5 < 0.6 flips)
    assert lines["A"] == (
        "best in the paper in 3 of 3 columns, in our runs in 1 of 2 measured (1 not run yet); "
        "pairwise order as in the paper: 2 of 3"
    )
    # B: pairs s1 B-A (held), B-C (flipped), s2 B-A (flipped)
    assert lines["B"] == "pairwise order as in the paper: 1 of 3"
    assert lines["C"] == "pairwise order as in the paper: 1 of 2"


@pytest.mark.skipif(shutil.which("chromium") is None, reason="needs headless Chromium")
def test_a_real_browser_builds_the_table(runs, tmp_path):
    out = tmp_path / "table5.html"
    assert run_cli("report", str(runs), "--table", "paper-001/table-5", "--output", str(out)) == 0
    browser = [
        "chromium",
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--dump-dom",
        out.as_uri(),
    ]
    dom = subprocess.run(browser, capture_output=True, text=True, timeout=120, check=True).stdout
    page = Page(dom)  # the document as Chromium parsed it
    assert page.rows[0][0] == "DS-FL (hetero)" and page.rows[1][0] == "CIFAR-10" and len(page.rows[1]) == 19


def test_a_cell_never_averages_two_recipes_and_says_which_runs_it_left_out(runs, tmp_path, capsys):
    import yaml

    mixed = tmp_path / "runs"
    shutil.copytree(runs, mixed)
    smoke = mixed / "smoke/seed2"  # FedAvg's cell again, but a 1-round smoke test of another recipe
    shutil.copytree(runs / "fedavg/seed0", smoke)
    config = yaml.safe_load((smoke / "config.yaml").read_text())
    config["rounds"], config["seed"] = 1, 2
    (smoke / "config.yaml").write_text(yaml.safe_dump(config))
    summary = read_summary(smoke)
    summary["seed"], summary["final"]["aux/test_acc"] = 2, 0.0
    (smoke / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "table5.md"
    capsys.readouterr()
    assert run_cli("report", str(mixed), "--table", "paper-001/table-5", "--output", str(out)) == 0
    err = capsys.readouterr().err
    assert "cell CIFAR-10, FedAvg (homo): its runs ran 2 different recipes (they differ in rounds)" in err
    assert f"left out: {smoke}." in err and "Warning:" in out.read_text()
    reference = tmp_path / "reference.md"
    assert run_cli("report", str(runs), "--table", "paper-001/table-5", "--output", str(reference)) == 0

    def grid(path):
        return [line for line in path.read_text().split("## Runs")[0].splitlines() if line.startswith("|")]

    # every cell shows what it showed without the smoke run (its 0.0 accuracy is not averaged in)
    assert grid(out) == grid(reference)


def test_flrun_table_refuses_an_output_it_would_not_write(tmp_path, capsys):
    assert (
        run_cli("table", "paper-001/table-5", "--runs", str(tmp_path / "runs"), "--output", str(tmp_path / "t.pdf"))
        == 2
    )
    assert "must end in .html or .md" in capsys.readouterr().err and not (tmp_path / "runs").exists()
