"""flrun report: paper-vs-measured tables, plots, provenance and sweep sections from run and sweep
directories; everything read from files is escaped."""

import csv
import json
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, read_summary, run_cli, write_recipe

REFERENCE = {
    "paper": "paper-001 (test)",
    "table": "Table 4",
    "column": "Proposed",
    "metrics": {"global/test_acc": 0.9},
    "stds": {"global/test_acc": 0.01},
}


def fit_seeds(tmp_path, seeds, name="cell", **recipe):
    path = write_recipe(tmp_path / f"{name}.yaml", reference=REFERENCE, **recipe)
    for seed in seeds:
        out = tmp_path / "runs" / name / f"seed{seed}"
        assert run_cli("fit", "--config", str(path), "--seed", str(seed), "--output_dir", str(out)) == 0
    return tmp_path / "runs"


@pytest.fixture
def runs(tmp_path):
    return fit_seeds(tmp_path, (0, 1))


REPORT_TAGS = {
    "html",
    "head",
    "meta",
    "title",
    "style",
    "body",
    "h1",
    "h2",
    "p",
    "table",
    "tr",
    "th",
    "td",
    "figure",
    "img",
    "figcaption",
    "code",
}


class Page(HTMLParser):
    """The tags, the embedded images and the text cells of an HTML report."""

    def __init__(self, text):
        super().__init__()
        self.tags, self.images, self.cells, self.rows = set(), 0, [], []
        self.in_row = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.add(tag)
        if tag == "tr":
            self.rows.append([])
            self.in_row = True
        self.images += tag == "img" and dict(attrs).get("src", "").startswith("data:image/png;base64,")

    def handle_endtag(self, tag):
        self.in_row = self.in_row and tag != "tr"

    def handle_data(self, data):
        if data.strip():
            self.cells.append(data.strip())
            if self.in_row:
                self.rows[-1].append(data.strip())


def report_page(paths, out):
    assert run_cli("report", *map(str, paths), "--output", str(out)) == 0
    return Page(out.read_text())


def test_html_report_compares_the_final_round_mean_over_seeds_with_the_paper(runs, tmp_path):
    page = report_page([runs], tmp_path / "report.html")
    finals = [read_summary(runs / "cell" / f"seed{s}")["final"]["global/test_acc"] for s in (0, 1)]
    bests = [read_summary(runs / "cell" / f"seed{s}")["best"]["global/test_acc"] for s in (0, 1)]
    rounds = [read_summary(runs / "cell" / f"seed{s}")["best_round"] for s in (0, 1)]
    mean = sum(finals) / 2
    std = abs(finals[0] - finals[1]) / 2**0.5  # the sample std of two values
    header = page.rows[0]
    assert header[2:5] == ["paper", "paper std", "measured (final round)"]
    assert page.rows[1] == [
        "cell",
        "global/test_acc",
        "0.9000",
        "0.0100",
        f"{mean:.4f}",
        f"{std:.4f}",
        f"{sum(bests) / 2:.4f}",
        str(rounds[0]) if rounds[0] == rounds[1] else f"{rounds[0]}, {rounds[1]}",  # rounds, each a seed's
        "2",
        f"{mean - 0.9:.4f}",
    ]
    assert header[6:8] == ["at the best round", "best round"]
    assert "2 runs in 1 recipe." in page.cells
    assert any(c.startswith("Measured = the value after the last round") for c in page.cells)
    assert page.images >= 1  # the learning curve, embedded
    summary = read_summary(runs / "cell" / "seed0")
    assert summary["versions"].get("git_commit", "n/a")[:12] in page.cells
    threads = summary["hardware"]["threads"]
    # where the wall time was spent, so that timings are compared only on the same hardware
    assert f"{summary['hardware']['cpu']}, {threads} thread{'s' * (threads != 1)}, 1 rank" in page.cells


def test_one_seed_has_no_std_and_one_run_is_one_run(tmp_path):
    runs = fit_seeds(tmp_path, (0,))
    page = report_page([runs], tmp_path / "report.html")
    assert page.rows[1][5] == "n/a" and page.rows[1][8] == "1"
    assert "1 run in 1 recipe." in page.cells


