"""The command line: errors are one readable line with exit status 2; overrides and recipes parse."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, TINY, run_cli, write_recipe

RECIPES = sorted((ROOT / "recipes").glob("*.yaml"))


def _first_of_each_base(recipes: list[Path]) -> set[Path]:
    """A recipe without a base, and the first (by name) of the recipes whose first base is the same: the rest of
    a family differs from its first in numbers, overrides and further bases, which the slow suite parses."""
    from fl_lightning.run.safe_yaml import load_text  # the recipes' own reader: libyaml's parser, at collection

    seen, first = set(), set()
    for recipe in recipes:
        base = load_text(recipe.read_text(), recipe.name).get("base")
        family = str(base[0] if isinstance(base, list) else base)
        if base is None or family not in seen:
            first.add(recipe)
        seen.add(family)
    return first


_DEFAULT_PARSED = _first_of_each_base(RECIPES)


def flrun(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "fl_lightning", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


@pytest.mark.parametrize(
    "recipe",
    [r if r in _DEFAULT_PARSED else pytest.param(r, marks=pytest.mark.slow) for r in RECIPES],
    ids=[r.stem for r in RECIPES],
)
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
def test_errors_are_one_line_without_traceback(tmp_path, monkeypatch, capsys, args, expected):
    monkeypatch.chdir(tmp_path)  # "missing.yaml" is relative
    base = [] if args[0] == "--config" else ["--config", str(write_recipe(tmp_path / "r.yaml"))]
    assert run_cli("fit", *base, *args, "--output_dir", str(tmp_path / "out")) == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line and not line.startswith(" ")]
    assert len(lines) == 1, err
    assert expected in lines[0] and "Traceback" not in err


def test_an_error_of_the_flrun_process_is_one_line_on_stderr_and_exit_status_2(tmp_path):
    """The cases above run main() in this process; the command itself exits 2 with the same single line."""
    recipe = write_recipe(tmp_path / "r.yaml")
    result = flrun("fit", "--config", str(recipe), "--strategy", "fl_lightning.strategies.NoSuchStrategy")
    lines = [line for line in result.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(lines) == 1 and "class_path 'fl_lightning.strategies.NoSuchStrategy'" in lines[0], result.stderr


def test_unknown_optimizer_option_in_recipe(tmp_path):
    training = {**TINY["training"], "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"momentun": 0.9}}}
    result = flrun("fit", "--config", str(write_recipe(tmp_path / "r.yaml", training=training)))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "torch.optim.SGD (training.optimizer) has no option 'momentun' (did you mean 'momentum'?)" in result.stderr


def test_unknown_key_in_recipe(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", roundz=3)
    result = flrun("fit", "--config", str(recipe))
    assert result.returncode == 2 and "unknown key 'roundz'" in result.stderr


def test_models_lists_registered_builders(capsys):
    assert run_cli("models", "--json") == 0
    names = {row["name"]: row for row in yaml.safe_load(capsys.readouterr().out)}
    assert names["resnet20"]["parameters"] == 272_762
    # builders whose modules (and torchvision / transformers) are imported only when models are listed or built
    for lazy in ("cifar_resnet18", "torchvision_resnet50", "vit_b16", "imdb_bilstm", "stackoverflow_lstm_small"):
        assert lazy in names, lazy


@pytest.mark.slow
def test_the_models_catalog_is_what_building_every_builder_counts():
    """The catalog `flrun models` prints is recorded; building every builder (ViT-B/16 and ResNet-50 among them)
    counts the same (python -m fl_lightning.models.catalog writes it)."""
    listed, counted = flrun("models", "--json"), flrun("models", "--count", "--json")
    assert listed.returncode == 0 and counted.returncode == 0, counted.stderr
    assert yaml.safe_load(counted.stdout) == yaml.safe_load(listed.stdout)


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


def test_an_unknown_wandb_mode_is_one_sentence_before_anything_is_written(tmp_path, monkeypatch, capsys):
    """WANDB_MODE=bogus (or a mode: W&B does not know): one sentence naming the variable, its value and the valid
    modes, exit 2, before the run folder or a sweep's study is made; not pydantic's trace from inside wandb.init."""
    from fl_lightning.federation.errors import ConfigError
    from fl_lightning.tracking import WandbLogger

    recipe = write_recipe(tmp_path / "r.yaml", rounds=1)
    for value in ("bogus", "", "OFFLINE"):
        monkeypatch.setenv("WANDB_MODE", value)
        out = tmp_path / f"run{value}"
        assert run_cli("fit", "--config", str(recipe), "--logger", "wandb", "--output_dir", str(out)) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Traceback" not in err, err
        assert f"WANDB_MODE is {value!r}, which W&B does not know" in err
        assert "online, offline, disabled, shared, dryrun or run (or unset it)." in err
        assert not out.exists()
    sweep = tmp_path / "s.yaml"
    sweep.write_text(
        yaml.safe_dump(
            {"base": str(recipe), "metric": "global/test_acc", "n_trials": 1, "logger": "wandb",
             "parameters": {"seed": {"type": "categorical", "choices": [0]}}, "output_dir": str(tmp_path / "sw")}
        )
    )  # fmt: skip
    assert run_cli("sweep", "--config", str(sweep)) == 2
    assert "WANDB_MODE is 'OFFLINE', which W&B does not know" in capsys.readouterr().err
    assert not (tmp_path / "sw").exists()
    monkeypatch.setenv("WANDB_MODE", "offline")
    with pytest.raises(ConfigError, match=r"^the wandb logger's mode is 'bogus', which W&B does not know; set it to"):
        WandbLogger(mode="bogus")  # type: ignore[arg-type]


def test_the_wandb_modes_named_are_those_wandb_accepts():
    import typing

    from wandb.sdk.wandb_settings import Settings

    from fl_lightning.tracking.loggers import WANDB_MODES

    assert sorted(WANDB_MODES) == sorted(typing.get_args(Settings.model_fields["mode"].annotation))


def test_version_and_the_short_config_option(tmp_path, capsys):
    import json

    from conftest import read_summary

    import fl_lightning

    assert run_cli("--version") == 0
    assert capsys.readouterr().out.strip() == f"flrun (fl-lightning) {fl_lightning.__version__}"
    recipe = write_recipe(tmp_path / "tiny.yaml", rounds=2)
    assert run_cli("fit", "-c", str(recipe), "--output_dir", str(tmp_path / "run"), "--json") == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == read_summary(tmp_path / "run") and printed["name"] == "tiny"  # the recipe's name, as --config
    # sweep and data inspect take -c too, and the arguments after -- of sweep and table read it as --config
    assert run_cli("sweep", "-c", str(tmp_path / "missing.yaml")) == 2
    assert "sweep file" in capsys.readouterr().err
    chart = tmp_path / "chart.png"
    assert run_cli("data", "inspect", "-c", str(recipe), "--output", str(chart)) == 0 and chart.is_file()
    capsys.readouterr()
    table = ["table", "paper-9/table-1", "--recipes", str(tmp_path), "--", "-c", str(recipe)]
    assert run_cli(*table) == 2 and "may not set --config" in capsys.readouterr().err


def test_the_end_of_a_run_is_a_short_summary_and_json_on_request(tmp_path, capsys):
    from conftest import read_summary

    recipe = write_recipe(tmp_path / "tiny.yaml", rounds=4, eval_every=1)
    out = tmp_path / "run"
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(out), "--stop_after", "3") == 0
    summary = read_summary(out)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tiny seed 0: 3 of 4 rounds (--resume auto continues) in ")
    acc = "global/test_acc"
    assert lines[1] == (
        f"  {acc}: final {summary['final'][acc]:.4f} (round 3), best {summary['best'][acc]:.4f} "
        f"(round {summary['best_round']})"
    )
    assert lines[2] == (
        f"  other final metrics: global/test_loss {summary['final']['global/test_loss']:.4g}, "
        f"global/test_top_class_share {summary['final']['global/test_top_class_share']:.4g}"
    )
    assert lines[3] == f"run folder: {out} (every number in summary.json; --json prints it)"
    assert len(lines) == 4
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(out), "--resume", "auto") == 0
    assert capsys.readouterr().out.startswith("tiny seed 0: 4 rounds in ")


def test_fit_help_starts_with_a_usage_line_and_requires_nothing_a_recipe_gives():
    from fl_lightning.run.arguments import FIT_SUMMARY, fit_parser

    text = fit_parser().format_help()
    assert text.startswith("usage: flrun fit [-c RECIPE ...] [--KEY VALUE ...] [--print_config] [-h|--help]\n")
    words = " ".join(text.split())  # as wrapped at any terminal width
    assert "(required" not in words and "(set by the recipe or here, type: <class 'FederatedData'>" in words
    # the summary names options that exist (or --json, which flrun fit reads itself)
    options = {o for action in fit_parser()._actions for o in action.option_strings} | {"--json"}
    named = {word for line in FIT_SUMMARY.splitlines() for word in line.split() if word.startswith("-")}
    named = {word.strip(",();`") for word in named if not word.startswith("--training.batch_size")}
    assert named <= options and {"-c", "--config", "--json", "--resume"} <= named


def test_fit_h_is_the_summary_without_the_parser():
    script = (
        "import sys\nfrom fl_lightning.cli.commands import main\nassert main(['fit', '-h']) == 0\n"
        "print('torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.startswith("usage: flrun fit [-c RECIPE ...]")
    assert "`flrun fit --help` adds every option" in result.stdout
    assert result.stdout.split()[-1] == "False" and len(result.stdout.splitlines()) < 30


def test_the_parser_kept_between_runs_gives_each_recipe_what_a_fresh_parser_gives(tmp_path):
    """fit_parser is built once per process; a parse (or a refused one) must leave nothing for the next."""
    from fl_lightning.run import arguments

    argvs = [
        ["--config", str(ROOT / "recipes/digits_fedhe.yaml"), "--rounds", "3", "--training.batch_size", "8"],
        ["--config", str(ROOT / "recipes/quickstart.yaml"), "--sampler.init_args.fraction", "2"],  # refused
        ["--config", str(ROOT / "recipes/digits_ondevice_kd.yaml")],
        ["--config", str(ROOT / "recipes/quickstart.yaml")],
    ]
    kept = []
    for argv in argvs:
        try:
            kept.append(arguments.parse_fit(argv)[2])
        except arguments.UserError as err:
            kept.append(str(err))
    assert arguments.fit_parser() is arguments.fit_parser()
    for argv, text in zip(argvs, kept, strict=True):
        arguments._built_fit_parser.cache_clear()
        try:
            fresh = arguments.parse_fit(argv)[2]
        except arguments.UserError as err:
            fresh = str(err)
        assert fresh == text, argv
    assert "sampler fraction must be in (0, 1]" in kept[1] and "rounds: 3" in kept[0]
