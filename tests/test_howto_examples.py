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
    for name in ("my_models", "my_data", "my_wine"):
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


def _own_data_files(name: str) -> tuple[str, str]:
    """The own-data page's recipe block saved as ``name`` and the Python block before it (the one writing its file)."""
    writer, blocks = None, page_blocks((HOWTO / "own_data.md").read_text())
    for block in blocks:
        if block.language == "python" and block.file_name is None:
            writer = block.code
        if block.file_name == name:
            assert writer is not None, f"no block writes the file of {name}"
            return writer, block.code
    raise AssertionError(f"own_data.md has no block saved as {name}")


@pytest.mark.parametrize(
    "name, least",
    [("my_data.yaml", 0.8), ("my_table.yaml", 0.85), ("my_images.yaml", 0.8), ("my_hub.yaml", 0.8)],
)  # digits (chance 0.1) three ways; breast cancer's larger class is 63 %
def test_the_own_data_page_built_in_classes_fit_on_the_files_its_blocks_write(user_folder, name, least):
    writer, recipe = _own_data_files(name)
    exec(writer, {"__name__": "__main__"})  # the page's block writing the file, in the user's folder
    (user_folder / name).write_text(recipe)
    out = user_folder / "run"
    code = run_cli(
        "fit", "--config", str(ROOT / "recipes/quickstart.yaml"), "--config", name,
        "--rounds", "20", "--eval_every", "20", "--output_dir", str(out), "--runtime.progress", "false",
    )  # fmt: skip
    assert code == 0
    final = json.loads((out / "summary.json").read_text())["final"]
    assert final["global/test_acc"] > least
    assert yaml.safe_load(recipe)["data"]["class_path"] in (out / "config.yaml").read_text()


def test_the_own_data_page_npz_splits_and_names_a_missing_file_in_one_sentence(user_folder, capsys):
    writer, recipe = _own_data_files("my_data.yaml")
    exec(writer, {"__name__": "__main__"})
    with np.load(user_folder / "data/my_data.npz") as f:
        assert f["x_train"].shape == (1400, 1, 8, 8) and f["x_test"].shape == (397, 1, 8, 8)
    (user_folder / "data/my_data.npz").unlink()
    (user_folder / "my_data.yaml").write_text(recipe)
    code = run_cli("fit", "--config", str(ROOT / "recipes/quickstart.yaml"), "--config", "my_data.yaml",
                   "--output_dir", str(user_folder / "run"), "--runtime.progress", "false")  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "data/my_data.npz does not exist; save your data there" in err and "Traceback" not in err


def test_the_own_data_page_class_of_your_own_trains_in_its_recipe(user_folder, monkeypatch):
    blocks = page_blocks((HOWTO / "own_data.md").read_text())
    files = {b.file_name: b.code for b in blocks if b.file_name in ("my_wine.py", "my_wine.yaml")}
    for name, code in files.items():
        (user_folder / name).write_text(code)
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "my_wine")
    out = user_folder / "run"
    code = run_cli(
        "fit", "--config", str(ROOT / "recipes/quickstart.yaml"), "--config", "my_wine.yaml",
        "--rounds", "10", "--eval_every", "10", "--output_dir", str(out), "--runtime.progress", "false",
    )  # fmt: skip
    assert code == 0
    assert json.loads((out / "summary.json").read_text())["final"]["global/test_acc"] > 0.8  # wine: chance 0.4
    assert json.loads((out / "partition.json").read_text())["num_clients"] == 5