def test_values_from_files_are_escaped_in_html_and_markdown(runs, tmp_path):
    evil = "<script>alert(1)</script>"
    path = runs / "cell" / "seed0" / "summary.json"
    summary = json.loads(path.read_text())
    summary.update(
        seed=evil,
        name=f"<b>{evil}|x</b>",
        config_sha256=evil,
        final={evil: 0.5},
        best={evil: 0.5},
        reference={"paper": "<img src=x onerror=alert(1)>", "table": evil, "column": "c", "metrics": {evil: 0.6}},
        versions={"torch": evil, "git_commit": evil},
        hardware={"device": evil, "gpu": evil, "ranks": 1},
    )
    path.write_text(json.dumps(summary))
    page = report_page([runs], tmp_path / "report.html")
    # only the report's own tags: nothing from a file became markup
    assert page.tags <= REPORT_TAGS
    assert f"<b>{evil}|x</b>" in page.cells and evil in page.cells  # shown as text
    assert any("<img src=x onerror=alert(1)>" in c for c in page.cells)
    assert run_cli("report", str(runs), "--output", str(tmp_path / "report.md")) == 0
    text = (tmp_path / "report.md").read_text()
    assert "<script>" not in text and "&lt;script&gt;alert(1)&lt;/script&gt;" in text
    assert "\\|x" in text  # a | from a file does not open a table column


def test_a_truncated_summary_is_one_sentence(runs, tmp_path, capsys):
    path = runs / "cell" / "seed1" / "summary.json"
    path.write_text(path.read_text()[:40])
    assert run_cli("report", str(runs), "--output", str(tmp_path / "r.html")) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{path} is not valid JSON" in err


def test_learning_curves_span_the_page_with_each_roles_curve_the_training_loss_and_one_legible_legend(tmp_path):
    from fl_lightning.report.figures import learning_curve_figure, png, pyplot

    def run(seed, shift):  # an on-device KD run's metrics.csv rows: evaluated from round 3 on
        rows = [{"round": r, "train/loss": 2.0 / r, "target/test_acc": 0.5 + shift + r / 100} for r in (1, 2)]
        rows = [{k: v for k, v in row.items() if not k.endswith("acc")} for row in rows]
        rows += [
            {"round": r, "train/loss": 2.0 / r, "target/test_acc": 0.5 + shift + r / 100, "aux/test_acc": 0.6 + r / 100}
            for r in (3, 6, 9)
        ]
        return {"summary": {"seed": seed}, "curve": rows}

    group = [run(0, 0.0), run(1, 0.01)]
    fig = learning_curve_figure(group, "target/test_acc", paper=0.55)
    assert [ax.get_title() for ax in fig.axes] == ["target/test_acc", "aux/test_acc", "train/loss"]
    target, aux, loss = fig.axes
    expected = [0.6 + r / 100 for r in (3, 6, 9)]
    assert [line.get_ydata().tolist() for line in aux.get_lines()] == [expected] * 2  # both seeds
    pad = 0.03 * (9 - 3)  # the end points' markers whole
    assert target.get_xlim() == pytest.approx((3 - pad, 9 + pad))  # from the first evaluation, not from 0
    assert target.get_xlim() == aux.get_xlim() == loss.get_xlim()
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["seed 0", "seed 1", "paper"]
    assert all(t.get_fontsize() >= 10 for t in legend.get_texts())
    image = png(fig)
    width = int.from_bytes(image[16:20], "big")  # the PNG header's width in pixels
    assert width >= 950  # the page's width (1100 px less its margins), not a thumbnail
    pyplot().close("all")


def test_a_reports_curves_are_as_wide_as_the_page_and_its_versions_are_words(runs, tmp_path):
    page_text = (report_page([runs], tmp_path / "report.html"), (tmp_path / "report.html").read_text())[1]
    assert '<figure class="wide"><img alt="learning curves: global/test_acc, train/loss"' in page_text
    css = (ROOT / "fl_lightning" / "report" / "templates" / "report.css").read_text()
    assert "figure.wide img{width:100%" in css
    versions = read_summary(runs / "cell" / "seed0")["versions"]
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if k != "git_commit")
    page = Page(page_text)
    assert shown in page.cells and not any(c.startswith("{") for c in page.cells)


def test_figures_have_whole_round_ticks_and_an_accuracy_axis_from_0_to_1():
    from fl_lightning.report.figures import client_histogram_figure, learning_curve_figure, pyplot

    run = {
        "summary": {"seed": 0, "per_client_acc": {"0": 1.0, "1": 1.0, "2": 0.5}},
        "curve": [{"round": 2.0, "acc": 0.5}, {"round": 4.0, "acc": 0.75}],
    }
    fig = learning_curve_figure([run], "acc", paper=0.8)
    ax = fig.axes[0]
    low, high = ax.get_xlim()
    ticks = [t for t in ax.get_xticks() if low <= t <= high]
    assert ticks and all(t == int(t) for t in ticks)
    pyplot().close(fig)
    fig = client_histogram_figure([run])
    ax = fig.axes[0]
    assert ax.get_xlim() == (0.0, 1.0)  # all-equal values used to stretch the axis to [0.5, 1.5]
    # 20 bins of 0.05 from 0 to 1: 0.5 falls in bin 10, the two 1.0s in the last bin
    assert [p.get_height() for p in ax.patches] == [0] * 10 + [1] + [0] * 8 + [2]
    assert ax.patches[0].get_x() == pytest.approx(0.0) and ax.patches[-1].get_x() == pytest.approx(0.95)
    pyplot().close(fig)


