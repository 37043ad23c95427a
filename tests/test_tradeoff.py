"""The trade-off a report draws: accuracy against the MiB each client sent and received and against its local
training FLOPs, per setting, one curve per method and seed, with the paper's points; checked against the
ledger's and the steps' numbers computed by hand for tiny runs, and on the HTML and Markdown pages."""

import csv
import json

import pytest
import torch
from conftest import ROOT, metrics_rows, read_summary, run_cli, write_recipe
from test_report import REPORT_TAGS, Page
from torch import nn

from fl_lightning.client.flops import step_flops
from fl_lightning.report.build import build_report
from fl_lightning.report.figures import pyplot, tradeoff_figure, x_scale
from fl_lightning.report.tradeoff import Method, PaperPoint, RunCurve, Setting

CLIENTS, PER_ROUND, STEPS, BATCH = 8, 4, 5, 16  # TINY: 8 clients, half of them a round, 5 steps of 16 examples
MIB = 2**20


def mlp_step_flops(hidden, batch=BATCH, inputs=64, classes=10):
    """digits_mlp(hidden) with one hidden layer: forward 2 B (64 h + 10 h) FLOPs, the weights' gradients as many,
    and the head's input gradient 2 B 10 h (the first layer's input needs none)."""
    forward = 2 * batch * (inputs * hidden + hidden * classes)
    return 2 * forward + 2 * batch * hidden * classes


def mlp_bytes(hidden, inputs=64, classes=10):
    return 4 * (inputs * hidden + hidden + hidden * classes + classes)  # float32 weights and biases


# ------------------------------------------------------------------ the compute estimate
def test_a_steps_flops_are_its_matrix_products_forward_and_backward_by_hand():
    assert step_flops(nn.Linear(4, 3), torch.zeros(1, 4), batch_size=2) == 2 * 2 * 4 * 3 * 2  # forward + weights
    two = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    forward = 2 * 2 * (4 * 5 + 5 * 3)
    assert step_flops(two, torch.zeros(1, 4), batch_size=2) == 2 * forward + 2 * 2 * 5 * 3  # + the hidden's gradient
    two[0].requires_grad_(False)  # a frozen first layer: neither its weights' nor its output's gradient is computed
    assert step_flops(two, torch.zeros(1, 4), batch_size=2) == forward + 2 * 2 * 5 * 3


