"""A user's own LightningModule as a client model: trained by the same Fabric loop (the how-to page's module
reaches the built-in digits_cnn's weights exactly), exchanged by the same methods, refused in one sentence
where a method needs what it does not declare."""

import re

import pytest
import torch
import yaml
from conftest import ROOT, read_summary, write_recipe

import fl_lightning
from fl_lightning.federation.errors import ConfigError
from fl_lightning.run.checkpoint import load_checkpoint
from fl_lightning.run.recipes import load_recipe

HOWTO = ROOT / "docs" / "howto" / "lightning_module.md"

CASES = '''
import lightning.pytorch as L
import torch
import torch.nn.functional as F
from torch import nn


class Whole(L.LightningModule):
    """No features / head split: whole-model methods only."""

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, num_classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return {"loss": F.cross_entropy(self(x), y), "log": "anything"}

    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=0.1)]


class Scheduled(Whole):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": optimizer, "lr_scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1)}


class Frozen(Whole):
    """Whole with learning rate 0: the untrained baseline of the same run."""

    def configure_optimizers(self):
        return [torch.optim.SGD(self.parameters(), lr=0.0)]


class NoLoss(Whole):
    def training_step(self, batch, batch_idx):
        return None


def plain_network(num_classes: int = 10):
    return nn.Sequential(nn.Flatten(), nn.Linear(64, num_classes))
'''


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """The how-to page's module as my_lightning.py and the cases above, importable and trusted."""
    (code,) = re.findall(r"```python\n(.*?)```", HOWTO.read_text(), flags=re.DOTALL)
    (tmp_path / "my_lightning.py").write_text(code)
    (tmp_path / "lightning_cases.py").write_text(CASES)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "conftest,my_lightning,lightning_cases")
    return tmp_path


def global_weights(run):
    return load_checkpoint(run / "checkpoints" / "last.ckpt")["strategy"]["global_weights"]["global"]


def test_the_howto_module_trains_to_the_built_in_models_weights_on_digits(user_modules, tmp_path):
    """The quickstart (FedAvg, digits_cnn, SGD with momentum, cosine schedule) and the same recipe with the
    role's builder swapped for the page's LightningModule: same seed, optimizer and steps, same weights."""
    quickstart = str(ROOT / "recipes" / "quickstart.yaml")
    common = {"rounds": 4, "eval_every": 2, "runtime": {"progress": False}}
    builtin = fl_lightning.fit(config=quickstart, output_dir=str(tmp_path / "builtin"), **common)
    lightning = fl_lightning.fit(
        config=quickstart,
        output_dir=str(tmp_path / "lightning"),
        **{"models.global.builder": "my_lightning.DigitsCNN"},
        **common,
    )
    config = yaml.safe_load((tmp_path / "lightning" / "config.yaml").read_text())
    assert config["models"]["global"] == {
        "builder": "my_lightning.DigitsCNN",
        "args": {"width": 1.0},
        "projection_dim": None,
    }
    ours, theirs = global_weights(tmp_path / "builtin"), global_weights(tmp_path / "lightning")
    assert list(ours) == list(theirs) == ["features.0.weight", "features.0.bias", "features.2.weight",
                                          "features.2.bias", "features.6.weight", "features.6.bias",
                                          "head.weight", "head.bias"]  # fmt: skip
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert lightning["final"] == builtin["final"] and builtin["final"]["global/test_acc"] > 0.5  # it learned


def swapped(recipe: str, out):
    """A digits recipe with every client role's model replaced by the page's LightningModule (its width, and the
    recipe's learning rate and momentum: the module brings its own optimizer); server-only roles kept."""
    spec = load_recipe(ROOT / "recipes" / f"{recipe}.yaml")
    spec.pop("reference", None)
    trained = {role for tier in spec["population"]["tiers"] for role in tier["roles"]}
    optimizer = spec.get("training", {}).get("optimizer", {}).get("init_args", {})
    for role in trained:
        args = {k: v for k, v in spec["models"][role].get("args", {}).items() if k == "width"}
        args.update({k: v for k, v in optimizer.items() if k in ("lr", "momentum")})
        spec["models"][role] = {"builder": "my_lightning.DigitsCNN", "args": args}
    path = out / f"{recipe}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return str(path)


QUICK = ["digits_fedproto", "digits_feddf", "digits_fedhe"]  # a split method, a server model, personal models
METHODS = [
    "digits_fedadam", "digits_fedhe_async", "digits_ondevice_kd", "digits_periodic_codist", "digits_merged_codist",
    "digits_felo", "digits_velo", "digits_fedgh", "digits_lg_fedavg", "digits_fml", "digits_fedkd", "digits_fd",
    "digits_dsfl", "digits_fedmd", "digits_fedgems", "digits_fedgkt", "digits_fedgen", "digits_fedtgp",
    "digits_fedl2g", "digits_fedmrl", "digits_fedktl", "digits_fedntd", "digits_fedetf", "digits_ccvr", "digits_fednh",
    "digits_fedhkd", "digits_fedpac", "digits_fpl", "digits_fedsa",
]  # fmt: skip


