"""Start-up: a digits run imports neither Lightning's Trainer side nor packages a digits run does not use, and
its first round imports nothing (an import there stalls the first step, benchmarks/results/log.md)."""

import json
import operator
import subprocess
import sys

import numpy as np
import pytest
from conftest import ROOT

# What a digits FedAvg run must not import: the umbrella `lightning` (it imports lightning.pytorch, then
# torchmetrics, which imports torchvision, transformers and scipy.signal), and the heavy packages of
# other data sets, models and loggers. scikit-learn brings pandas and scipy; its digits file is read directly.
HEAVY = (
    "lightning",
    "pytorch_lightning",
    "torchmetrics",
    "torchvision",
    "transformers",
    "scipy",
    "sklearn",
    "pandas",
    "datasets",
    "h5py",
    "wandb",
    "tensorboard",
    "matplotlib",
)

# A recorder of sys.modules when the run starts (after Fabric, data and models are set up, just before
# round 1) and when round 1's metrics arrive; then the whole process's modules when the run is over.
DRIVER = """
import json, sys
from fl_lightning.run.arguments import fit_from_argv
from fl_lightning.tracking.loggers import RunLogger

class ImportWatch(RunLogger):
    def start(self, output_dir, name, config, state):
        self.before = set(sys.modules)

    def log_metrics(self, metrics, step):
        if step == 1:
            self.first_round = sorted(set(sys.modules) - self.before)

watch = ImportWatch()
summary = fit_from_argv(sys.argv[1:], extra_loggers=[watch])
print(json.dumps({"first_round": watch.first_round, "modules": sorted(sys.modules), "final": summary["final"]}))
"""


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    """The README's quickstart, 2 rounds, in a fresh process (the test process has imported everything)."""
    out = tmp_path_factory.mktemp("startup") / "run"
    argv = ["--config", "recipes/quickstart.yaml", "--rounds", "2", "--eval_every", "1"]
    argv += ["--output_dir", str(out), "--runtime.progress", "false"]
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_digits_run_imports_no_heavy_package(digits_run):
    modules = set(digits_run["modules"])
    assert {"torch", "lightning_fabric", "fl_lightning.client.module"} <= modules  # it did run, on Fabric
    assert "global/test_acc" in digits_run["final"]
    imported = {name.split(".")[0] for name in modules}
    assert sorted(imported & set(HEAVY)) == []


def test_digits_first_round_imports_nothing(digits_run):
    """Round 1 (local training, aggregation, evaluation) finds every module already imported."""
    assert digits_run["first_round"] == []


def test_fabric_reads_torchmetrics_version_without_importing_it():
    import lightning_utilities.core.imports as requirement_checks

    from fl_lightning.distributed.fabric import _version_from_metadata, fabric_class, lightning_version

    calls = []

    def original(*args):
        calls.append(args)
        return "delegated"

    compare = _version_from_metadata(original)
    assert compare("torchmetrics", operator.ge, "1.0.0") is True  # 1.9.0 is installed (pip list)
    assert compare("torchmetrics", operator.ge, "99.0") is False
    assert calls == []
    assert compare("torch", operator.ge, "2.0") == "delegated"
    assert calls == [("torch", operator.ge, "2.0", False)]

    before = requirement_checks.compare_version
    assert fabric_class().__module__ == "lightning_fabric.fabric"
    assert requirement_checks.compare_version is before  # the replacement lasts only while Fabric loads
    assert lightning_version().count(".") >= 1


def test_digits_read_directly_equal_load_digits():
    """The digits file read without scikit-learn gives exactly ``load_digits``'s pixels and labels."""
    from sklearn.datasets import load_digits

    from fl_lightning.data.digits import read_digits

    pixels, labels = read_digits()
    bunch = load_digits()
    assert pixels.shape == (1797, 64) and labels.shape == (1797,)
    assert np.array_equal(pixels, bunch.data) and pixels.dtype == bunch.data.dtype
    assert np.array_equal(labels, bunch.target)
    assert np.bincount(labels).tolist() == [178, 182, 177, 183, 181, 182, 181, 179, 174, 180]


