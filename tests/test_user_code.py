"""The user's own code failing inside ours: a builder, a LightningModule's hooks, a module's import, a Strategy
subclass's hooks. Each ends in one sentence naming the user's object and hook, then the user's own frames only
(their file and line, none of fl_lightning's), with exit status 3; a contract a module breaks (no parameters,
forward returning a tuple, a head of the wrong width) is named before the first step, with exit status 2."""

import re
import subprocess
import sys

import pytest
from conftest import ROOT, run_cli, write_recipe

USER_MODULE = """
import lightning.pytorch as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fl_lightning.data import FederatedData
from fl_lightning.strategies import FedAvg


class Net(L.LightningModule):
    def __init__(self, num_classes: int = 10, outputs: int | None = None):
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, outputs or num_classes))

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class NoParams(Net):
    def __init__(self, num_classes: int = 10):
        super().__init__(num_classes)
        self.net = nn.Flatten()

    def forward(self, x):
        return x[:, :10]


class TupleOut(Net):
    def forward(self, x):
        logits = self.net(x)
        return logits, x.flatten(1)


class WrongHead(Net):
    def __init__(self, num_classes: int = 10):
        super().__init__(num_classes, outputs=5)


def check_step(loss):
    raise RuntimeError("the step failed on purpose")


class StepRaises(Net):
    def training_step(self, batch, batch_idx):
        return check_step(super().training_step(batch, batch_idx))


class MyAvg(FedAvg):
    def aggregate(self, rnd, updates):
        metrics = super().aggregate(rnd, updates)
        return {"server/spread": metrics["server/missing"]}


class Missing(FederatedData):
    def load(self):
        return np.load("no_such_file.npz")


def build(num_classes: int = 10, width: int = 3):
    if width % 2:
        raise ValueError("width must be even")
    return Net(num_classes)
"""


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    """mymod.py (the cases above), broken_names.py (a NameError at module level) and broken_syntax.py, importable
    and trusted."""
    (tmp_path / "mymod.py").write_text(USER_MODULE)
    (tmp_path / "broken_names.py").write_text(
        "import torch\n\nWIDTH = 3\nDEPTH = WIDHT * 2\n\n\ndef build():\n    pass\n"
    )
    (tmp_path / "broken_syntax.py").write_text("def build(num_classes=10):\n    return (num_classes\n\nx = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("FLRUN_TRUSTED_MODULES", "mymod,broken_names,broken_syntax")
    yield tmp_path
    for name in ("mymod", "broken_names", "broken_syntax"):
        sys.modules.pop(name, None)


def fit_with(
    tmp_path, capfd, builder: str = "digits_mlp", args: dict | None = None, run: str = "run", **changes
) -> tuple[int, str]:
    models = {"global": {"builder": builder, "args": args or {}}}
    recipe = write_recipe(tmp_path / "recipe.yaml", rounds=1, eval_every=1, models=models, **changes)
    capfd.readouterr()
    rc = run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / run))
    return rc, capfd.readouterr().err


def line_of(tmp_path, module: str, text: str) -> int:
    lines = (tmp_path / f"{module}.py").read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_a_builder_raising_is_named_with_its_line_and_exit_status_3(user_code, capfd):
    rc, err = fit_with(user_code, capfd, "mymod.build")
    first, *frames = err.splitlines()
    assert rc == 3
    assert first == "flrun fit: error: your model builder mymod.build raised ValueError: width must be even"
    assert frames[0] == "Traceback of your code (most recent call last):"
    raise_line = line_of(user_code, "mymod", 'raise ValueError("width must be even")')
    assert f'File "{user_code / "mymod.py"}", line {raise_line}, in build' in err
    assert "fl_lightning" not in err and "site-packages" not in err
    assert not (user_code / "run" / "summary.json").exists()
    page = (ROOT / "docs" / "reference" / "errors.md").read_text()  # the page shows this case's first lines
    assert f"```text\n{first}\n{frames[0]}\n" in page and '    raise ValueError("width must be even")\n```' in page


def test_the_builders_own_arguments_still_decide_and_a_missing_one_is_the_recipes(user_code, capfd):
    rc, err = fit_with(user_code, capfd, "mymod.build", {"width": 4})
    assert rc == 0, err
    rc, err = fit_with(user_code, capfd, "mymod.build", {"depth": 4}, run="other")
    assert rc == 2 and "model builder 'mymod.build' has no argument(s) depth" in err


def test_a_module_without_parameters_is_refused_before_the_optimizer_is_made(user_code, capfd):
    rc, err = fit_with(user_code, capfd, "mymod.NoParams")
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(
        "flrun fit: error: model role 'global': the LightningModule NoParams has no trainable parameters; the "
        "framework trains it with an optimizer of its parameters"
    )
    assert "empty parameter list" not in err


