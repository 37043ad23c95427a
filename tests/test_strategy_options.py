"""Impossible strategy hyperparameters are refused when the strategy is built: exit 2 and one sentence on
stderr naming the method, the option, its bound and the value, before any round runs (no run directory is
written)."""

import pytest
from conftest import ROOT, run_cli

S = "--strategy.init_args."
CODIST = "--strategy.init_args.distillation.init_args."

CASES = [
    ("digits_fedadam", [S + "server_lr", "-0.01"], "FedAdam server_lr must be > 0, got -0.01."),
    ("digits_fedadam", [S + "server_lr", "0"], "FedAdam server_lr must be > 0, got 0.0."),
    ("digits_fedadam", [S + "server_lr", "{small: 1, large: 0}"], "FedAdam server_lr['large'] must be > 0, got 0.0."),
    ("digits_fedadam", [S + "server_lr_final", "-1"], "FedAdam server_lr_final must be >= 0, got -1.0."),
    ("digits_fedadam", [S + "beta1", "1"], "FedAdam beta1 must be in [0, 1), got 1.0."),
    ("digits_fedadam", [S + "beta2", "-0.1"], "FedAdam beta2 must be in [0, 1), got -0.1."),
    ("digits_fedadam", [S + "eps", "0"], "FedAdam eps must be > 0, got 0.0."),
    ("digits_merged_codist", [S + "server_lr", "-1"], "MergedCodist server_lr must be > 0, got -1.0."),
    ("digits_merged_codist", [CODIST + "temperature", "0"], "Codistillation temperature must be > 0, got 0.0."),
    ("digits_merged_codist", [CODIST + "lr", "-0.001"], "Codistillation lr must be > 0, got -0.001."),
    ("digits_periodic_codist", [CODIST + "student_reg", "2"], "Codistillation student_reg must be in [0, 1], got 2.0."),
    ("digits_periodic_codist", [CODIST + "batch_size", "0"], "Codistillation batch_size must be >= 1, got 0."),
    ("digits_periodic_codist", [S + "period", "0"], "PeriodicCodist period must be >= 1, got 0."),
    ("digits_ondevice_kd", [S + "temperature", "0"], "OnDeviceKD temperature must be > 0, got 0.0."),
    ("digits_ondevice_kd", [S + "kd_weight", "-0.5"], "OnDeviceKD kd_weight must be >= 0, got -0.5."),
    ("digits_ondevice_kd", [S + "ramp_rounds", "-3"], "OnDeviceKD ramp_rounds must be >= 0, got -3."),
    ("digits_fedhe", [S + "alpha", "-1"], "FedHe alpha must be >= 0, got -1.0."),
    ("digits_fedhe", [S + "warmup_rounds", "-1"], "FedHe warmup_rounds must be >= 0, got -1."),
    ("digits_fd", [S + "temperature", "0"], "FD temperature must be > 0, got 0.0."),
    ("digits_fd", [S + "lam", "-0.1"], "FD lam must be >= 0, got -0.1."),
    ("digits_felo", [S + "forget", "1.5"], "Felo forget must be in [0, 1], got 1.5."),
    ("digits_felo", [S + "alpha", "-0.5"], "Felo alpha must be >= 0, got -0.5."),
    ("digits_velo", [S + "cvae_lr", "0"], "Velo cvae_lr must be > 0, got 0.0."),
    ("digits_velo", [S + "max_features", "0"], "Velo max_features must be >= 2, got 0."),
    ("digits_velo", [S + "forget", "-0.1"], "Velo forget must be in [0, 1], got -0.1."),  # Felo's, through **kwargs
    ("digits_fedgh", [S + "header_lr", "-0.01"], "FedGH header_lr must be >= 0, got -0.01."),
    ("digits_fedl2g", [S + "server_clip", "0"], "FedL2G server_clip must be > 0, got 0.0."),
    ("digits_fedl2g", [S + "warm_up_rounds", "-1"], "FedL2G warm_up_rounds must be >= 0, got -1."),
    ("digits_fedl2g", [S + "quiz_batches", "0"], "FedL2G quiz_batches must be >= 1, got 0."),
    ("digits_fedktl", [S + "mu", "-1"], "FedKTL mu must be >= 0, got -1.0."),
    ("digits_fedktl", [S + "server_epochs", "0"], "FedKTL server_epochs must be >= 1, got 0."),
    ("digits_dsfl", [S + "distill_batch_size", "0"], "DS-FL distill_batch_size must be >= 1 (or null), got 0."),
    ("digits_fedmd", [S + "digest_batch_size", "0"], "FedMD digest_batch_size must be >= 1 (or null), got 0."),
]


