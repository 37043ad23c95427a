"""The how-to pages' code runs as written: a user's own model builder and data set, trusted, in a recipe."""

import json
import sys

import numpy as np
import pytest
import yaml
from conftest import ROOT, run_cli
from doc_blocks import page_blocks

HOWTO = ROOT / "docs" / "howto"


def _blocks(page: str, language: str) -> list[str]:
    return [b.code for b in page_blocks((HOWTO / page).read_text()) if b.language == language]


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """The user's folder on sys.path, its modules trusted, as the pages' `export` lines set them."""
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    yield tmp_path
    for name in ("my_models", "my_data"):
        sys.modules.pop(name, None)


def test_the_own_model_page_builder_trains_in_a_recipe(user_folder, monkeypatch):
    (user_folder / "my_models.py").write_text(_blocks("own_model.md", "python")[0])
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "my_models")
    out = user_folder / "run"
    models = "{global: {builder: my_models.tiny_cnn, args: {width: 2}}}"
    code = run_cli("fit", "--config", str(ROOT / "recipes/quickstart.yaml"), "--models", models, "--rounds", "3",
                   "--eval_every", "3", "--output_dir", str(out), "--runtime.progress", "false")  # fmt: skip
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert 0.0 <= summary["final"]["global/test_acc"] <= 1.0
    assert "my_models.tiny_cnn" in (out / "config.yaml").read_text()


def test_the_own_model_page_refuses_the_builder_without_trust(user_folder, monkeypatch, capsys):
    (user_folder / "my_models.py").write_text(_blocks("own_model.md", "python")[0])
    monkeypatch.delenv("FLRUN_TRUSTED_MODULES", raising=False)
    code = run_cli("fit", "--config", str(ROOT / "recipes/quickstart.yaml"), "--models",
                   "{global: {builder: my_models.tiny_cnn}}", "--output_dir", str(user_folder / "run"))  # fmt: skip
    assert code == 2 and "FLRUN_TRUSTED_MODULES" in capsys.readouterr().err


def test_the_own_data_page_class_and_recipe_block_run_on_a_real_npz(user_folder, monkeypatch):
    my_data, make_file = _blocks("own_data.md", "python")[:2]
    (user_folder / "my_data.py").write_text(my_data)
    exec(make_file, {"__name__": "__main__"})  # the page's block that writes data/my_data.npz from digits
    with np.load(user_folder / "data/my_data.npz") as f:
        assert f["x_train"].shape == (1400, 1, 8, 8) and f["x_test"].shape == (397, 1, 8, 8)
    recipe = yaml.safe_load(_blocks("own_data.md", "yaml")[0])
    assert recipe["data"]["class_path"] == "my_data.NpzData"
    (user_folder / "my_data.yaml").write_text(yaml.safe_dump(recipe))
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "my_data")
    out = user_folder / "run"
    code = run_cli(
        "fit", "--config", str(ROOT / "recipes/quickstart.yaml"), "--config", "my_data.yaml",
        "--rounds", "20", "--eval_every", "20", "--output_dir", str(out), "--runtime.progress", "false",
    )  # fmt: skip
    assert code == 0
    final = json.loads((out / "summary.json").read_text())["final"]
    assert final["global/test_acc"] > 0.8  # real digits: 20 rounds of FedAvg learn them (chance: 0.1)
    assert "global/val_acc" in final  # the block's local_split holds a val share
    partition = json.loads((out / "partition.json").read_text())
    assert partition  # 20 clients partitioned from the user's file


def test_the_own_data_page_class_names_a_missing_file_in_one_sentence(user_folder, monkeypatch, capsys):
    (user_folder / "my_data.py").write_text(_blocks("own_data.md", "python")[0])
    (user_folder / "my_data.yaml").write_text(_blocks("own_data.md", "yaml")[0])
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "my_data")
    code = run_cli("fit", "--config", str(ROOT / "recipes/quickstart.yaml"), "--config", "my_data.yaml",
                   "--output_dir", str(user_folder / "run"), "--runtime.progress", "false")  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "data/my_data.npz does not exist" in err and "Traceback" not in err