def test_forward_returning_a_tuple_is_named_before_the_first_step(user_code, capfd):
    rc, err = fit_with(user_code, capfd, "mymod.TupleOut")
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith(
        "flrun fit: error: model role 'global': the LightningModule TupleOut.forward returned a tuple of 2, not a "
        "tensor; the framework evaluates every model on forward's output, which must be one tensor of [N, 10] logits"
    )
    assert "has no attribute 'dim'" not in err


def test_a_head_narrower_than_the_classes_is_named_before_the_first_step(user_code, capfd):
    rc, err = fit_with(user_code, capfd, "mymod.WrongHead")
    assert rc == 2 and err.count("\n") == 1
    assert "the LightningModule WrongHead.forward returned a tensor of shape [2, 5] for 2 examples" in err
    assert "for 2 examples of a data set of 10 classes; it must return [N, 10] logits" in err


def test_a_training_step_raising_shows_only_the_users_frames(user_code, capfd):
    rc, err = fit_with(user_code, capfd, "mymod.StepRaises")
    lines = err.splitlines()
    assert rc == 3
    assert lines[0] == (
        "flrun fit: error: your LightningModule mymod.StepRaises.training_step (model role 'global') raised "
        "RuntimeError: the step failed on purpose"
    )
    files = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', err)
    mymod = str(user_code / "mymod.py")
    assert files == [
        (mymod, str(line_of(user_code, "mymod", "return check_step(super()")), "training_step"),
        (mymod, str(line_of(user_code, "mymod", 'raise RuntimeError("the step')), "check_step"),
    ]


def test_a_trusted_module_failing_at_import_is_named_with_its_line(user_code, capfd):
    rc, err = fit_with(user_code, capfd, "broken_names.build")
    path = user_code / "broken_names.py"
    assert rc == 3
    assert err.splitlines()[0] == (
        "flrun fit: error: your module broken_names could not be imported: it raised NameError: name 'WIDHT' is not "
        f"defined (at {path}:4)"
    )
    assert f'File "{path}", line 4, in <module>' in err and "fl_lightning" not in err and "importlib" not in err


def test_a_syntax_error_names_the_file_and_line(user_code, capfd):
    rc, err = fit_with(user_code, capfd, "broken_syntax.build")
    assert rc == 3
    first = err.splitlines()[0]
    assert first.startswith(
        f"flrun fit: error: your module broken_syntax could not be imported: SyntaxError at "
        f"{user_code / 'broken_syntax.py'}:2: "
    )
    assert "fl_lightning" not in err


def test_a_strategy_subclass_raising_in_aggregate_is_named_with_its_line(user_code, capfd):
    rc, err = fit_with(user_code, capfd, strategy={"class_path": "mymod.MyAvg"})
    assert rc == 3
    assert err.splitlines()[0] == (
        "flrun fit: error: your Strategy mymod.MyAvg.aggregate raised KeyError: 'server/missing'"
    )
    line = line_of(user_code, "mymod", 'metrics["server/missing"]')
    assert re.findall(r'File "([^"]+)", line (\d+), in (\w+)', err) == [
        (str(user_code / "mymod.py"), str(line), "aggregate")
    ]


def test_a_data_set_whose_load_raises_is_named_with_its_line(user_code, capfd):
    rc, err = fit_with(user_code, capfd, data={"class_path": "mymod.Missing"})
    assert rc == 3
    assert err.splitlines()[0] == (
        "flrun fit: error: your data set mymod.Missing.load raised FileNotFoundError: [Errno 2] No such file or "
        "directory: 'no_such_file.npz'"
    )
    frames = re.findall(r'File "([^"]+)", line (\d+), in (\w+)', err)
    assert frames == [(str(user_code / "mymod.py"), str(line_of(user_code, "mymod", "np.load(")), "load")]


def test_a_class_paths_module_failing_at_import_is_named(user_code, capfd):
    """jsonargparse imports a recipe's class_path: a NameError at the top of its module is named as such."""
    rc, err = fit_with(user_code, capfd, strategy={"class_path": "broken_names.Strategy"})
    assert rc == 3
    path = user_code / "broken_names.py"
    assert err.splitlines()[0] == (
        "flrun fit: error: your module broken_names could not be imported: it raised NameError: name 'WIDHT' is not "
        f"defined (at {path}:4)"
    )
    assert "jsonargparse" not in err and "fl_lightning" not in err


def test_flrun_fit_exits_3_from_its_own_process(user_code, tmp_path):
    """The command as a user runs it: the sentence, the user's frames and status 3 from the process."""
    recipe = write_recipe(tmp_path / "recipe.yaml", rounds=1, models={"global": {"builder": "mymod.build"}})
    env = {"PYTHONPATH": f"{ROOT}:{tmp_path}", "FLRUN_TRUSTED_MODULES": "mymod", "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-m", "fl_lightning", "fit", "--config", str(recipe), "--output_dir", str(tmp_path / "run")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 3, done.stderr
    assert done.stderr.splitlines()[0].endswith("your model builder mymod.build raised ValueError: width must be even")
    assert "Traceback (most recent call last)" not in done.stderr and "fl_lightning" not in done.stderr