# every choice a strategy offers is a Literal in its signature: the parser refuses a value outside it and names
# the option and the choices (and `flrun fit --strategy.help <Strategy>` lists them)
CHOICES = [
    ("digits_fedhe", "logit_loss", "mse, kl"),
    ("digits_fedhe", "logit_average", "batch, available"),
    ("digits_felo", "logit_loss", "kl, mse"),
    ("digits_velo", "loss_average", "batch, available"),  # Felo's option, through Velo's **kwargs
    ("digits_fedkd", "kl_reduction", "batchmean, mean"),
    ("digits_fedkd", "compression", "none, svd"),
    ("digits_fml", "kl_reduction", "batchmean, mean"),
    ("digits_fedl2g", "target", "feature, logit"),
    ("digits_fedmrl", "evaluate_small", "local, global"),
    ("digits_fedpcl", "loss", "supcon, prototype_ce"),
    ("digits_fedpcl", "inference", "own, global"),
    ("digits_fedproto", "weighting", "uniform, samples"),
    ("digits_fedproto", "inference", "prototypes, local_head"),
    ("digits_fedproto", "split", "global, test, val"),
    ("digits_fedgh", "header_update", "per_lar, per_client"),
    ("digits_fedgh", "evaluate_with", "local, global_header"),
    ("digits_lg_fedavg", "evaluate_with", "global, local"),
    ("digits_dsfl", "aggregation", "era, sa, plurality"),
    ("digits_dsfl", "upload", "probs, logits, votes"),
    ("digits_fedmd", "digest_loss", "l1, mse, kl"),
    ("digits_fedgems", "kl_form", "paper, aijack"),
    ("digits_fedgems", "server_optimizer", "adam, sgd"),
    ("digits_fedgkt", "server_optimizer", "adam, sgd"),
    ("digits_heterofl", "mode", "dynamic, fixed"),
    ("digits_ondevice_kd", "kd_mode", "sequential, joint"),
    ("digits_ondevice_kd", "teacher_mode", "train, eval"),
]


@pytest.mark.parametrize("recipe, option, choices", CHOICES, ids=[f"{r}-{o}" for r, o, _ in CHOICES])
def test_a_value_outside_a_strategys_choices_is_refused_naming_them(tmp_path, capsys, recipe, option, choices):
    out = tmp_path / "out"
    code = run_cli(
        "fit", "--config", str(ROOT / "recipes" / f"{recipe}.yaml"), S + option, "nope", "--output_dir", str(out)
    )
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and not out.exists()
    assert lines == [f"flrun fit: error: bad value 'nope' for strategy.{option}: use one of {choices}."]


def test_a_strategys_choices_are_listed_by_its_help(capsys):
    with pytest.raises(SystemExit):
        run_cli("fit", "--strategy.help", "FedHe")
    assert "--strategy.logit_loss {mse,kl}" in capsys.readouterr().out


@pytest.mark.parametrize("recipe, args, expected", CASES, ids=[f"{r}-{a[0].rsplit('.', 1)[1]}" for r, a, _ in CASES])
def test_impossible_option_is_refused_before_training(tmp_path, capsys, recipe, args, expected):
    out = tmp_path / "out"
    code = run_cli("fit", "--config", str(ROOT / "recipes" / f"{recipe}.yaml"), *args, "--output_dir", str(out))
    stderr = capsys.readouterr().err
    lines = [line for line in stderr.splitlines() if line.strip() and "Warning" not in line]
    assert code == 2, stderr
    assert lines == [f"flrun fit: error: {expected}"], stderr
    assert "Traceback" not in stderr and not out.exists()  # refused before the run wrote anything


def test_fedadam_per_role_rates_must_name_every_role(tmp_path, capsys):
    code = run_cli(
        "fit",
        "--config",
        str(ROOT / "recipes/digits_fedadam.yaml"),
        "--strategy.init_args.server_lr",
        "{small: 0.01}",
        "--output_dir",
        str(tmp_path / "out"),
    )
    stderr = capsys.readouterr().err
    assert code == 2 and "FedAdam server_lr gives no rate for role(s) ['large']" in stderr, stderr


@pytest.mark.parametrize("recipe", ["digits_merged_codist", "digits_periodic_codist"])
@pytest.mark.parametrize("option", ["lr", "temperature"])
def test_codistillation_per_role_options_must_name_every_role(tmp_path, capsys, recipe, option):
    argv = ["--config", str(ROOT / "recipes" / f"{recipe}.yaml"), CODIST + option, "{small: 0.5}"]
    assert run_cli("fit", *argv, "--output_dir", str(tmp_path / "out")) == 2
    stderr = capsys.readouterr().err
    assert f"distillation {option} gives no value for role(s) ['large']" in stderr, stderr
    assert not (tmp_path / "out").exists()  # at setup, not in the first codistillation round


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        ([S + "split", "tset"], "bad value 'tset' for strategy.split: use one of global, test, val."),
        (["--data.init_args.local_split", "[1.0, 0.0, 0.0]"], "FML evaluates each client on its local test split"),
    ],
)
def test_an_evaluation_split_the_clients_lack_is_refused_before_training(tmp_path, capsys, args, expected):
    argv = ["--config", str(ROOT / "recipes/digits_fml.yaml"), *args, "--output_dir", str(tmp_path / "out")]
    assert run_cli("fit", *argv) == 2
    assert expected in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # before the first round, not at the first evaluation after it


def test_ondevice_kd_on_a_one_role_recipe_says_how_to_add_the_auxiliary_role_and_that_runs(tmp_path, capsys):
    import re

    argv = [
        "fit",
        "--config",
        str(ROOT / "recipes/quickstart.yaml"),
        "--strategy",
        "fl_lightning.strategies.OnDeviceKD",
    ]
    argv += ["--rounds", "1", "--runtime.progress", "false"]
    assert run_cli(*argv, "--output_dir", str(tmp_path / "refused")) == 2
    err = capsys.readouterr().err
    assert "OnDeviceKD needs the model roles 'aux' (the auxiliary model every client trains) and 'target'" in err
    assert "the tiers train ['global']; add 'aux' and 'target' to the recipe, e.g. `models: " in err
    models, population = re.findall(r"`(\w+): (\{.*?\})`", err)
    assert models[0] == "models" and population[0] == "population"
    # the snippet, as given, makes the recipe run
    assert (
        run_cli(*argv, "--models", models[1], "--population", population[1], "--output_dir", str(tmp_path / "ok")) == 0
    )
