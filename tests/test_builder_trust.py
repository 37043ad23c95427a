"""A recipe's `models.<role>.builder` only calls trusted code: registered builders, installed entry points,
or modules named in FLRUN_TRUSTED_MODULES; and what is called must return a FeatureClassifier."""

import os
import textwrap

import pytest

from fl_lightning.federation.errors import ConfigError
from fl_lightning.models import FeatureClassifier, ModelSpec

MODULE = """
from pathlib import Path
from torch import nn
from fl_lightning.models import FeatureClassifier

Path({marker!r}).write_text("imported")  # a side effect at import: proves whether the module was imported

def good(num_classes=10, hidden=4):
    return FeatureClassifier(nn.Linear(64, hidden), nn.Linear(hidden, num_classes), hidden, num_classes)

def not_a_model(num_classes=10):
    return nn.Linear(64, num_classes)
"""


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    """A module `lab_models` on sys.path, writing `imported.txt` when it is imported."""
    marker = tmp_path / "imported.txt"
    (tmp_path / "lab_models.py").write_text(MODULE.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("FLRUN_TRUSTED_MODULES", raising=False)
    yield marker
    import sys

    sys.modules.pop("lab_models", None)


def test_os_system_in_a_recipe_is_refused_before_anything_runs(monkeypatch):
    calls = []
    monkeypatch.setattr(os, "system", lambda command: calls.append(command) or 0)
    monkeypatch.delenv("FLRUN_TRUSTED_MODULES", raising=False)
    with pytest.raises(ConfigError) as err:
        ModelSpec("os.system", {"command": "touch /tmp/pwned"}).build(num_classes=10)
    assert calls == []
    message = str(err.value)
    assert "'os.system' is neither a registered builder nor in a trusted module" in message
    assert "'fl_lightning.models' entry point group" in message and "FLRUN_TRUSTED_MODULES=os" in message
    assert "\n" not in message


def test_flrun_fit_refuses_an_untrusted_builder_with_exit_2(tmp_path, capfd):
    from conftest import run_cli, write_recipe

    victim = tmp_path / "pwned"
    models = {"global": {"builder": "os.system", "args": {"command": f"touch {victim}"}}}
    recipe = write_recipe(tmp_path / "evil.yaml", models=models)
    rc = run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run"))
    err = capfd.readouterr().err
    assert rc == 2 and not victim.exists()
    assert "neither a registered builder nor in a trusted module" in err and err.count("\n") == 1


def test_an_untrusted_module_is_not_even_imported(user_module):
    with pytest.raises(ConfigError, match="FLRUN_TRUSTED_MODULES=lab_models"):
        ModelSpec("lab_models.good").build(num_classes=3)
    assert not user_module.exists()


def test_trusted_modules_are_callable_and_must_return_a_feature_classifier(user_module, monkeypatch):
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "other_pkg, lab_models")
    model = ModelSpec("lab_models.good", {"hidden": 5}).build(num_classes=3)
    assert isinstance(model, FeatureClassifier) and model.feature_dim == 5 and model.num_classes == 3
    assert user_module.exists()
    refused = "returned Linear, neither a FeatureClassifier .*nor a LightningModule; wrap your network"
    with pytest.raises(ConfigError, match=refused):
        ModelSpec("lab_models.not_a_model").build(num_classes=3)


def test_trust_is_by_module_prefix_not_by_string_prefix(user_module, monkeypatch):
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "lab")  # `lab` trusts lab.x, not lab_models
    with pytest.raises(ConfigError, match="nor in a trusted module"):
        ModelSpec("lab_models.good").build(num_classes=3)
    assert not user_module.exists()


def test_an_installed_entry_point_is_a_trusted_builder_by_name(user_module, tmp_path, monkeypatch):
    dist = tmp_path / "lab_models_pkg-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: lab-models-pkg\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent(
            """\
            [fl_lightning.models]
            lab_cnn = lab_models:good
            lab_linear = lab_models:not_a_model
            """
        )
    )
    from fl_lightning.models import registered_models

    assert {"lab_cnn", "lab_linear", "digits_mlp"} <= set(registered_models())
    assert ModelSpec("lab_cnn").build(num_classes=7).num_classes == 7
    with pytest.raises(ConfigError, match="neither a FeatureClassifier"):
        ModelSpec("lab_linear").build(num_classes=7)


def test_registered_names_still_work_and_unknown_names_list_them():
    assert ModelSpec("digits_mlp", {"hidden": 8}).build(num_classes=10).num_classes == 10
    with pytest.raises(ConfigError, match=r"unknown model builder 'digits_mpl'\. Did you mean digits_mlp"):
        ModelSpec("digits_mpl").build()