def test_a_sweep_directory_gets_a_sweep_section_with_pruned_trials(runs, tmp_path):
    base = write_recipe(tmp_path / "base.yaml")
    sweep = {
        "base": str(base),
        "metric": "global/test_acc",
        "n_trials": 5,
        "overrides": {"rounds": 4, "eval_every": 1},
        "sampler": {"name": "random", "seed": 0},
        "pruner": {"name": "median", "n_startup_trials": 1, "n_warmup_steps": 0},
        "parameters": {
            "training.optimizer.init_args.lr": {"type": "categorical", "choices": [0.3, 0.001]},
            "training.optimizer.init_args.momentum": {"type": "float", "low": 0.0, "high": 0.9},
        },
        "output_dir": str(tmp_path / "sweeps" / "s"),
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(sweep))
    assert run_cli("sweep", "--config", str(tmp_path / "s.yaml")) == 0
    rows = list(csv.DictReader((tmp_path / "sweeps" / "s" / "trials.csv").open()))
    assert {r["state"] for r in rows} == {"COMPLETE", "PRUNED"}
    page = report_page([runs, tmp_path / "sweeps"], tmp_path / "report.html")
    assert "2 runs in 1 recipe and 1 sweep." in page.cells  # trials are not recipes
    assert "Sweep s" in page.cells
    table = page.rows[page.rows.index(["trial", "state", "global/test_acc", "lr", "momentum", "seconds", "note"]) :]
    assert [r[:2] for r in table[1:]] == [[r["trial"], r["state"]] for r in rows]
    pruned = next(r for r in rows if r["state"] == "PRUNED")
    assert f"pruned after round {pruned['last_round']}" in page.cells
    assert page.images == 1 + 3  # the recipe's curve; history, importances, every trial's curve
    db = tmp_path / "sweeps" / "s" / "study.db"
    assert f"optuna-dashboard sqlite:///{db}" in page.cells


def test_the_dashboard_command_names_a_study_below_the_working_folder_relative_to_it(tmp_path, monkeypatch):
    from fl_lightning.report.sweeps import dashboard_command

    monkeypatch.chdir(tmp_path)
    here = {"info": {"storage": f"sqlite:///{tmp_path}/runs/sweeps/s/study.db"}, "root": tmp_path / "runs/sweeps/s"}
    assert dashboard_command(here) == "optuna-dashboard sqlite:///runs/sweeps/s/study.db"  # as run from here
    elsewhere = {"info": {"storage": "sqlite:////data/studies/s.db"}, "root": Path("/data/studies")}
    assert dashboard_command(elsewhere) == "optuna-dashboard sqlite:////data/studies/s.db"
    server = {"info": {"storage": "postgresql+psycopg2://me@db/optuna"}, "root": tmp_path}
    assert dashboard_command(server) == "optuna-dashboard postgresql+psycopg2://me@db/optuna"


def test_markdown_report_writes_figures_and_wandb_logs_offline(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    assert run_cli("report", str(runs), "--output", "out/report.md", "--wandb_run") == 0
    text = (tmp_path / "out/report.md").read_text()
    assert "| cell | global/test_acc | 0.9000 | 0.0100 |" in text
    assert (tmp_path / "out/report_figures/cell_curve.png").read_bytes()[:4] == b"\x89PNG"
    (offline,) = (tmp_path / "out/report_wandb/wandb").glob("offline-run-*")  # the W&B run beside the report
    where = offline.relative_to(tmp_path)
    assert f"W&B run (offline): {where}; upload it with: wandb sync {where}\n" in capsys.readouterr().out
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "out/wandb").exists()


