"""flrun report averages the seeds of one experiment only: runs of one name whose recipes differ (rounds,
data, monitor) are separate experiments, labelled with what differs; a copied run of a seed counts once;
--output must be .html or .md. Real tiny digits runs."""

import shutil

import pytest
import yaml
from conftest import read_summary, run_cli, write_recipe
from test_report import Page

from fl_lightning.report.groups import group_experiments

VARIANTS = {  # run directory: (seed, extra fit arguments)
    "seed0": (0, []),
    "seed1": (1, ["--checkpoint_every", "2"]),  # checkpointing does not change the numbers: the same experiment
    "short": (0, ["--rounds", "2"]),
    "test_fraction": (0, ["--data.init_args.test_fraction", "0.1"]),
    "loss": (0, ["--monitor", "global/test_loss"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Five runs named ``quick``: seeds 0 and 1 of the recipe, and three other experiments of seed 0;
    plus a copy of seed 0's directory (the same seed again)."""
    tmp = tmp_path_factory.mktemp("groups")
    recipe = write_recipe(tmp / "quick.yaml")
    for directory, (seed, extra) in VARIANTS.items():
        argv = ["fit", "--config", str(recipe), "--seed", str(seed), "--output_dir", str(tmp / "runs" / directory)]
        assert run_cli(*argv, *extra) == 0
    shutil.copytree(tmp / "runs/seed0", tmp / "runs/zz_copy_of_seed0")
    return tmp / "runs"


def _final(runs, directory, metric):
    return read_summary(runs / directory)["final"][metric]


def test_runs_of_one_name_with_other_recipes_are_separate_experiments(runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert run_cli("report", str(runs), "--output", str(out)) == 0
    page = Page(out.read_text())
    acc, loss = "global/test_acc", "global/test_loss"
    a, b = _final(runs, "seed0", acc), _final(runs, "seed1", acc)
    mean, std = (a + b) / 2, abs(a - b) / 2**0.5  # the sample std of two values
    label = "quick (test_fraction={}, rounds={}, monitor={})"
    runs_column = page.rows[0].index("runs")  # after the best round's value and rounds
    summary = [row[:6] + [row[runs_column]] for row in page.rows[1:5]]
    assert summary == [
        [label.format(0.1, 4, acc), acc, "n/a", "n/a", f"{_final(runs, 'test_fraction', acc):.4f}", "n/a", "1"],
        [label.format(0.2, 2, acc), acc, "n/a", "n/a", f"{_final(runs, 'short', acc):.4f}", "n/a", "1"],
        [label.format(0.2, 4, acc), acc, "n/a", "n/a", f"{mean:.4f}", f"{std:.4f}", "2"],
        # the headline is the experiment's own monitor
        [label.format(0.2, 4, loss), loss, "n/a", "n/a", f"{_final(runs, 'loss', loss):.4f}", "n/a", "1"],
    ]
    assert "6 runs in 4 recipes." in page.cells
    assert any(
        c.startswith("Runs named quick come from different recipes (config.yaml) and are reported apart; this ")
        and c.endswith("has data.init_args.test_fraction = 0.1; rounds = 4; monitor = global/test_acc.")
        for c in page.cells
    )
    # the copy of seed 0 is listed, not counted, and said so on stderr and in the page
    assert any(c.startswith("2 runs, seeds 0, 1 (1 copy of a seed not counted);") for c in page.cells)
    assert "0 (same seed again, not counted)" in page.cells
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flrun report: warning: {runs / 'zz_copy_of_seed0'} is seed 0 of ")
    assert err[0].endswith(f"again (as {runs / 'seed0'}): counted once; remove the copy or give it another seed.")
    assert any(c.startswith("Warning: ") and "zz_copy_of_seed0 is seed 0" in c for c in page.cells)


def test_seeds_of_one_experiment_are_one_group_named_by_the_recipe_alone(runs, tmp_path):
    only = tmp_path / "only"
    for directory in ("seed0", "seed1"):
        shutil.copytree(runs / directory, only / directory)
    out = tmp_path / "report.md"
    assert run_cli("report", str(only), "--output", str(out)) == 0
    a, b = _final(runs, "seed0", "global/test_acc"), _final(runs, "seed1", "global/test_acc")
    row = f"| quick | global/test_acc | n/a | n/a | {(a + b) / 2:.4f} | {abs(a - b) / 2**0.5:.4f} |"
    text = out.read_text()
    assert row in text and "2 runs in 1 recipe." in text and "Warning" not in text


def test_a_run_without_config_yaml_is_its_own_experiment(runs, tmp_path):
    from fl_lightning.report.runs import load_run

    shutil.copytree(runs / "seed1", tmp_path / "seed1")
    (tmp_path / "seed1/config.yaml").unlink()
    groups = group_experiments([load_run(runs / "seed0"), load_run(tmp_path / "seed1")])
    assert [(g["label"], len(g["runs"])) for g in groups] == [
        ("quick (config.yaml=missing or unreadable)", 1),
        ("quick (config.yaml=present)", 1),
    ]


def _fake_run(root, seed, sampler, lr, **more):
    config = {
        "data": {"class_path": "D"},
        "sampler": {"class_path": sampler, "init_args": {"fraction": 0.5}},
        "training": {"optimizer": {"init_args": {"lr": lr}}},
        "seed": seed,
        "output_dir": str(root),
        **more,
    }
    root.mkdir(parents=True)
    (root / "config.yaml").write_text(yaml.safe_dump(config))
    return {"root": root, "summary": {"name": "x", "seed": seed, "monitor": "acc"}, "curve": []}


def test_labels_name_the_differing_keys_by_their_shortest_unambiguous_tail(tmp_path):
    runs = [
        _fake_run(tmp_path / "a", 0, "U", 0.1),
        _fake_run(tmp_path / "b", 0, "V", 0.01),
        # another seed, output_dir, logger, progress and reference: the same experiment as a
        _fake_run(tmp_path / "c", 1, "U", 0.1, logger="wandb", runtime={"progress": True}, reference={"p": 1}),
    ]
    groups = group_experiments(runs)
    # class_path alone would not say which: data has one too
    assert [(g["label"], [r["root"].name for r in g["runs"]]) for g in groups] == [
        ("x (sampler.class_path=U, lr=0.1)", ["a", "c"]),
        ("x (sampler.class_path=V, lr=0.01)", ["b"]),
    ]
    assert groups[1]["differs"] == {"sampler.class_path": "V", "training.optimizer.init_args.lr": 0.01}


@pytest.mark.parametrize("output", ["r.pdf", "myreport", "r.htm"])
@pytest.mark.parametrize("table", [[], ["--table", "paper-001/table-5"]])
def test_an_output_that_is_not_html_or_md_is_refused(runs, tmp_path, capsys, output, table):
    assert run_cli("report", str(runs), "--output", str(tmp_path / output), *table) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"flrun report: error: --output {tmp_path / output} must end in .html or .md: flrun report writes "
        "HTML or Markdown only."
    )
    assert not (tmp_path / output).exists()
