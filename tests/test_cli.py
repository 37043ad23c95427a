"""The command line: errors are one readable line with exit status 2; overrides and recipes parse."""

import os
import subprocess
import sys

import pytest
import yaml
from conftest import ROOT, TINY, write_recipe

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def flrun(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fl_lightning", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=[r.stem for r in RECIPES])
def test_every_recipe_parses(recipe):
    from fl_lightning.cli.commands import fit_parser

    parser = fit_parser()
    cfg = parser.parse_args(["--config", str(recipe)])
    init = parser.instantiate(cfg)
    assert init.strategy is not None and init.data is not None and init.models


def test_print_config_shows_overrides(tmp_path):
    result = flrun(
        "fit",
        "--config",
        str(ROOT / "recipes/quickstart.yaml"),
        "--seed",
        "7",
        "--rounds",
        "3",
        "--training.batch_size",
        "8",
        "--print_config",
    )
    assert result.returncode == 0, result.stderr
    config = yaml.safe_load(result.stdout)
    assert config["seed"] == 7 and config["rounds"] == 3 and config["training"]["batch_size"] == 8
    assert config["strategy"]["class_path"] == "fl_lightning.strategies.FedAvg"


def test_an_optimizer_named_without_lr_gets_its_own_default_and_none_named_gets_sgd(tmp_path):
    from fl_lightning.run.arguments import parse_fit

    recipe = yaml.safe_load((ROOT / "recipes/quickstart.yaml").read_text())
    recipe["training"]["optimizer"] = {"class_path": "torch.optim.Adam"}
    (tmp_path / "adam.yaml").write_text(yaml.safe_dump(recipe))
    (tmp_path / "child.yaml").write_text(yaml.safe_dump({"base": "adam.yaml", "rounds": 2}))
    del recipe["training"]["optimizer"]
    (tmp_path / "none.yaml").write_text(yaml.safe_dump(recipe))

    def optimizer(*argv):
        training = yaml.safe_load(parse_fit(list(argv))[2])["training"]
        return training["optimizer"]["class_path"], training["optimizer"]["init_args"]["lr"]

    for name in ("adam.yaml", "child.yaml"):  # the framework's SGD default lr (0.05) must not leak into Adam
        assert optimizer("--config", str(tmp_path / name)) == ("torch.optim.Adam", 0.001)
    assert optimizer("--config", str(tmp_path / "none.yaml")) == ("torch.optim.SGD", 0.05)
    assert optimizer("--config", str(tmp_path / "none.yaml"), "--training.optimizer.init_args.lr", "0.01") == (
        "torch.optim.SGD",
        0.01,
    )
    none = ("--config", str(tmp_path / "none.yaml"))
    # options of an unnamed optimizer are the default's: a sweep's best_recipe.yaml holds init_args alone
    recipe["training"]["optimizer"] = {"init_args": {"lr": 0.0626}}
    (tmp_path / "swept.yaml").write_text(yaml.safe_dump(recipe))
    assert optimizer("--config", str(tmp_path / "swept.yaml")) == ("torch.optim.SGD", 0.0626)
    assert optimizer(*none, "--training", "{local_epochs: 2}", "--training.optimizer.init_args.lr", "0.01") == (
        "torch.optim.SGD",
        0.01,
    )
    for named in (
        ["--training.optimizer.class_path", "torch.optim.Adam"],
        ["--training.optimizer", "torch.optim.Adam"],
    ):
        assert optimizer(*none, *named) == ("torch.optim.Adam", 0.001)


@pytest.mark.parametrize(
    ("command", "advice"),
    [("fit", "with --resume auto"), ("sweep", "to finish the study"), ("models", "interrupted.")],
)
def test_an_interrupt_says_what_continues_the_command(monkeypatch, capsys, command, advice):
    from fl_lightning.cli import commands as cli

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, command, interrupted)
    assert cli.main([command]) == 130
    err = capsys.readouterr().err
    assert err.startswith(f"flrun {command}: interrupted") and advice in err
    assert command == "fit" or "--resume" not in err  # only fit has --resume


