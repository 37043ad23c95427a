"""The package's layout: old import paths keep working (saying where the module went), and a run recorded before
the move still resumes."""

import contextlib
import importlib
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, run_cli


@pytest.mark.parametrize(
    "old, new",
    [
        ("fl_lightning.fit_args", "fl_lightning.run.arguments"),
        ("fl_lightning.sampling", "fl_lightning.federation.sampling"),
        ("fl_lightning.schedules", "fl_lightning.federation.schedules"),
        ("fl_lightning.errors", "fl_lightning.federation.errors"),
        ("fl_lightning.recipes", "fl_lightning.run.recipes"),
        ("fl_lightning.ranks", "fl_lightning.distributed.ranks"),
        ("fl_lightning.run.messages", "fl_lightning.run.input_errors"),  # renamed: one meaning per name
        ("fl_lightning.sweep.run", "fl_lightning.sweep.driver"),
    ],
)
def test_a_moved_module_imports_under_its_old_path_as_the_same_module(old, new):
    # the first import of an old path in this process warns (the next test checks what it says)
    with pytest.warns(FutureWarning) if old not in sys.modules else contextlib.nullcontext():
        assert importlib.import_module(old) is importlib.import_module(new)


def test_an_old_path_warns_once_naming_its_new_path_and_the_release_that_drops_it():
    # a fresh process: this one may have imported the old path before
    code = (
        "import warnings; warnings.simplefilter('always')\n"
        "import fl_lightning.sampling\n"
        "import fl_lightning.sampling\n"
        "from fl_lightning.schedules import ConstantLR\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    lines = [line for line in done.stderr.splitlines() if "FutureWarning" in line]
    assert len(lines) == 2, done.stderr  # one per old path, however often it is imported
    assert "fl_lightning.sampling moved to fl_lightning.federation.sampling" in lines[0]
    assert "fl_lightning.schedules moved to fl_lightning.federation.schedules" in lines[1]
    assert all("the old path goes in fl-lightning 0.2.0" in line and line.startswith("<string>:") for line in lines)


def test_users_code_written_before_the_move_still_imports():
    from fl_lightning.errors import ConfigError
    from fl_lightning.recipes import load_recipe
    from fl_lightning.sampling import UniformSampler

    from fl_lightning.federation.errors import ConfigError as Current
    from fl_lightning.strategies import FedAvg

    assert ConfigError is Current and callable(load_recipe) and UniformSampler and FedAvg


def test_fl_lightning_fit_is_the_function_and_its_old_module_path_names_the_new_one():
    import fl_lightning
    from fl_lightning import fit
    from fl_lightning.run.api import fit_recipe

    assert fit is fl_lightning.fit and fit.__module__ == "fl_lightning" and callable(fit_recipe)
    moved = r"the module moved to fl_lightning\.run\.fit: import from there"
    with pytest.raises(ModuleNotFoundError, match=moved):
        import fl_lightning.fit
    with pytest.raises(ModuleNotFoundError, match=moved):
        from fl_lightning.fit import fit as old  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match=r"fl_lightning\.run\.fit"):
        importlib.import_module("fl_lightning.fit")
    assert fl_lightning.fit is fit  # a failed import of the old path leaves the function in place


def test_the_moved_codistillation_class_names_its_new_path():
    import fl_lightning.knowledge.codistill as old

    with pytest.raises(AttributeError, match=r"moved to fl_lightning\.strategies\.Codistillation"):
        old.Codistillation  # noqa: B018


def test_current_path_maps_old_class_paths_and_leaves_others():
    from fl_lightning.federation.release import current_path

    assert current_path("fl_lightning.sampling.UniformSampler") == "fl_lightning.federation.sampling.UniformSampler"
    assert current_path("fl_lightning.knowledge.codistill.Codistillation") == (
        "fl_lightning.strategies.codistillation.Codistillation"
    )
    assert current_path("fl_lightning.strategies.FedAvg") == "fl_lightning.strategies.FedAvg"
    assert current_path("torch.optim.SGD") == "torch.optim.SGD"


def test_a_recipe_naming_classes_at_their_old_paths_runs_and_resumes_a_run_recorded_with_them(tmp_path):
    recipe = yaml.safe_load((ROOT / "recipes/quickstart.yaml").read_text())
    recipe["sampler"]["class_path"] = "fl_lightning.sampling.UniformSampler"
    old = tmp_path / "old_paths.yaml"
    old.write_text(yaml.safe_dump(recipe))
    run = tmp_path / "run"
    common = ["--output_dir", str(run), "--runtime.progress", "false", "--eval_every", "2"]
    assert run_cli("fit", "--config", str(old), "--rounds", "2", *common) == 0
    # the same run resumed with the recipe at the new paths: the class path is the same class, not a change
    assert run_cli("fit", "--config", str(ROOT / "recipes/quickstart.yaml"), "--rounds", "4", "--resume", "auto",
                   *common) == 0  # fmt: skip
    assert [row.split(",")[0] for row in (run / "metrics.csv").read_text().splitlines()[1:]][-1] == "4"
