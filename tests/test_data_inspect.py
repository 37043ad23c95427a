"""``flrun data inspect``: the partition's statistics, and its chart written where a user expects it.

The chart goes to ``--output`` or to ``runs/inspect/<name>_seed<k>.png``: never into a run's folder (a later
``flrun fit`` there would be refused) and never over a chart the user did not name. It is written through a
temporary file and a rename, and its axes name only clients and classes that exist.
"""

import numpy as np
import pytest
from conftest import ROOT, run_cli

from fl_lightning.data.inspect import chart_figure, index_ticks, save_figure

QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")
PNG = b"\x89PNG\r\n\x1a\n"


def test_it_prints_statistics_and_writes_the_named_chart(tmp_path, capsys):
    chart = tmp_path / "chart.png"
    assert run_cli("data", "inspect", "--config", str(ROOT / "recipes/digits_fedgh.yaml"), "--output", str(chart)) == 0
    out = capsys.readouterr().out
    assert "15 clients, 10 classes" in out and "classes per client: mean 2.0" in out
    assert f"client-by-class chart: {chart}\n" in out
    assert chart.read_bytes()[:8] == PNG


def test_the_default_chart_goes_to_runs_inspect_and_a_second_never_replaces_the_first(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert run_cli("data", "inspect", "--config", QUICKSTART) == 0
    first = tmp_path / "runs/inspect/quickstart_seed0.png"
    assert "client-by-class chart: runs/inspect/quickstart_seed0.png\n" in capsys.readouterr().out
    before = first.read_bytes()
    assert before[:8] == PNG
    # another partition of the same recipe and seed: a new name, said on the line that names the chart
    assert (
        run_cli("data", "inspect", "--config", QUICKSTART, "--data.init_args.partitioner.init_args.alpha", "0.1") == 0
    )
    assert (
        "client-by-class chart: runs/inspect/quickstart_seed0_2.png (runs/inspect/quickstart_seed0.png is kept; "
        "--output names the file to write)" in capsys.readouterr().out
    )
    assert first.read_bytes() == before
    second = (tmp_path / "runs/inspect/quickstart_seed0_2.png").read_bytes()
    assert second[:8] == PNG and second != before  # alpha 0.1 is another partition: another picture
    assert sorted(p.name for p in (tmp_path / "runs").rglob("*")) == ["inspect", "quickstart_seed0.png",
                                                                       "quickstart_seed0_2.png"]  # fmt: skip


def test_a_later_fit_into_the_recipe_s_folders_is_not_refused(tmp_path, monkeypatch):
    """The own-data how-to's order: inspect, then fit into a folder of the recipe's name (inspect's chart used
    to land in runs/<name>/, and the fit was refused as a folder holding no run)."""
    monkeypatch.chdir(tmp_path)
    assert run_cli("data", "inspect", "--config", QUICKSTART) == 0
    assert run_cli("data", "inspect", "--config", QUICKSTART, "--output_dir", "runs/mine") == 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["inspect"]  # --output_dir is fit's
    for folder in ("runs/quickstart", "runs/mine"):
        code = run_cli("fit", "--config", QUICKSTART, "--rounds", "1", "--output_dir", folder,
                       "--runtime.progress", "false")  # fmt: skip
        assert code == 0


def test_a_named_chart_is_replaced_whole_and_a_failed_write_keeps_the_old_one(tmp_path, monkeypatch):
    import matplotlib.figure

    counts = np.array([[3, 0], [1, 2]])
    path = tmp_path / "chart.png"
    path.write_bytes(b"old chart")
    fig = chart_figure(counts)
    assert save_figure(fig, path, replace=True) == path
    assert path.read_bytes()[:8] == PNG

    def broken_savefig(self, target, **kwargs):
        target.write(b"half a ch")  # a full disk, a killed process: the write stops half way
        raise OSError(28, "No space left on device")

    written = path.read_bytes()
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", broken_savefig)
    with pytest.raises(OSError):
        save_figure(fig, path, replace=True)
    assert path.read_bytes() == written  # the reader sees the old chart, never half of the new one
    assert sorted(p.name for p in tmp_path.iterdir()) == ["chart.png"]  # no temporary file left behind


def test_the_axes_name_only_existing_clients_and_classes():
    fig = chart_figure(np.array([[5, 0, 1], [0, 2, 0]]))  # 2 clients, 3 classes
    ax = fig.axes[0]
    assert list(ax.get_xticks()) == [0, 1] and list(ax.get_yticks()) == [0, 1, 2]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["0", "1", "2"]
    many = chart_figure(np.ones((120, 10), dtype=int)).axes[0]
    assert list(many.get_yticks()) == list(range(10))  # classes 0..9: no 10, no -1
    assert list(many.get_xticks()) == list(range(0, 120, 5))  # 24 ticks (at most 25), none past client 119


def test_index_ticks_keep_at_most_the_asked_number_inside_the_range():
    assert index_ticks(10) == list(range(10))
    assert index_ticks(26) == list(range(0, 26, 2))
    assert index_ticks(51) == list(range(0, 51, 5))
    assert index_ticks(3400) == list(range(0, 3400, 200))
    for n in (1, 7, 25, 26, 99, 100, 101, 1000, 12345):
        ticks = index_ticks(n)
        assert 0 < len(ticks) <= 25 and ticks[0] == 0 and ticks[-1] <= n - 1


def test_an_output_in_a_run_folder_is_refused_and_the_folder_left_as_it_was(tmp_path, capsys):
    run = tmp_path / "runs" / "seed0"
    run.mkdir(parents=True)
    (run / "summary.json").write_text("{}")  # a run is there
    assert run_cli("data", "inspect", "--config", QUICKSTART, "--output", str(run / "partition.png")) == 2
    err = capsys.readouterr().err
    assert f"--output {run / 'partition.png'} lies in the run folder {run}, which holds a run's files" in err
    assert sorted(p.name for p in run.iterdir()) == ["summary.json"]