def test_help_documents_knobs():
    result = flrun("fit", "--help")
    assert result.returncode == 0
    for knob in (
        "--seed",
        "--rounds",
        "--output_dir",
        "--resume",
        "--training.local_steps",
        "--population.num_clients",
        "--logger",
        "--runtime.num_threads",
    ):
        assert knob in result.stdout, knob


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--config", "missing.yaml"], "config file 'missing.yaml' does not exist"),
        (["--bogus", "1"], "unknown option --bogus"),
        (
            ["--strategy", "fl_lightning.strategies.NoSuchStrategy"],
            "class_path 'fl_lightning.strategies.NoSuchStrategy'",
        ),
        (["--rounds", "many"], "bad value 'many' for rounds: expected int"),
        (["--data.init_args.partitioner.init_args.alpha", "0.0001"], "raise alpha"),
        (["--models", "{global: {builder: digits_cnnn}}"], "unknown model builder 'digits_cnnn'"),
        (["--sampler.init_args.fraction", "2"], "sampler fraction must be in (0, 1]"),
        (
            ["--training.optimizer.init_args.momentun", "0.9"],
            (
                "torch.optim.SGD (training.optimizer) has no option 'momentun' (did you mean 'momentum'?); its "
                "options: lr, momentum, dampening,"
            ),
        ),
        (
            ["--training.optimizer", "torch.optim.Adam", "--training.optimizer.init_args.momentum", "0.9"],
            "torch.optim.Adam (training.optimizer) has no option 'momentum'; its options: lr, betas, eps,",
        ),
        (
            ["--models.global.args.hidden", "8", "--models.global.args.depth=2"],
            (
                "models.global.args takes a mapping, not one key at a time: give --models.global.args "
                "'{hidden: 8, depth: 2}' (or set it in the recipe)."
            ),
        ),
        (["--models.global.args", "5"], "bad value '5' for models.global.args: expected a mapping"),
    ],
)
def test_errors_are_one_line_without_traceback(tmp_path, args, expected):
    base = [] if args[0] == "--config" else ["--config", str(write_recipe(tmp_path / "r.yaml"))]
    result = flrun("fit", *base, *args, "--output_dir", str(tmp_path / "out"), cwd=tmp_path)
    assert result.returncode == 2
    lines = [
        line
        for line in result.stderr.splitlines()
        if line.strip() and "Warning" not in line and not line.startswith(" ")
    ]
    assert len(lines) == 1, result.stderr
    assert expected in lines[0] and "Traceback" not in result.stderr


def test_unknown_optimizer_option_in_recipe(tmp_path):
    training = {**TINY["training"], "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"momentun": 0.9}}}
    result = flrun("fit", "--config", str(write_recipe(tmp_path / "r.yaml", training=training)))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "torch.optim.SGD (training.optimizer) has no option 'momentun' (did you mean 'momentum'?)" in result.stderr


def test_unknown_key_in_recipe(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", roundz=3)
    result = flrun("fit", "--config", str(recipe))
    assert result.returncode == 2 and "unknown key 'roundz'" in result.stderr


def test_models_lists_registered_builders():
    result = flrun("models", "--json")
    assert result.returncode == 0
    # the catalog it prints is what building every builder counts (python -m fl_lightning.models.catalog)
    counted = flrun("models", "--count", "--json")
    assert counted.returncode == 0 and yaml.safe_load(counted.stdout) == yaml.safe_load(result.stdout)
    names = {row["name"]: row for row in yaml.safe_load(result.stdout)}
    assert names["resnet20"]["parameters"] == 272_762
    # builders whose modules (and torchvision / transformers) are imported only when models are listed or built
    for lazy in ("cifar_resnet18", "torchvision_resnet50", "vit_b16", "imdb_bilstm", "stackoverflow_lstm_small"):
        assert lazy in names, lazy


def test_parser_and_option_errors_do_not_import_heavy_packages():
    """`flrun fit --help` and a misspelled option answer without Lightning, torchvision or transformers."""
    script = (
        "import sys\n"
        "from fl_lightning.cli.commands import fit_parser, main\n"
        "fit_parser().format_help()\n"
        "assert main(['fit', '--config', 'recipes/quickstart.yaml', '--round', '10']) == 2\n"
        "heavy = ('lightning', 'torchmetrics', 'torchvision', 'transformers', 'scipy', 'datasets', 'h5py', 'wandb')\n"
        "print([name for name in heavy if name in sys.modules])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert "unknown option --round (did you mean --rounds?)" in result.stderr


def test_data_inspect_help_names_its_command():
    result = flrun("data", "inspect", "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: flrun data inspect") and "--population.num_clients" in result.stdout


def test_wandb_without_account_is_one_sentence(tmp_path):
    """No API key and online mode: one sentence (log in or WANDB_MODE=offline), fast, no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path / "home"), WANDB_API_KEY="", WANDB_MODE="online")
    (tmp_path / "home").mkdir()
    recipe = write_recipe(tmp_path / "r.yaml", rounds=1)
    result = subprocess.run(
        [sys.executable, "-m", "fl_lightning", "fit", "--config", str(recipe), "--logger", "wandb"]
        + ["--output_dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=120,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    assert "wandb login" in lines[0] and "WANDB_MODE=offline" in lines[0]