@pytest.mark.parametrize(
    "recipe", QUICK + [pytest.param(r, marks=pytest.mark.slow) for r in METHODS], ids=lambda r: r.split("_", 1)[1]
)
def test_every_method_but_the_model_specific_ones_runs_with_a_lightning_client(user_modules, tmp_path, recipe):
    summary = fl_lightning.fit(
        config=swapped(recipe, tmp_path), rounds=2, eval_every=2, output_dir=str(tmp_path / "run"),
        runtime={"progress": False},
    )  # fmt: skip
    assert summary["complete"] and 0.0 <= summary["final"][summary["monitor"]] <= 1.0


@pytest.mark.parametrize(
    "recipe, message",
    [
        ("digits_moon", "MOON needs a projection head on its model"),
        ("digits_heterofl", "HeteroFL needs width-sliceable models"),
        ("digits_fedpcl", "FedPCL needs unit-length projections"),  # its frozen_backbones' L2-normalised projection
    ],
)
def test_methods_needing_a_built_in_model_refuse_a_lightning_module(user_modules, tmp_path, recipe, message):
    with pytest.raises(ConfigError, match=message):
        fl_lightning.fit(config=swapped(recipe, tmp_path), rounds=1, output_dir=str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_a_module_without_features_and_head_runs_whole_model_methods_and_is_refused_by_split_ones(user_modules,
                                                                                                 tmp_path):  # fmt: skip
    whole = {"global": {"builder": "lightning_cases.Whole"}}
    recipe = write_recipe(tmp_path / "whole.yaml", models=whole, rounds=2)
    summary = fl_lightning.fit(config=str(recipe), output_dir=str(tmp_path / "fedavg"))
    frozen = {"global": {"builder": "lightning_cases.Frozen"}}
    untrained = fl_lightning.fit(config=str(recipe), models=frozen, output_dir=str(tmp_path / "untrained"))
    accuracy, baseline = summary["final"]["global/test_acc"], untrained["final"]["global/test_acc"]
    assert summary["complete"] and accuracy > baseline + 0.1, (accuracy, baseline)  # it learned
    fedproto = {"class_path": "fl_lightning.strategies.FedProto"}
    with pytest.raises(ConfigError) as refused:
        fl_lightning.fit(config=str(recipe), strategy=fedproto, output_dir=str(tmp_path / "fedproto"))
    assert str(refused.value).startswith(
        "FedProto reads every model's features and head apart, but model role 'global' is the LightningModule "
        "Whole without them; give it `features` and `head` submodules"
    )
    assert not (tmp_path / "fedproto").exists()


@pytest.mark.parametrize(
    "model, message",
    [
        (
            {"builder": "lightning_cases.Scheduled"},
            (
                "Scheduled (role 'global').configure_optimizers() returned a dict with optimizer, lr_scheduler; a "
                "client model trains with one optimizer and no scheduler here"
            ),
        ),
        (
            {"builder": "lightning_cases.NoLoss"},
            "model role 'global': NoLoss.training_step returned NoneType, not a loss",
        ),
        (
            {"builder": "lightning_cases.plain_network"},
            "model builder 'lightning_cases.plain_network' returned Sequential, neither a FeatureClassifier",
        ),
        (
            {"builder": "lightning_cases.Whole", "projection_dim": 16},
            "projection_dim replaces a FeatureClassifier's head (MOON's model), but model builder",
        ),
    ],
)
def test_a_module_the_loop_cannot_train_is_one_sentence(user_modules, tmp_path, model, message):
    recipe = write_recipe(tmp_path / "bad.yaml", models={"global": model}, rounds=1)
    with pytest.raises(ConfigError) as refused:
        fl_lightning.fit(config=str(recipe), output_dir=str(tmp_path / "run"))
    assert message in str(refused.value) and "\n" not in str(refused.value)


def test_the_batched_executor_trains_a_lightning_role_one_client_at_a_time(user_modules, tmp_path):
    recipe = write_recipe(tmp_path / "whole.yaml", models={"global": {"builder": "lightning_cases.Whole"}}, rounds=2)
    batched = fl_lightning.fit(str(recipe), output_dir=str(tmp_path / "batched"), **{"runtime.executor": "batched"})
    sequential = fl_lightning.fit(str(recipe), output_dir=str(tmp_path / "sequential"))
    reasons = read_summary(tmp_path / "batched")["executor"]["sequential_reasons"]
    assert list(reasons) == ["the role's LightningModule has its own training_step (not known to be pure)"]
    assert batched["executor"]["batched_fits"] == 0 and batched["final"] == sequential["final"]