def test_models_resolved_without_torchvision_modules_import_no_torchvision():
    """resolve_builder imports every bundled model module but those listed as importing torchvision."""
    script = (
        "import sys\n"
        "from fl_lightning.models import registry\n"
        "registry.resolve_builder('digits_cnn')\n"
        "print(sorted(m for m in sys.modules if m.startswith('fl_lightning.models.')), 'torchvision' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    assert "fl_lightning.models.resnet" in result.stdout and "fl_lightning.models.cifar_resnet" not in result.stdout
    assert result.stdout.strip().endswith("False"), result.stdout


def test_flrun_fit_freezes_its_start_up_and_collects_again(tmp_path):
    """The program pauses the cyclic collector while it imports, then freezes what start-up made (hundreds of
    thousands of objects that later collections no longer walk) and collects again during the run."""
    script = (
        "import gc, sys\n"
        "from fl_lightning import cli\n"
        "from fl_lightning.tracking.loggers import RunLogger\n"
        "seen = {}\n"
        "class Watch(RunLogger):\n"
        "    def start(self, output_dir, name, config, state):\n"
        "        seen.update(enabled=gc.isenabled(), frozen=gc.get_freeze_count())\n"
        "    def log_metrics(self, metrics, step):\n"
        "        pass\n"
        "import fl_lightning.run.fit as fit_module\n"
        "resolve = fit_module.resolve_loggers\n"
        "fit_module.resolve_loggers = lambda logger: resolve(logger) + [Watch()]\n"
        "sys.argv = ['flrun', *sys.argv[1:]]\n"
        "status = cli.main()\n"
        "print(status, seen['enabled'], seen['frozen'], gc.isenabled())\n"
    )
    argv = ["fit", "--config", "recipes/quickstart.yaml", "--rounds", "1", "--runtime.progress", "false"]
    argv += ["--output_dir", str(tmp_path / "run")]
    result = subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr
    status, enabled, frozen, enabled_after = result.stdout.split()[-4:]
    assert (status, enabled, enabled_after) == ("0", "True", "True")
    assert int(frozen) > 100_000  # torch and torch._dynamo alone make about 500,000


def test_main_called_in_process_leaves_the_collector_alone(tmp_path):
    """Tests and notebooks that call main([...]) keep their own collector: nothing of theirs is frozen."""
    import gc

    from fl_lightning.cli.commands import main

    frozen = gc.get_freeze_count()
    argv = ["fit", "--config", "recipes/quickstart.yaml", "--rounds", "1", "--runtime.progress", "false"]
    assert main([*argv, "--output_dir", str(tmp_path / "run")]) == 0
    assert gc.isenabled() and gc.get_freeze_count() == frozen


# Runs main(argv) with stdout and stderr watched: what was imported when the command first wrote anything, and
# how many model builders were called by then.
FIRST_ANSWER = """
import json, sys
from fl_lightning.cli.commands import main

class Watch:
    def __init__(self, out):
        self.out = out
    def write(self, text):
        if text.strip() and not seen:
            seen.update(torch='torch' in sys.modules, modules=len(sys.modules), text=text)
        return self.out.write(text)
    def flush(self):
        self.out.flush()

seen = {}
out, err = sys.stdout, sys.stderr
sys.stdout, sys.stderr = Watch(out), Watch(err)
status = main(sys.argv[1:])
sys.stdout, sys.stderr = out, err
print(json.dumps({"status": status, **seen}))
"""


def first_answer(*argv, env=None):
    result = subprocess.run(
        [sys.executable, "-c", FIRST_ANSWER, *argv], capture_output=True, text=True, cwd=ROOT, timeout=300,
        check=False, env=env,
    )  # fmt: skip
    assert result.stdout.strip(), result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1]), result


def test_flrun_models_answers_from_the_catalog_without_torch():
    seen, result = first_answer("models")
    assert seen["status"] == 0 and not seen["torch"]
    assert "digits_cnn" in result.stdout and "38,282" in result.stdout  # digits_cnn's parameters, as built


