"""flrun report RUNS --wandb ENTITY/PROJECT: the W&B Report built from run directories (checked offline, block by
block and panel by panel, without saving), and the one-sentence refusals when it could not be saved."""

import json
import shutil

import pytest
import wandb_workspaces.reports.v2 as wr
from conftest import read_summary, run_cli, write_recipe
from wandb_workspaces import expr

from fl_lightning.report.build import build_report
from fl_lightning.report.wandb_report import build_wandb_report

REFERENCE = {
    "paper": "paper-001 (test)",
    "table": "Table 4",
    "column": "Proposed",
    "metrics": {"global/test_acc": 0.9},
    "stds": {"global/test_acc": 0.01},
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two seeds of `cell` logged to W&B (offline), one run of `plain` without W&B."""
    root = tmp_path_factory.mktemp("wandb_report")
    cell = write_recipe(root / "cell.yaml", reference=REFERENCE)
    for seed in (0, 1):
        out = root / "runs" / "cell" / f"seed{seed}"
        assert (
            run_cli("fit", "--config", str(cell), "--seed", str(seed), "--output_dir", str(out), "--logger", "wandb")
            == 0
        )
    plain = write_recipe(root / "plain.yaml", rounds=2)
    assert run_cli("fit", "--config", str(plain), "--output_dir", str(root / "runs" / "plain" / "seed0")) == 0
    return root / "runs"


def wandb_id(run_dir):
    (folder,) = (run_dir / "wandb").glob("offline-run-*")  # offline-run-<date>_<time>-<id>
    return folder.name.rsplit("-", 1)[1]


def filter_tree(runset):
    """The run set's filter as the W&B backend receives it."""
    return expr.expr_to_filters(runset.filters).model_dump(by_alias=True, exclude_none=True)


def blocks_after(report, heading):
    """The blocks between the H2 ``heading`` and the next H2."""
    start = next(i for i, b in enumerate(report.blocks) if isinstance(b, wr.H2) and b.text == heading)
    end = next((i for i, b in enumerate(report.blocks) if isinstance(b, wr.H2) and i > start), len(report.blocks))
    return report.blocks[start + 1 : end]


def test_each_experiment_gets_its_runs_grouped_by_recipe_a_plot_per_round_and_a_paper_table(runs, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")  # built without an account: nothing here reaches W&B
    report = build_wandb_report(build_report([str(runs)]), "my-team", "fl-lightning")
    assert (report.entity, report.project, report.title) == ("my-team", "fl-lightning", "Reproducibility report")
    assert [b.text for b in report.blocks if isinstance(b, wr.H2)] == [
        "Paper vs measured",
        "Trade-off: DigitsData, test_acc",  # cell and plain share TINY's data
        "cell",
        "plain",
    ]

    summaries = [read_summary(runs / "cell" / f"seed{s}") for s in (0, 1)]
    finals = [s["final"]["global/test_acc"] for s in summaries]
    mean, std = sum(finals) / 2, abs(finals[0] - finals[1]) / 2**0.5
    (table,) = blocks_after(report, "Paper vs measured")
    assert f"| cell | global/test_acc | 0.9000 | 0.0100 | {mean:.4f} | {std:.4f} |" in table.text

    cell = blocks_after(report, "cell")
    assert cell[0].text == "Paper: paper-001 (test), Table 4, Proposed."
    (grid,) = [b for b in cell if isinstance(b, wr.PanelGrid)]
    (runset,) = grid.runsets
    assert (runset.entity, runset.project, runset.groupby) == ("my-team", "fl-lightning", ["config.name"])
    ids = sorted(wandb_id(runs / "cell" / f"seed{s}") for s in (0, 1))
    assert filter_tree(runset) == {
        "op": "IN",
        "key": {"section": "run", "name": "name"},
        "value": ids,
        "disabled": False,
    }
    plot, comparer = grid.panels
    assert isinstance(plot, wr.LinePlot) and isinstance(comparer, wr.RunComparer)
    assert (plot.x, plot.y, plot.groupby_aggfunc, plot.groupby_rangefunc) == (
        "Step",
        ["global/test_acc"],
        "mean",
        "stddev",
    )
    assert summaries[0]["monitor"] == "global/test_acc"  # the plotted metric is the one the runs monitor
    provenance = cell[-1].text.splitlines()
    assert provenance[0].startswith("| seed | final | best (round) | wandb run id | git commit | config sha256 |")
    for seed, summary in enumerate(summaries):
        run_id = wandb_id(runs / "cell" / f"seed{seed}")
        row = next(line for line in provenance if line.startswith(f"| {seed} |"))
        assert (
            f"| {run_id} | {summary['versions'].get('git_commit', 'n/a')[:12]} | {summary['config_sha256'][:12]} |"
            in row
        )
        versions = summary["versions"]
        assert f"(round {summary['best_round']}) |" in row
        assert f"| fl_lightning {versions['fl_lightning']}, torch {versions['torch']}, " in row  # words, not JSON


def test_the_tradeoff_plots_each_run_against_the_traffic_and_compute_it_logged_with_the_papers_points(runs):
    report = build_report([str(runs)])
    section = blocks_after(build_wandb_report(report, "me", "proj"), "Trade-off: DigitsData, test_acc")
    texts = [b.text for b in section if isinstance(b, wr.P)]
    assert texts[0].startswith("Each method's metric against the MiB each client sent and received")
    assert "Note: 1 of these runs have no W&B run in their directory" in texts[-1]  # plain's
    (grid,) = [b for b in section if isinstance(b, wr.PanelGrid)]
    (runset,) = grid.runsets
    assert runset.groupby == []  # a line per run: per method and seed
    assert filter_tree(runset)["filters"] == [
        {"op": "IN", "key": {"section": "config", "name": "name"}, "value": ["cell", "plain"], "disabled": False},
        {"op": "IN", "key": {"section": "config", "name": "seed"}, "value": [0, 1], "disabled": False},
    ]
    traffic, compute = grid.panels
    assert (traffic.x, traffic.y, compute.x, compute.y) == (
        "comm/mib_per_client",  # metrics.csv's columns, logged every round
        ["global/test_acc"],
        "compute/gflops_per_client",
        ["global/test_acc"],
    )
    # the traffic of TINY's runs grows with the rounds only: less than two decades, a linear axis
    assert traffic.log_x is False and compute.log_x is False
    table = section[-1].text.splitlines()
    assert table[0].startswith("| method | metric | runs | final (mean) | MiB per client (mean) |")
    (tradeoff,) = report["tradeoffs"]
    cell = tradeoff["setting"].methods[0]
    mib = sum(c.mib[-1] for c in cell.curves) / 2
    assert any(row.startswith("| cell | global/test_acc | 2 | ") and f"| {mib:.4f} |" in row for row in table)


def test_runs_logged_without_wandb_are_selected_by_recipe_name_and_seed_and_the_report_says_so(runs):
    plain = blocks_after(build_wandb_report(build_report([str(runs / "plain")]), "me", "proj"), "plain")
    (note,) = [b for b in plain if isinstance(b, wr.P) and b.text.startswith("Note:")]
    assert "1 of these runs have no W&B run in their directory" in note.text
    (grid,) = [b for b in plain if isinstance(b, wr.PanelGrid)]
    assert filter_tree(grid.runsets[0])["filters"] == [
        {"op": "=", "key": {"section": "config", "name": "name"}, "value": "plain", "disabled": False},
        {"op": "IN", "key": {"section": "config", "name": "seed"}, "value": [0], "disabled": False},
    ]


def test_a_name_from_a_file_stays_a_value_in_the_filter_and_text_in_the_tables(runs, tmp_path):
    evil = "x' or Config('seed') == 'y <b>|\\ >= \\\\x3c"
    copy = tmp_path / "evil" / "seed0"
    shutil.copytree(runs / "plain" / "seed0", copy)
    summary = read_summary(copy)
    summary["name"] = evil
    (copy / "summary.json").write_text(json.dumps(summary))
    report = build_wandb_report(build_report([str(tmp_path / "evil")]), "me", "proj")
    (grid,) = [b for b in report.blocks if isinstance(b, wr.PanelGrid)]
    assert filter_tree(grid.runsets[0])["filters"][0]["value"] == evil
    (table,) = blocks_after(report, "Paper vs measured")
    assert "x' or Config('seed') == 'y &lt;b&gt;\\|" in table.text and "<b>" not in table.text


def test_a_sweep_gets_its_facts_notes_and_trials(tmp_path):
    sweep = tmp_path / "sweeps" / "s"
    sweep.mkdir(parents=True)
    info = {"study": "s", "metric": "val/acc", "direction": "maximize", "n_trials": 2, "notes": ["few trials"]}
    (sweep / "sweep.json").write_text(json.dumps(info))
    (sweep / "trials.csv").write_text(
        "trial,state,value,param/lr,seconds\n0,COMPLETE,0.5,0.1,2.0\n1,PRUNED,0.25,0.3,1.0\n"
    )
    section = blocks_after(build_wandb_report(build_report([str(tmp_path / "sweeps")]), "me", "proj"), "Sweep s")
    texts = [b.text for b in section if isinstance(b, wr.P)]
    assert texts[0].startswith("Objective: val/acc (best value of each run), maximize; 2 trials of the 2 asked for")
    assert "Note: few trials" in texts and "Best: trial 0 with 0.5000; recipe: n/a." in texts
    assert section[-1].text.splitlines()[2:] == [
        "| 0 | COMPLETE | 0.5000 | 0.1 | 2.0 |  |",
        "| 1 | PRUNED | 0.2500 | 0.3 | 1.0 |  |",
    ]


def one_line_error(capsys):
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


def test_saving_without_an_account_is_refused_in_one_sentence_before_anything_is_written(runs, tmp_path, capsys,
                                                                                         monkeypatch):  # fmt: skip
    out = tmp_path / "report.html"
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert run_cli("report", str(runs), "--output", str(out), "--wandb", "me/proj") == 2
    assert "saving a W&B Report needs a W&B account online, but WANDB_MODE is offline; log in with" in (
        one_line_error(capsys)
    )
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no W&B settings: no key anywhere
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))
    assert run_cli("report", str(runs), "--output", str(out), "--wandb", "me/proj") == 2
    assert "saving a W&B Report needs a W&B account, and no API key is configured" in one_line_error(capsys)
    assert not out.exists()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--wandb"], "--wandb takes the W&B project of the runs as ENTITY/PROJECT"),
        (["--wandb", "fl-lightning"], "must name the W&B entity and project of the runs as ENTITY/PROJECT"),
        (["--wandb", "me/proj", "--table", "paper-001/table-5"], "--table writes a file only"),
    ],
)
def test_a_wandb_option_it_cannot_use_is_one_sentence(runs, tmp_path, capsys, argv, message):
    assert run_cli("report", str(runs), "--output", str(tmp_path / "r.html"), *argv) == 2
    assert message in one_line_error(capsys) and not (tmp_path / "r.html").exists()