def test_counting_a_step_draws_no_random_number_and_changes_no_weight_or_buffer():
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Dropout(0.5), nn.Linear(6, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    generator = torch.get_rng_state()
    assert step_flops(model, torch.zeros(3, 4), batch_size=8) > 0
    assert torch.equal(torch.get_rng_state(), generator)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm's statistics too


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two methods on TINY's data, two rounds each: FedAvg (seeds 0 and 1) and FML with a second, smaller model
    trained beside each client's own (seed 0); FedAvg's recipe states a paper's communication."""
    root = tmp_path_factory.mktemp("tradeoff")
    reference = {
        "paper": "paper-004 (test)",
        "table": "Table 3",
        "row": "FedAvg",
        "column": "digits",
        "metrics": {"global/test_acc": 0.8, "comm/kib_per_client_round": 30.0, "comm/kib_to/global/test_acc@0.5": 90},
    }
    fedavg = write_recipe(root / "fedavg.yaml", rounds=2, eval_every=1, reference=reference)
    fml = write_recipe(
        root / "fml.yaml",
        rounds=2,
        eval_every=1,
        models={"own": {"builder": "digits_mlp", "args": {"hidden": 32}}, "meme": {"builder": "digits_mlp",
                "args": {"hidden": 8}}},
        population={"num_clients": CLIENTS, "tiers": [{"name": "all", "roles": ["own", "meme"]}]},
        strategy={"class_path": "fl_lightning.strategies.FML", "init_args": {"meme_role": "meme", "split": "global"}},
    )  # fmt: skip
    for recipe, seed in ((fedavg, 0), (fedavg, 1), (fml, 0)):
        out = root / "runs" / recipe.stem / f"seed{seed}"
        assert run_cli("fit", "--config", str(recipe), "--seed", str(seed), "--output_dir", str(out)) == 0
    return root / "runs"


def test_a_runs_compute_is_each_roles_step_flops_times_the_steps_its_clients_took(runs):
    fedavg = metrics_rows(runs / "fedavg" / "seed0")
    per_round = PER_ROUND * STEPS * mlp_step_flops(32)
    assert [int(r["compute/train_flops"]) for r in fedavg] == [per_round, 2 * per_round]
    assert [float(r["compute/gflops_per_client"]) for r in fedavg] == pytest.approx(
        [per_round / CLIENTS / 1e9, 2 * per_round / CLIENTS / 1e9]
    )
    summary = read_summary(runs / "fedavg" / "seed0")
    assert summary["compute"] == {"train_flops": 2 * per_round, "step_flops": {"global": mlp_step_flops(32)}}
    # FML trains both of a client's models on each batch (fit_jointly): both roles' steps count
    fml = metrics_rows(runs / "fml" / "seed0")
    both = PER_ROUND * STEPS * (mlp_step_flops(32) + mlp_step_flops(8))
    assert [int(r["compute/train_flops"]) for r in fml] == [both, 2 * both]


def test_the_traffic_per_client_is_the_ledgers_bytes_over_the_population(runs):
    # FedAvg: each sampled client receives the global model and sends its own back
    fedavg = metrics_rows(runs / "fedavg" / "seed0")
    per_round = 2 * PER_ROUND * mlp_bytes(32)
    assert [float(r["comm/mib_per_client"]) for r in fedavg] == pytest.approx(
        [per_round / CLIENTS / MIB, 2 * per_round / CLIENTS / MIB]
    )
    fml = metrics_rows(runs / "fml" / "seed0")  # FML exchanges the shared (meme) model only
    assert float(fml[-1]["comm/mib_per_client"]) == pytest.approx(2 * 2 * PER_ROUND * mlp_bytes(8) / CLIENTS / MIB)


def test_the_compute_and_traffic_columns_resume_exactly_and_the_batched_executor_counts_the_same(runs, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=3, eval_every=1)
    common = ["fit", "--config", str(recipe)]
    assert run_cli(*common, "--output_dir", str(tmp_path / "whole")) == 0
    assert run_cli(*common, "--output_dir", str(tmp_path / "cut"), "--stop_after", "1") == 0
    assert run_cli(*common, "--output_dir", str(tmp_path / "cut"), "--resume", "auto") == 0
    assert run_cli(*common, "--output_dir", str(tmp_path / "batched"), "--runtime.executor", "batched") == 0
    columns = ("compute/train_flops", "compute/gflops_per_client", "comm/mib_per_client")
    whole = [[r[c] for c in columns] for r in metrics_rows(tmp_path / "whole")]
    assert whole[-1][0] == str(3 * PER_ROUND * STEPS * mlp_step_flops(32))
    assert [[r[c] for c in columns] for r in metrics_rows(tmp_path / "cut")] == whole
    assert [[r[c] for c in columns] for r in metrics_rows(tmp_path / "batched")] == whole


def test_the_compute_per_client_and_round_is_a_metric_a_table_cell_can_name(runs):
    from fl_lightning.report.runs import load_run, measured_value

    run = load_run(runs / "fedavg" / "seed0")  # each sampled client takes 5 steps a round
    assert measured_value(run, "compute/gflops_per_client_round") == pytest.approx(STEPS * mlp_step_flops(32) / 1e9)


def test_a_model_that_cannot_run_on_meta_tensors_is_named_and_the_run_records_no_total(tmp_path, monkeypatch):
    from fl_lightning.client.flops import role_step_flops

    class Eager(nn.Linear):
        def forward(self, x):
            return super().forward(x) * x.abs().max().item()  # a number out of the data: meta tensors have none

    counted, failed = role_step_flops({"a": nn.Linear(4, 3), "b": Eager(4, 3)}, torch.zeros(1, 4), batch_size=2)
    assert counted == {"a": 96} and list(failed) == ["b"] and "meta" in failed["b"].lower()
    import fl_lightning.run.orchestrator as orchestrator

    monkeypatch.setattr(orchestrator, "role_step_flops", lambda models, sample, batch: ({}, {"global": "no data"}))
    out = tmp_path / "run"
    assert run_cli("fit", "--config", str(write_recipe(tmp_path / "r.yaml", rounds=2)), "--output_dir", str(out)) == 0
    assert read_summary(out)["compute"] == {"train_flops": None, "step_flops": {}, "not_counted": {"global": "no data"}}
    columns = metrics_rows(out)[0]
    assert not any(k.startswith("compute/") for k in columns)  # a role's steps without their cost: no total


# ------------------------------------------------------------------ the figure's data
def test_a_reports_tradeoff_holds_each_method_and_seed_at_the_ledgers_points_and_the_papers(runs):
    report = build_report([str(runs)])
    (tradeoff,) = report["tradeoffs"]  # one data set: one setting
    setting = tradeoff["setting"]
    assert setting.title == "DigitsData, test_acc" and setting.notes == []
    fedavg, fml = setting.methods
    assert (fedavg.label, fml.label) == ("fedavg", "fml")
    assert [c.seed for c in fedavg.curves] == [0, 1] and [c.seed for c in fml.curves] == [0]
    per_round = 2 * PER_ROUND * mlp_bytes(32) / CLIENTS / MIB
    flops = PER_ROUND * STEPS * mlp_step_flops(32) / CLIENTS / 1e9
    for seed, curve in enumerate(fedavg.curves):
        assert curve.rounds == [1.0, 2.0]
        assert curve.mib == pytest.approx([per_round, 2 * per_round])
        assert curve.gflops == pytest.approx([flops, 2 * flops])
        accuracies = [float(r["global/test_acc"]) for r in metrics_rows(runs / "fedavg" / f"seed{seed}")]
        assert curve.metric == "global/test_acc" and curve.acc == accuracies
    # the paper's points: CO/c/r 30 KiB per sampled client and round over the recipe's 2 rounds and 4 of 8
    # clients a round, at its 0.8; and 0.5 reached after 90 KiB in all, over 8 clients
    assert [p.acc for p in fedavg.paper] == [0.8, 0.5]
    assert [p.mib for p in fedavg.paper] == pytest.approx([30.0 * 2 * PER_ROUND / CLIENTS / 1024, 90 / CLIENTS / 1024])
    assert fml.paper == []
    fig = tradeoff_figure(setting)
    traffic, compute = fig.axes[:2]
    assert traffic.get_xlabel().startswith("MiB sent and received per client")
    assert compute.get_xlabel().startswith("local training GFLOPs per client")
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["fedavg", "fml", "paper's point"]
    pyplot().close("all")


def test_the_html_report_holds_the_figure_and_the_points_table_and_markdown_its_file(runs, tmp_path):
    out = tmp_path / "report.html"
    assert run_cli("report", str(runs), "--output", str(out)) == 0
    text = out.read_text()
    page = Page(text)
    assert "Trade-off: DigitsData, test_acc" in page.cells
    assert '<img alt="accuracy against communication and compute: fedavg, fml" src="data:image/png;base64,' in text
    start = page.rows.index(["method", "metric", "runs", "final (mean)", "MiB per client (mean)",
                             "GFLOPs per client (mean)", "paper's points"])  # fmt: skip
    fedavg, fml = page.rows[start + 1 : start + 3]
    finals = [read_summary(runs / "fedavg" / f"seed{s}")["final"]["global/test_acc"] for s in (0, 1)]
    mib = 2 * 2 * PER_ROUND * mlp_bytes(32) / CLIENTS / MIB
    gflops = 2 * PER_ROUND * STEPS * mlp_step_flops(32) / CLIENTS / 1e9
    paper = f"0.8 at {30.0 * 2 * PER_ROUND / CLIENTS / 1024:.4g} MiB (CO/c/r 30 KiB x 2 rounds); "
    paper += f"0.5 at {90 / CLIENTS / 1024:.4g} MiB (CO 90 KiB to 0.5)"
    assert fedavg == ["fedavg", "global/test_acc", "2", f"{sum(finals) / 2:.4f}", f"{mib:.4f}", f"{gflops:.4f}", paper]
    assert fml[:3] == ["fml", "personal/test_acc", "1"] and fml[-1] == "none stated"  # its own monitor
    # the trade-off comes before the experiments' own sections
    assert text.index("Trade-off: DigitsData") < text.index("<h2>fedavg</h2>")
    assert run_cli("report", str(runs), "--output", str(tmp_path / "report.md")) == 0
    markdown = (tmp_path / "report.md").read_text()
    assert "## Trade-off: DigitsData, test_acc" in markdown
    assert (tmp_path / "report_figures" / "DigitsData__test_acc_tradeoff.png").is_file()
    assert f"| fedavg | global/test_acc | 2 | {sum(finals) / 2:.4f} | {mib:.4f} | {gflops:.4f} |" in markdown


def test_one_experiment_draws_no_tradeoff_and_another_data_set_is_another_setting(runs, tmp_path):
    assert build_report([str(runs / "fml")])["tradeoffs"] == []
    other = write_recipe(
        tmp_path / "other.yaml",
        rounds=2,
        eval_every=1,
        data={"class_path": "fl_lightning.data.DigitsData", "init_args": {"test_fraction": 0.3}},
    )
    for seed, name in ((0, "a"), (0, "b")):
        argv = ["fit", "--config", str(other), "--name", name, "--output_dir", str(tmp_path / "runs" / name)]
        assert run_cli(*argv, "--seed", str(seed)) == 0
    titles = [t["setting"].title for t in build_report([str(runs), str(tmp_path / "runs")])["tradeoffs"]]
    # both on digits: the keys their data blocks differ in tell them apart
    assert len(titles) == 2 and all(t.startswith("DigitsData, test_acc (") for t in titles)
    assert any("test_fraction=0.3" in t for t in titles)


def test_a_name_from_a_file_is_text_in_the_tradeoff(runs, tmp_path):
    import shutil

    evil = "<script>alert(1)</script>"
    shutil.copytree(runs, tmp_path / "runs")
    path = tmp_path / "runs" / "fml" / "seed0" / "summary.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "name": evil}))
    out = tmp_path / "report.html"
    assert run_cli("report", str(tmp_path / "runs"), "--output", str(out)) == 0
    page = Page(out.read_text())
    assert page.tags <= REPORT_TAGS and evil in page.cells


def test_runs_without_compute_or_population_are_named_not_drawn(runs, tmp_path):
    import shutil

    shutil.copytree(runs, tmp_path / "runs")
    old = tmp_path / "runs" / "fml" / "seed0" / "metrics.csv"  # as a run written before the compute estimate
    table = metrics_rows(old.parent)
    with open(old, "w", newline="") as f:
        writer = csv.DictWriter(f, [k for k in table[0] if not k.startswith("compute/")], extrasaction="ignore")
        writer.writeheader()
        writer.writerows(table)
    config = tmp_path / "runs" / "fedavg" / "seed1" / "config.yaml"  # a recipe that names no population size
    config.write_text(config.read_text().replace("num_clients: 8", "num_clients: null"))
    (tradeoff,) = build_report([str(tmp_path / "runs")])["tradeoffs"]
    assert tradeoff["setting"].notes == [
        "1 of 3 runs are not drawn: their config.yaml names no population size or metrics.csv has no evaluated "
        "round with the metric and the traffic.",
        "1 of 2 runs recorded no local training FLOPs (no compute/train_flops in metrics.csv: an older run, or a "
        "model whose step could not be counted, as summary.json's compute says) and are left out of the compute "
        "panel.",
    ]


# ------------------------------------------------------------------ readable for many methods
def test_x_axes_turn_logarithmic_where_values_span_two_decades_and_keep_a_method_sending_nothing():
    assert x_scale([1.0, 50.0]) == ("linear", {})
    assert x_scale([0.01, 5.0]) == ("log", {})
    scale, options = x_scale([0.0, 0.03, 40.0])  # Standalone sends nothing: 0 stays on the axis
    assert scale == "symlog" and options["linthresh"] == pytest.approx(0.01)
    assert x_scale([]) == ("linear", {})


def test_twenty_five_methods_get_distinct_colour_and_marker_pairs_and_one_legend_entry_each():
    methods = []
    for i in range(25):
        curve = RunCurve("r", f"m{i}", 0, "acc", [1.0, 2.0], [0.5, 0.6], [10.0**i / 1e6, 2 * 10.0**i / 1e6], None)
        methods.append(Method(f"method {i}", "acc", [curve], [PaperPoint(0.7, 1.0, "CO")] if i == 3 else []))
    fig = tradeoff_figure(Setting("many", methods))
    assert len(fig.axes) == 1  # no run recorded compute: the traffic panel alone
    (legend,) = fig.legends
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts == [f"method {i}" for i in range(25)] + ["paper's point"]
    styles = {(tuple(h.get_color()), h.get_marker()) for h in legend.legend_handles[:25]}
    assert len(styles) == 25
    assert fig.axes[0].get_xscale() == "log"  # 1e-6 to 2e18 MiB
    pyplot().close("all")


@pytest.mark.slow  # a paper table's tiny runs: half a minute
def test_a_paper_table_draws_each_settings_methods_with_the_papers_points(tmp_path):
    """A digits FedGH run given paper 004's FedGH / CIFAR-10 cell: its curve and the paper's two points, placed
    with the run's 15 clients and 2 rounds; the other CIFAR-10 methods with their stated points only."""
    reference = {
        "paper": "paper-004 (Yi et al., FedGH)",
        "table": "Table 3",
        "row": "FedGH",
        "column": "CIFAR-10",
        "metrics": {
            "personal/test_acc": 0.976,
            "comm/kib_per_client_round": 23.45,
            "comm/kib_to/personal/test_acc@0.9": 468.91,
        },
    }
    run = tmp_path / "runs" / "fedgh"
    argv = ["fit", "--config", str(ROOT / "recipes/digits_fedgh.yaml"), "--rounds", "2", "--eval_every", "1"]
    argv += ["--output_dir", str(run), "--runtime.progress", "false", "--reference", json.dumps(reference)]
    assert run_cli(*argv) == 0
    out = tmp_path / "table.html"
    assert run_cli("report", str(tmp_path / "runs"), "--table", "paper-004/table-3", "--output", str(out)) == 0
    from fl_lightning.report.tables import build_table

    table = build_table([str(tmp_path / "runs")], "paper-004/table-3")
    titles = [t["setting"].title for t in table["tradeoffs"]]
    assert titles == ["paper-004/table-3: CIFAR-10", "paper-004/table-3: CIFAR-100"]
    cifar10 = table["tradeoffs"][0]["setting"]
    fedgh = next(m for m in cifar10.methods if m.label == "FedGH")
    (curve,) = fedgh.curves
    traffic = [(float(r["comm/uplink_bytes"]) + float(r["comm/downlink_bytes"])) / 15 / MIB for r in metrics_rows(run)]
    assert curve.mib == pytest.approx(traffic) and curve.rounds == [1.0, 2.0]
    assert [p.acc for p in fedgh.paper] == [0.976, 0.9]
    assert [p.mib for p in fedgh.paper] == pytest.approx([23.45 * 2 / 1024, 468.91 / 15 / 1024])
    assert all(not m.curves and m.paper for m in cifar10.methods if m.label != "FedGH")  # not run: the paper's
    page = Page(out.read_text())
    assert "Trade-off: paper-004/table-3: CIFAR-10" in page.cells and page.tags <= REPORT_TAGS | {"b", "br", "span"}


def test_wandb_run_logs_the_tradeoff_figure_offline(runs, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    assert run_cli("report", str(runs), "--output", str(tmp_path / "report.html"), "--wandb_run") == 0
    media = list((tmp_path / "report_wandb/wandb").glob("offline-run-*/files/media/images/tradeoff/*.png"))
    assert len(media) == 1 and media[0].read_bytes()[:4] == b"\x89PNG"