def test_flrun_fit_help_is_rendered_once_then_printed_without_torch(tmp_path):
    import os

    env = dict(os.environ, XDG_CACHE_HOME=str(tmp_path / "cache"), COLUMNS="100")
    first, rendered = first_answer("fit", "--help", env=env)
    second, stored = first_answer("fit", "--help", env=env)
    assert first["torch"] and not second["torch"]
    text = stored.stdout.rsplit("\n", 2)[0] + "\n"  # without the driver's JSON line
    assert rendered.stdout.rsplit("\n", 2)[0] + "\n" == text
    # what the parser prints in a fresh process (the known subclasses it lists are the classes imported there)
    parser = "from fl_lightning.run.arguments import fit_parser; print(fit_parser().format_help(), end='')"
    live = subprocess.run(
        [sys.executable, "-c", parser], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300, check=True
    )
    assert text == live.stdout
    assert len(list((tmp_path / "cache" / "fl-lightning").glob("fit-help-*.txt"))) == 1


def test_the_help_cache_key_changes_with_the_code(tmp_path):
    from fl_lightning.cli.help_cache import source_digest

    (tmp_path / "a.py").write_text("x = 1\n")
    before = source_digest(tmp_path)
    (tmp_path / "a.py").write_text("x = 2\n")
    assert source_digest(tmp_path) != before


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--roundz", "10"], "unknown option --roundz (did you mean --rounds?)"),
        (["--training.batch_sz", "3"], "unknown option --training.batch_sz (did you mean --training.batch_size?)"),
        (
            ["--seed", "0", "1", "2"],
            (
                "--seed takes one seed per run, got 0 1 2; run the seeds one after another, e.g. `for seed in 0 1 2; "
                "do flrun fit --config recipes/quickstart.yaml --seed $seed; done`, or a paper table's recipes at "
                "several seeds with `flrun table PAPER/TABLE --seeds 0 1 2`."
            ),
        ),
        (["--config", "sweeps/digits_quickstart.yaml"], "is a sweep file, not a recipe"),
        (["--config", "nothing.yaml"], "config file 'nothing.yaml' does not exist"),
    ],
)
def test_recipe_mistakes_are_answered_before_torch_is_imported(argv, message):
    seen, _ = first_answer("fit", "--config", "recipes/quickstart.yaml", *argv)
    assert seen["status"] == 2 and message in seen["text"] and not seen["torch"]


@pytest.mark.parametrize(
    ("mistake", "message"),
    [
        ("roundz: 3", "unknown key 'roundz' in the recipe (did you mean 'rounds'?)"),
        (
            "training: {batch_sise: 8}",
            "unknown key 'training.batch_sise' in the recipe (did you mean 'training.batch_size'?)",
        ),
    ],
)
def test_a_misspelled_recipe_key_is_answered_before_torch_is_imported(tmp_path, mistake, message):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"base: {ROOT / 'recipes/quickstart.yaml'}\n{mistake}\n")
    seen, _ = first_answer("fit", "--config", str(recipe))
    assert seen["status"] == 2 and not seen["torch"] and message in seen["text"]


def test_the_early_checks_know_every_option_the_parser_has():
    """The names read from the source (precheck) are exactly the parser's: none refused that it takes."""
    from fl_lightning.run.arguments import _built_fit_parser
    from fl_lightning.run.precheck import GROUPS, _check_option, fit_options, group_fields

    parser = _built_fit_parser.__wrapped__("flrun fit")  # as built: a parse adds jsonargparse's --print_shtab
    options = [o[2:] for action in parser._actions for o in action.option_strings if o.startswith("--")]
    for option in options:
        _check_option(option)  # raises on a name the parser takes
    top = {o.split(".")[0].rstrip("+") for o in options} - {"config", "print_config", "help"}
    assert top == set(fit_options())
    for group in GROUPS:
        parsed = {o.split(".")[1].rstrip("+") for o in options if o.startswith(group + ".") and not o.endswith(".help")}
        assert parsed == set(group_fields(group)), group
