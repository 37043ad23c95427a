"""benchmarks/privacy_table.py: the privacy-utility table's cells are the runs' own values, a refusal says why."""

import importlib.util

import pytest
from conftest import ROOT

pytest.importorskip("dp_accounting")  # the `privacy` extra, part of `dev`


@pytest.fixture(scope="module")
def privacy_table():
    spec = importlib.util.spec_from_file_location("privacy_table", ROOT / "benchmarks/privacy_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_row_holds_each_epsilons_run_and_the_run_without_privacy(privacy_table, tmp_path):
    from fl_lightning.run.arguments import fit_from_argv

    out = tmp_path / "table.md"
    argv = ["--methods", "fedavg", "--epsilons", "8", "inf", "--seeds", "0", "--rounds", "1", "--out", str(out)]
    assert privacy_table.main(argv) == 0
    text = out.read_text()
    assert "| method | uploads | noise | clip | ε = 8 | no privacy |" in text
    row = next(line for line in text.splitlines() if line.startswith("| FedAvg |"))
    # the same run made directly: its accuracy and calibrated noise multiplier are the epsilon-8 cell's
    direct = fit_from_argv(
        ["--config", str(ROOT / "recipes/quickstart.yaml"), "--seed", "0", "--rounds", "1", "--eval_every", "1"]
        + ["--sampler", "PoissonSampler", "--sampler.rate", "0.5", "--privacy.where", "server"]
        + ["--privacy.clip", "0.5", "--privacy.target_epsilon", "8", "--privacy.delta", "1e-3"]
        + ["--output_dir", str(tmp_path / "direct"), "--runtime.progress", "false"]
    )
    privacy = direct["privacy"]
    assert privacy["epsilon"] <= 8.0 and privacy["sampling_rate"] == 0.5
    eps8 = f"{direct['final']['global/test_acc']:.3f} (z {privacy['noise_multiplier']:.3g})"
    cells = row.strip("| ").split(" | ")
    assert cells[:4] == ["FedAvg", "weight change", "server", "0.5"]
    assert cells[4] == eps8 and "(z" not in cells[5]  # without privacy: no noise multiplier


def test_a_method_privacy_refuses_shows_the_sentence(privacy_table, tmp_path, monkeypatch):
    label, recipe, payload, _, clip, flags = privacy_table.METHODS["fedgh"]
    monkeypatch.setitem(privacy_table.METHODS, "fedgh", (label, recipe, payload, "server", clip, flags))
    text = privacy_table.table(["fedgh"], ["8"], [0], 1, tmp_path)
    assert "| refused: privacy where: server needs an aggregate that is a sum or mean of the uploads" in text