def test_wandb_run_gets_the_partition_chart_and_says_how_to_sync(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.chdir(tmp_path)
    recipe = write_recipe(tmp_path / "r.yaml", rounds=1)
    assert run_cli("fit", "--config", str(recipe), "--output_dir", "run", "--logger", "wandb") == 0
    media = list((tmp_path / "run/wandb").glob("offline-run-*/files/media/images/partition/*.png"))
    assert len(media) == 1 and media[0].read_bytes()[:4] == b"\x89PNG", "the partition chart was not logged to W&B"
    assert not (tmp_path / "run/partition.png").exists()  # drawn for W&B, not left in the run folder
    offline = media[0].relative_to(tmp_path).parents[-4]  # run/wandb/offline-run-*
    assert f"W&B run saved offline; upload it with: wandb sync {offline}\n" in capsys.readouterr().err


def test_report_without_runs_is_a_clear_error(tmp_path, capsys):
    assert run_cli("report", str(tmp_path), "--output", str(tmp_path / "r.html")) == 2
    assert "no run directory" in capsys.readouterr().err


class Attributes(HTMLParser):
    """Every attribute name of every tag in a page."""

    def __init__(self, text):
        super().__init__()
        self.names = set()
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.names.update(name for name, _ in attrs)


def test_sweep_notes_and_values_from_its_files_are_text_in_the_templated_page(tmp_path):
    """The page comes from templates with autoescape: a sweep's own files (its notes, a trial's state that
    becomes a cell's class) show as text, and nothing in them becomes a tag or an attribute."""
    sweep = tmp_path / "sweeps" / "s"
    sweep.mkdir(parents=True)
    evil = "<script>alert(1)</script>"
    info = {
        "study": f"<b>{evil}</b>",
        "metric": "global/test_acc",
        "direction": "maximize",
        "n_trials": 2,
        "notes": [f"importances from 2 trials are unreliable {evil}"],
        "warnings": "the objective is a test metric",
    }
    (sweep / "sweep.json").write_text(json.dumps(info))
    hostile_state = "x' onmouseover='alert(1)"
    with (sweep / "trials.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", "state", "value", "param/lr", "seconds", "error"])
        writer.writerow([0, "COMPLETE", 0.5, evil, 1.0, ""])
        writer.writerow([1, hostile_state, "", 0.1, 1.0, evil])
    out = tmp_path / "report.html"
    page = report_page([tmp_path / "sweeps"], out)
    assert page.tags <= REPORT_TAGS and Attributes(out.read_text()).names <= {"lang", "charset", "class", "alt", "src"}
    assert f"Sweep <b>{evil}</b>" in page.cells
    assert f"Note: importances from 2 trials are unreliable {evil}" in page.cells
    assert "Note: the objective is a test metric" in page.cells
    table = page.rows[page.rows.index(["trial", "state", "global/test_acc", "lr", "seconds", "note"]) :]
    assert table[1] == ["0", "COMPLETE", "0.5000", evil, "1.0"] and table[2][:2] == ["1", hostile_state]
    assert run_cli("report", str(tmp_path / "sweeps"), "--output", str(tmp_path / "report.md")) == 0
    text = (tmp_path / "report.md").read_text()
    assert "Note: importances from 2 trials are unreliable &lt;script&gt;" in text and "<script>" not in text


def test_a_sweeps_importance_caveat_and_the_best_trials_test_score_are_in_its_section(tmp_path):
    """What ``flrun sweep`` writes for the reader: importances from few trials flagged, and the test score of
    the trial tuned on a validation metric, in the HTML and the Markdown report."""
    sweep = tmp_path / "sweeps" / "s"
    sweep.mkdir(parents=True)
    info = {
        "study": "s",
        "metric": "global/val_acc",
        "n_trials": 2,
        "importances": {"lr": 0.7, "batch_size": 0.3},
        "importances_note": "from 2 completed trials: unreliable below about 10",
        "best_trial": 0,
        "best_test": {"metric": "global/test_acc", "value": 0.875},
    }
    (sweep / "sweep.json").write_text(json.dumps(info))
    with (sweep / "trials.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["trial", "state", "value", "param/lr", "seconds", "error"])
        writer.writerow([0, "COMPLETE", 0.9, 0.1, 1.0, ""])
        writer.writerow([1, "COMPLETE", 0.8, 0.2, 1.0, ""])
    page = report_page([tmp_path / "sweeps"], tmp_path / "report.html")
    assert "Note: parameter importances from 2 completed trials: unreliable below about 10" in page.cells
    assert any("The best trial's global/test_acc: 0.8750." in cell for cell in page.cells)
    assert run_cli("report", str(tmp_path / "sweeps"), "--output", str(tmp_path / "report.md")) == 0
    text = (tmp_path / "report.md").read_text()
    assert "unreliable below about 10" in text and "acc: 0.8750." in text


def test_the_templates_escape_every_value_and_ship_in_the_wheel(tmp_path):
    import shutil
    import subprocess
    import sys
    import zipfile

    from conftest import ROOT

    from fl_lightning.report.html import TEMPLATES, environment

    assert environment().from_string("<p title='{{ x }}'>{{ x }}</p>").render(x="'><b>") == (
        "<p title='&#39;&gt;&lt;b&gt;'>&#39;&gt;&lt;b&gt;</p>"
    )
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "fl_lightning", tmp_path / "fl_lightning", ignore=shutil.ignore_patterns("__pycache__"))
    command = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", "dist", "."]
    subprocess.run(command, cwd=tmp_path, capture_output=True, timeout=300, check=True)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if "/templates/" in n}
    assert shipped == {f"fl_lightning/report/templates/{p.name}" for p in TEMPLATES.iterdir()} and len(shipped) >= 5