def test_with_an_account_the_report_is_saved_and_its_address_printed(runs, tmp_path, capsys, monkeypatch):
    import fl_lightning.report.wandb_report as module

    saved = []

    def save(report, draft=False, clone=False):
        saved.append(report)
        report.id = "abc123"
        return report

    monkeypatch.setattr(module, "check_account", lambda: None)  # stands in for a logged-in account
    monkeypatch.setattr(wr.Report, "save", save)
    monkeypatch.setattr(wr.Report, "url", property(lambda r: f"https://wandb.ai/{r.entity}/{r.project}/reports/{r.id}"))
    out = tmp_path / "report.html"
    assert run_cli("report", str(runs), "--output", str(out), "--wandb", "me/proj") == 0
    assert "W&B Report: https://wandb.ai/me/proj/reports/abc123" in capsys.readouterr().out
    assert out.is_file() and len(saved) == 1 and sum(isinstance(b, wr.PanelGrid) for b in saved[0].blocks) == 3

    def refused(report, draft=False, clone=False):
        raise RuntimeError("403 Client Error: Forbidden\nmore lines")

    monkeypatch.setattr(wr.Report, "save", refused)
    assert run_cli("report", str(runs), "--output", str(out), "--wandb", "me/proj") == 2
    assert one_line_error(capsys).endswith(
        "the W&B Report could not be saved to me/proj (403 Client Error: Forbidden); check that the entity and "
        "project exist and that your account may write there."
    )
