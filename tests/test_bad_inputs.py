"""Malformed input ends as exit status 2 and one sentence naming what is wrong and how to fix it.

Each row is a bad command line, recipe value or file, run in-process through ``flrun fit``. Every row
must fail before training (a missed check would run, and the row would fail on its exit status), in one
line of stderr without a traceback, naming the option, key or file, with a fix. docs/reference/errors.md lists
the same cases.
"""

from __future__ import annotations

import copy
import gzip
import re
from dataclasses import dataclass, field

import numpy as np
import pytest
import yaml
from conftest import ROOT, TINY, run_cli

# the fix part of a message: an instruction or the rule the value must follow
HINT = re.compile(
    r"\b(must|use|set|give|choose|check|fix|pass|remove|raise|lower|see|did you mean|add|log in|run|one of|"
    r"needs?|expected|available|accepts|takes)\b|\be\.g\. ",  # or an example of a valid value
    re.IGNORECASE,
)


@dataclass
class Case:
    """One malformed input: ``args`` after the recipe, ``recipe`` changes merged into the tiny recipe."""

    id: str
    args: list[str]
    expect: list[str]
    recipe: dict = field(default_factory=dict)
    files: dict[str, bytes] = field(default_factory=dict)  # written under tmp_path; "{tmp}" in args points there
    no_recipe: bool = False  # the case gives its own --config
    command: str = "fit"


def _deep_merge(base: dict, changes: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in changes.items():
        if value and isinstance(value, dict) and isinstance(out.get(key), dict) and "class_path" not in value:
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _models(**args) -> dict:
    return {"models": {"global": {"builder": "digits_mlp", "args": args}}}


def _tiers(*tiers) -> dict:
    return {"population": {"num_clients": 8, "tiers": list(tiers)}}


SGD = "torch.optim.SGD"
# two architectures in two tiers, for the methods defined for one (FedNTD, CCVR)
TWO_CNNS = "{small: {builder: digits_cnn, args: {width: 0.25}}, big: {builder: digits_cnn}}"
TWO_TIERS = "[{name: a, count: 10, roles: [small]}, {name: b, roles: [big]}]"
# the three roles of the heterogeneous digits recipes, one with a 32-dimensional representation
HEADS_32_64 = (
    "{cnn_small: {builder: digits_mlp, args: {hidden: 32}}, cnn_large: {builder: digits_mlp, args: {hidden: 64}}, "
    "mlp: {builder: digits_mlp, args: {hidden: 64}}}"
)


MLPS_64 = (
    "{cnn_small: {builder: digits_mlp, args: {hidden: 64}}, cnn_large: {builder: digits_mlp, args: {hidden: 64}}, "
    "mlp: {builder: digits_mlp, args: {hidden: 64}}}"
)
MLPS_64_AND_SMALL_IMAGES = MLPS_64[:-1] + ", generator: {builder: random_image_generator, args: {image_size: 4}}}"


def _idx(array: np.ndarray) -> bytes:
    """A gzipped idx file (MNIST's format) holding ``array`` as uint8."""
    header = bytes([0, 0, 8, array.ndim]) + b"".join(int(size).to_bytes(4, "big") for size in array.shape)
    return gzip.compress(header + array.astype(np.uint8).tobytes())


MNIST_LABEL_10 = {  # MNIST whose training labels hold a 10 at index 3
    "data/MNIST/raw/train-images-idx3-ubyte.gz": _idx(np.zeros((12, 28, 28))),
    "data/MNIST/raw/train-labels-idx1-ubyte.gz": _idx(np.where(np.arange(12) == 3, 10, np.arange(12) % 10)),
    "data/MNIST/raw/t10k-images-idx3-ubyte.gz": _idx(np.zeros((4, 28, 28))),
    "data/MNIST/raw/t10k-labels-idx1-ubyte.gz": _idx(np.arange(4)),
}
# ten levels of ten aliases: 10^10 values once anything walks them
BOMB = b"a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + b"".join(
    f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n".encode() for i in range(1, 10)
)
# a paper table's only recipe, reading CIFAR-10 from a folder that does not exist
TABLE_RECIPE = yaml.safe_dump(
    {
        **TINY,
        "data": {"class_path": "fl_lightning.data.Cifar10Data", "init_args": {"data_dir": "no_such_folder"}},
        "reference": {"paper": "paper-9", "table": "Table 1", "column": "A", "metrics": {"global/test_acc": 0.9}},
    }
).encode()
MARKER = b'{"kind": "flrun fit run directory", "run_id": "0123456789abcdef"}'
SWEEP = f"""base: {ROOT / "recipes" / "quickstart.yaml"}
metric: global/test_acc
parameters:
  training.optimizer.init_args.lr: {{type: float, low: 0.01, high: 0.5, log: true}}
  training.batch_size: {{type: categorical, choices: [8, 16]}}
  training.local_steps: {{type: int, low: 1, high: 8}}
""".encode()
CASES = [
    # ---------------------------------------------------------------- command-line options
    Case("unknown option", ["--bogus", "1"], ["--bogus", "flrun fit --help"]),
    Case("misspelled option", ["--roundz", "3"], ["--roundz", "did you mean --rounds"]),
    Case("abbreviated option", ["--round", "3"], ["--round", "did you mean --rounds"]),
    Case(
        "misspelled nested option", ["--training.batch_sise", "8"], ["--training.batch_sise", "--training.batch_size"]
    ),
    Case("seed negative", ["--seed", "-1"], ["seed", "-1"]),
    Case("seed not a number", ["--seed", "abc"], ["'abc'", "seed", "int"]),
    Case("positional argument", ["recipes/quickstart.yaml"], ["'recipes/quickstart.yaml'", "--config"]),
    Case("rounds zero", ["--rounds", "0"], ["rounds", "at least 1"]),
    Case("rounds negative", ["--rounds", "-5"], ["rounds", "at least 1"]),
    Case("rounds fractional", ["--rounds", "1.5"], ["'1.5'", "rounds", "int"]),
    Case("eval_every zero", ["--eval_every", "0"], ["eval_every", "at least 1"]),
    Case("checkpoint_every zero", ["--checkpoint_every", "0"], ["checkpoint_every", "at least 1"]),
    Case("stop_after zero", ["--stop_after", "0"], ["stop_after", "at least 1"]),
    Case("stop_after negative", ["--stop_after", "-2"], ["stop_after", "at least 1"]),
    Case("num_threads zero", ["--runtime.num_threads", "0"], ["runtime.num_threads", "at least 1"]),
    Case("num_threads negative", ["--runtime.num_threads", "-4"], ["runtime.num_threads", "at least 1"]),
    Case("precision unknown", ["--runtime.precision", "64-banana"], ["precision", "64-banana"]),
    # Fabric knows 64-true, but the loop feeds float32 batches to the float64 weights: refused before any step
    Case("precision 64-true", ["--runtime.precision", "64-true"], ["runtime.precision", "'64-true'", "32-true"]),
    Case("precision bf16-true", ["--runtime.precision", "bf16-true"], ["runtime.precision", "bf16-mixed"]),
    Case("accelerator unknown", ["--runtime.accelerator", "tpu9"], ["accelerator", "tpu9"]),
    Case("progress not a bool", ["--runtime.progress", "maybe"], ["'maybe'", "runtime.progress"]),
    Case(
        "lockstep with the sequential executor",
        ["--runtime.executor", "sequential", "--runtime.lockstep", "true"],
        ["runtime.lockstep", "runtime.executor is sequential"],
    ),
    Case(
        "lockstep with the default executor",
        ["--runtime.lockstep", "true"],
        ["runtime.lockstep", "runtime.executor is auto", "set runtime.executor batched"],
    ),
    Case(
        "lockstep with CUDA graphs",
        ["--runtime.cuda_graphs", "true", "--runtime.lockstep", "true"],
        ["runtime.lockstep", "runtime.cuda_graphs"],
    ),
    Case("logger unknown", ["--logger", "mlflow"], ["mlflow", "wandb"]),
    # ---------------------------------------------------------------- components by name
    Case("strategy short name unknown", ["--strategy", "FedProx"], ["FedProx", "strategy", "FedAvg"]),
    Case("strategy class_path missing", ["--strategy", "fl_lightning.strategies.NoSuch"], ["NoSuch", "strategy"]),
    Case("strategy module missing", ["--strategy", "nosuchpkg.Strategy"], ["nosuchpkg", "strategy"]),
    Case("strategy not a strategy", ["--strategy", "fl_lightning.data.DigitsData"], ["DigitsData", "strategy"]),
    Case("data short name unknown", ["--data", "Mnistt"], ["Mnistt", "data", "MnistData"]),
    Case("sampler short name unknown", ["--sampler", "RoundRobin"], ["RoundRobin", "sampler", "UniformSampler"]),
    Case(
        "lr_schedule short name unknown",
        ["--training.lr_schedule", "Cosine"],
        ["Cosine", "training.lr_schedule", "CosineLR"],
    ),
    Case("strategy option unknown", ["--strategy.init_args.muu", "0.1"], ["muu"]),
    Case("model builder unknown", ["--models", "{global: {builder: digits_cnnn}}"], ["digits_cnnn", "digits_cnn"]),
    Case("model builder argument unknown", [], ["widht", "digits_mlp"], recipe=_models(widht=2)),
    Case("model width negative", [], ["width", "-1"], recipe=_models(width=-1)),
    Case("model width zero", [], ["width", "0"], recipe=_models(width=0)),
    Case("model hidden zero", [], ["hidden", "0"], recipe=_models(hidden=0)),
    Case("model depth negative", [], ["depth", "-1"], recipe=_models(depth=-1)),
    Case("model width a word", [], ["width", "wide"], recipe=_models(width="wide")),
    Case("models empty", [], ["models", "global"], recipe={"models": {}}),
    # ---------------------------------------------------------------- local training
    Case("lr negative", ["--training.optimizer.init_args.lr", "-0.1"], ["training.optimizer", "lr"]),
    Case("momentum negative", ["--training.optimizer.init_args.momentum", "-0.9"], ["training.optimizer", "momentum"]),
    Case(
        "lr a word",
        [],
        ["fast", "lr"],
        recipe={"training": {"optimizer": {"class_path": SGD, "init_args": {"lr": "fast"}}}},
    ),
    Case(
        "lr not a number",
        [],
        ["training.optimizer.init_args.lr is nan", "finite number"],
        recipe={"training": {"optimizer": {"class_path": SGD, "init_args": {"lr": float("nan")}}}},
    ),
    Case(
        "momentum infinite",
        ["--training.optimizer.init_args.momentum", ".inf"],
        ["training.optimizer.init_args.momentum is inf", "finite number"],
    ),
    Case(
        "optimizer init_args a list",
        [],
        ["training.optimizer.init_args must be a mapping", "not a list", "lr, momentum"],
        recipe={"training": {"optimizer": {"class_path": SGD, "init_args": [0.1]}}},
    ),
    Case(
        "strategy init_args a list",
        [],
        ["strategy.init_args must be a mapping", "not a list", "its options: roles"],
        recipe={"strategy": {"class_path": "fl_lightning.strategies.FedAvg", "init_args": [1]}},
    ),
    Case("optimizer unknown", ["--training.optimizer", "torch.optim.Sgd"], ["torch.optim.Sgd", "training.optimizer"]),
    Case("batch_size zero", ["--training.batch_size", "0"], ["training.batch_size", "at least 1"]),
    Case("local_steps zero", ["--training.local_steps", "0"], ["training.local_steps", "at least 1"]),
    Case("local_epochs zero", [], ["local_epochs"], recipe={"training": {"local_steps": None, "local_epochs": 0}}),
    Case("eval_batch_size zero", ["--training.eval_batch_size", "0"], ["training.eval_batch_size", "at least 1"]),
    Case("grad_clip_norm negative", ["--training.grad_clip_norm", "-1"], ["training.grad_clip_norm", "positive"]),
    Case("grad_clip_norm zero", ["--training.grad_clip_norm", "0"], ["training.grad_clip_norm", "positive"]),
    Case("optimizer_state unknown", ["--training.optimizer_state", "global"], ["optimizer_state", "global"]),
    Case(
        "lr_schedule final negative",
        ["--training.lr_schedule", "CosineLR", "--training.lr_schedule.final", "-1"],
        ["final", "-1"],
    ),
    # ---------------------------------------------------------------- population and sampling
    Case("num_clients zero", ["--population.num_clients", "0"], ["num_clients", "at least 1"]),
    Case("num_clients negative", ["--population.num_clients", "-3"], ["num_clients", "at least 1"]),
    Case("tiers empty", [], ["tiers", "at least one tier"], recipe=_tiers()),
    Case("tier without roles", [], ["roles", "all"], recipe=_tiers({"name": "all", "roles": []})),
    Case("tier role undefined", [], ["big", "models"], recipe=_tiers({"name": "all", "roles": ["big"]})),
    Case(
        "tier fraction above one",
        [],
        ["fraction", "1.5"],
        recipe=_tiers({"name": "a", "roles": ["global"], "fraction": 1.5}, {"name": "b", "roles": ["global"]}),
    ),
    Case(
        "tier fraction negative",
        [],
        ["fraction", "-0.2"],
        recipe=_tiers({"name": "a", "roles": ["global"], "fraction": -0.2}, {"name": "b", "roles": ["global"]}),
    ),
    Case(
        "tier count negative",
        [],
        ["count", "-1"],
        recipe=_tiers({"name": "a", "roles": ["global"], "count": -1}, {"name": "b", "roles": ["global"]}),
    ),
    Case(
        "tier names repeated",
        [],
        ["unique"],
        recipe=_tiers({"name": "a", "roles": ["global"], "count": 4}, {"name": "a", "roles": ["global"]}),
    ),
    Case(
        "two tiers take the rest",
        [],
        ["one tier"],
        recipe=_tiers({"name": "a", "roles": ["global"]}, {"name": "b", "roles": ["global"]}),
    ),
    Case(
        "assignment unknown",
        ["--population.assignment", "roundrobin"],
        ["population.assignment", "roundrobin", "contiguous, interleaved, cyclic, random"],
    ),
    Case("normalize unknown", ["--data.init_args.normalize", "standard"], ["data.normalize", "standard", "pixel"]),
    Case(
        "pathological assignment unknown",
        ["--data.partitioner", "fl_lightning.data.PathologicalPartitioner", "--data.partitioner.assignment", "cyclic"],
        ["data.partitioner.assignment", "cyclic", "random, deterministic"],
    ),
    Case(
        "pool_users unknown",
        ["--data", "fl_lightning.data.StackOverflowData", "--data.pool_users", "sorted"],
        ["data.pool_users", "sorted", "first, random"],
    ),
    Case("untrained unknown", ["--evaluation.untrained", "ignore"], ["evaluation.untrained", "evaluate, skip"]),
    Case(
        "cyclic tiers with sizes",
        ["--population.assignment", "cyclic"],
        ["cyclic", "remove count and fraction from tier(s) a"],
        recipe=_tiers({"name": "a", "roles": ["global"], "count": 4}, {"name": "b", "roles": ["global"]}),
    ),
    Case(
        "sampler fraction above one",
        ["--sampler.init_args.fraction", "2"],
        ["sampler fraction must be in (0, 1], got 2.0."],
    ),
    Case(
        "sampler fraction zero", ["--sampler.init_args.fraction", "0"], ["sampler fraction must be in (0, 1], got 0.0."]
    ),
    Case("sampler count too large", ["--sampler.init_args.num_per_round", "50"], ["50", "clients"]),
    Case(
        "sampler count zero",
        ["--sampler.init_args.num_per_round", "0"],
        ["sampler num_per_round must be >= 1 (or null), got 0."],
    ),
    Case("sampler tier unknown", ["--sampler.init_args.tiers", "[strong]"], ["strong", "tiers"]),
    # ---------------------------------------------------------------- data
    Case("alpha too small", ["--data.init_args.partitioner.init_args.alpha", "0.0001"], ["alpha", "raise alpha"]),
    Case("alpha zero", ["--data.init_args.partitioner.init_args.alpha", "0"], ["alpha", "positive"]),
    Case(
        "min_partition_size negative",
        ["--data.init_args.partitioner.init_args.min_partition_size", "-1"],
        ["min_partition_size", "-1"],
    ),
    Case("too many clients", ["--population.num_clients", "1000"], ["1000 clients"]),
    Case("server_fraction one", ["--data.init_args.server_fraction", "1.0"], ["server_fraction", "[0, 1)"]),
    Case("local_split bad", ["--data.init_args.local_split", "[0.5, 0.5, 0.5]"], ["local_split", "summing to 1"]),
    Case(
        "pool_test_set without a test split",
        ["--data.init_args.pool_test_set", "true"],
        ["pool_test_set", "test share"],
    ),
    Case("evaluation average unknown", ["--evaluation.average", "samples"], ["average", "samples"]),
    Case(
        "htfl feature_dim zero",
        ["--models.global", "{builder: htfl_cnn, args: {feature_dim: 0}}"],
        ["htfl_cnn", "feature_dim must be a positive whole number, got 0"],
    ),
    Case("test_fraction above one", ["--data.init_args.test_fraction", "1.5"], ["test_fraction", "1.5"]),
    Case("partitioner unknown", ["--data.init_args.partitioner", "Dirichlet"], ["Dirichlet", "DirichletPartitioner"]),
    Case("data option misspelled", ["--data.init_args.test_fractoin", "0.3"], ["test_fractoin", "'test_fraction'"]),
    Case(
        "alpha not a number",
        ["--data.init_args.partitioner.init_args.alpha", ".nan"],
        ["data.init_args.partitioner.init_args.alpha is nan", "finite number"],
    ),
    Case(
        "partitioner init_args a list",
        [],
        ["data.partitioner.init_args must be a mapping", "not a list", "alpha"],
        recipe={"data": {"init_args": {"partitioner": {"class_path": "DirichletPartitioner", "init_args": [0.5]}}}},
    ),
    Case(
        "data file label outside the classes",
        ["--data", "MnistData", "--data.init_args.data_dir", "{tmp}/data"],
        [
            "train-labels-idx1-ubyte.gz is not an MNIST idx file (label 10 at index 3 is outside 0..9)",
            "flrun data fetch",
        ],
        files=MNIST_LABEL_10,
    ),
    Case(
        "model num_classes below the data's",
        [],
        ["model role 'global' predicts 8 classes", "the data has 10", "models.global.args"],
        recipe=_models(hidden=32, num_classes=8),
    ),
    Case(
        "model in_channels not the data's",
        ["--models", "{global: {builder: digits_cnn, args: {in_channels: 3}}}"],
        ["model role 'global' takes 3 input channels but the data's examples have 1", "in_channels"],
    ),
    Case(
        "model in_features not the data's",
        [],
        ["model role 'global' takes 100 input features but the data's examples flatten to 64", "in_features"],
        recipe=_models(hidden=32, in_features=100),
    ),
    Case(
        "partitioner option misspelled",
        ["--data.init_args.partitioner.init_args.alhpa", "0.3"],
        ["alhpa", "data.partitioner", "'alpha'"],
    ),
    # ---------------------------------------------------------------- recipe files
    Case("recipe key unknown", [], ["roundz", "did you mean 'rounds'"], recipe={"roundz": 3}),
    Case("recipe nested key unknown", [], ["batch_sise", "batch_size"], recipe={"training": {"batch_sise": 8}}),
    Case("config missing", ["--config", "{tmp}/missing.yaml"], ["missing.yaml", "recipes/"], no_recipe=True),
    Case("config is a directory", ["--config", "{tmp}"], ["is a directory", "recipe"], no_recipe=True),
    Case(
        "config is binary",
        ["--config", "{tmp}/model.ckpt"],
        ["model.ckpt", "not a text"],
        files={"model.ckpt": bytes(range(256)) * 4},
        no_recipe=True,
    ),
    Case(
        "config yaml error",
        ["--config", "{tmp}/broken.yaml"],
        ["broken.yaml", "line 2"],
        files={"broken.yaml": b"rounds: 3\ntraining: {batch_size: 8\n"},
        no_recipe=True,
    ),
    Case(
        "config tab indentation",
        ["--config", "{tmp}/tabs.yaml"],
        ["tabs.yaml", "line 2"],
        files={"tabs.yaml": b"training:\n\tbatch_size: 8\n"},
        no_recipe=True,
    ),
    Case(
        "config empty",
        ["--config", "{tmp}/empty.yaml"],
        ["empty.yaml", "empty"],
        files={"empty.yaml": b""},
        no_recipe=True,
    ),
    Case(
        "config only comments",
        ["--config", "{tmp}/comments.yaml"],
        ["comments.yaml", "empty"],
        files={"comments.yaml": b"# nothing here\n"},
        no_recipe=True,
    ),
    Case(
        "config a list",
        ["--config", "{tmp}/list.yaml"],
        ["list.yaml", "mapping"],
        files={"list.yaml": b"- rounds: 3\n"},
        no_recipe=True,
    ),
    Case(
        "config a scalar",
        ["--config", "{tmp}/scalar.yaml"],
        ["scalar.yaml", "mapping"],
        files={"scalar.yaml": b"quickstart\n"},
        no_recipe=True,
    ),
    Case(
        "config without data",
        ["--config", "{tmp}/partial.yaml"],
        ["data", "recipe"],
        files={"partial.yaml": b"rounds: 3\n"},
        no_recipe=True,
    ),
    Case("no config at all", [], ["--config", "recipes/"], no_recipe=True),
    # ---------------------------------------------------------------- output and resume
    Case(
        "output_dir below a file",
        ["--output_dir", "{tmp}/afile/run"],
        ["output_dir", "afile"],
        files={"afile": b"x"},
    ),
    Case("output_dir name too long", ["--output_dir", "{tmp}/" + "x" * 300], ["output_dir", "too long"]),
    Case("output_dir is a file", ["--output_dir", "{tmp}/afile"], ["output_dir", "afile"], files={"afile": b"x"}),
    Case("resume file missing", ["--resume", "{tmp}/nothing.ckpt"], ["nothing.ckpt", "resume"]),
    Case("resume not a checkpoint", ["--resume", "{tmp}/fake.ckpt"], ["fake.ckpt"], files={"fake.ckpt": b"garbage"}),
    Case("monitor unknown", ["--monitor", "global/test_acc_typo"], ["global/test_acc_typo", "monitor"]),
    Case(
        "strategy server_lr negative",
        ["--config", "recipes/digits_fedadam.yaml", "--strategy.init_args.server_lr", "-0.01"],
        ["FedAdam server_lr must be > 0, got -0.01."],
        no_recipe=True,
    ),
    Case(
        "KD temperature zero",
        ["--config", "recipes/digits_ondevice_kd.yaml", "--strategy.init_args.temperature", "0"],
        ["OnDeviceKD temperature must be > 0, got 0.0."],
        no_recipe=True,
    ),
    Case(
        "FedHe alpha negative",
        ["--config", "recipes/digits_fedhe.yaml", "--strategy.init_args.alpha", "-1"],
        ["FedHe alpha must be >= 0, got -1.0."],
        no_recipe=True,
    ),
    Case(
        "strategy server_lr infinite",
        ["--config", "recipes/digits_fedadam.yaml", "--strategy.init_args.server_lr", ".inf"],
        ["strategy.init_args.server_lr is inf", "finite number"],
        no_recipe=True,
    ),
    Case(
        "strategy choice unknown",
        ["--config", "recipes/digits_fedhe.yaml", "--strategy.init_args.logit_loss", "l2"],
        ["'l2'", "strategy.logit_loss", "mse, kl"],
        no_recipe=True,
    ),
    Case(
        "FD temperature negative",
        ["--config", "recipes/digits_fd.yaml", "--strategy.init_args.temperature", "-1"],
        ["FD temperature must be > 0, got -1.0."],
        no_recipe=True,
    ),
    Case(
        "FedGen generator batch of one",
        ["--config", "recipes/digits_fedgen.yaml", "--strategy.init_args.generator_batch_size", "1"],
        ["FedGen generator_batch_size must be >= 2, got 1."],
        no_recipe=True,
    ),
    Case(
        "FedGen heads of different shapes",
        ["--config", "recipes/digits_fedgen.yaml", "--models", HEADS_32_64],
        ["FedGen", "same parameters and shapes", "same representation size"],
        no_recipe=True,
    ),
    Case(
        "FedTGP server_lr zero",
        ["--config", "recipes/digits_fedtgp.yaml", "--strategy.init_args.server_lr", "0"],
        ["FedTGP server_lr must be > 0, got 0.0."],
        no_recipe=True,
    ),
    Case(
        "FedTGP feature sizes differ",
        ["--config", "recipes/digits_fedtgp.yaml", "--models", HEADS_32_64],
        ["FedTGP", "same feature size"],
        no_recipe=True,
    ),
    Case(
        "FedHKD temperature zero",
        ["--config", "recipes/digits_fedhkd.yaml", "--strategy.init_args.temperature", "0"],
        ["FedHKD temperature must be > 0, got 0.0."],
        no_recipe=True,
    ),
    Case(
        "FedHKD feature sizes differ",
        ["--config", "recipes/digits_fedhkd.yaml", "--models", HEADS_32_64],
        ["FedHKD", "same feature size"],
        no_recipe=True,
    ),
    Case(
        "FedPAC lam negative",
        ["--config", "recipes/digits_fedpac.yaml", "--strategy.init_args.lam", "-1"],
        ["FedPAC lam must be >= 0, got -1.0."],
        no_recipe=True,
    ),
    Case(
        "FedPAC feature sizes differ",
        ["--config", "recipes/digits_fedpac.yaml", "--models", HEADS_32_64],
        ["FedPAC", "same feature size"],
        no_recipe=True,
    ),
    Case(
        "FPL tau zero",
        ["--config", "recipes/digits_fpl.yaml", "--strategy.init_args.tau", "0"],
        ["FPL tau must be > 0, got 0.0."],
        no_recipe=True,
    ),
    Case(
        "FPL feature sizes differ",
        ["--config", "recipes/digits_fpl.yaml", "--models", HEADS_32_64],
        ["FPL", "same feature size"],
        no_recipe=True,
    ),
    Case(
        "FedSA momentum above one",
        ["--config", "recipes/digits_fedsa.yaml", "--strategy.init_args.momentum", "1.5"],
        ["FedSA momentum must be in [0, 1], got 1.5."],
        no_recipe=True,
    ),
    Case(
        "FedSA feature sizes differ",
        ["--config", "recipes/digits_fedsa.yaml", "--models", HEADS_32_64],
        ["FedSA", "same feature size"],
        no_recipe=True,
    ),
    Case(
        "FedL2G warm-up covers every round",
        ["--config", "recipes/digits_fedl2g.yaml", "--strategy.init_args.warm_up_rounds", "40"],
        ["FedL2G's warm_up_rounds (40) cover all 40 rounds", "lower strategy.init_args.warm_up_rounds"],
        no_recipe=True,
    ),
    Case(
        "FedMRL small model wider than a client's",
        [],
        ["FedMRL's small model reads the first d1 = 64", "roles {'global': 32}", "give the small model"],
        recipe={
            "models": {"small": {"builder": "digits_mlp", "args": {"hidden": 64}}},
            "population": {"num_clients": 8, "tiers": [{"name": "all", "roles": ["global", "small"]}]},
            "strategy": {"class_path": "fl_lightning.strategies.FedMRL"},
        },
    ),
    Case(
        "FedPCL temperature zero",
        ["--config", "recipes/digits_fedpcl.yaml", "--strategy.init_args.tau", "0"],
        ["FedPCL tau must be > 0, got 0.0."],
        no_recipe=True,
    ),
    Case(
        "FedPCL features not of unit length",
        ["--config", "recipes/digits_fedpcl.yaml", "--models", MLPS_64],
        ["FedPCL needs unit-length projections", "role 'cnn_small'", "build it with frozen_backbones"],
        no_recipe=True,
    ),
    Case(
        "frozen backbone weights missing",
        [],
        ["backbone weights 'missing.safetensors' for builder 'digits_cnn' not found", "nothing is downloaded"],
        recipe={
            "models": {
                "frozen": {
                    "builder": "frozen_backbones",
                    "args": {"backbones": [{"builder": "digits_cnn", "weights": "missing.safetensors"}]},
                }
            },
            **_tiers({"name": "all", "roles": ["frozen"]}),
            "strategy": {"class_path": "fl_lightning.strategies.FedPCL"},
        },
    ),
    Case(
        "FedKTL generator images of another shape",
        ["--config", "recipes/digits_fedktl.yaml", "--models", MLPS_64_AND_SMALL_IMAGES],
        ["FedKTL's generator role 'generator'", "images [1, 4, 4]", "examples are [1, 8, 8]"],
        no_recipe=True,
    ),
    Case(
        "FedKTL server batch of one",
        ["--config", "recipes/digits_fedktl.yaml", "--strategy.init_args.server_batch_size", "1"],
        ["FedKTL server_batch_size must be >= 2, got 1."],
        no_recipe=True,
    ),
    Case(
        "FedNTD temperature zero",
        ["--config", "recipes/digits_fedntd.yaml", "--strategy.init_args.tau", "0"],
        ["FedNTD tau must be > 0, got 0.0."],
        no_recipe=True,
    ),
    Case(
        "FedNTD on two architectures",
        ["--config", "recipes/digits_fedntd.yaml", "--models", TWO_CNNS, "--population.tiers", TWO_TIERS],
        ["FedNTD is defined for one architecture", "list one role in every tier"],
        no_recipe=True,
    ),
    Case(
        "FedETF temperature zero",
        ["--config", "recipes/digits_fedetf.yaml", "--strategy.init_args.scale_init", "0"],
        ["FedETF scale_init must be > 0, got 0.0."],
        no_recipe=True,
    ),
    Case(
        "FedNH smoothing above one",
        ["--config", "recipes/digits_fednh.yaml", "--strategy.init_args.smoothing", "1.5"],
        ["FedNH smoothing must be"],
        no_recipe=True,
    ),
    Case(
        "CCVR no virtual features",
        ["--config", "recipes/digits_ccvr.yaml", "--strategy.init_args.virtual_per_class", "0"],
        ["CCVR virtual_per_class must be >= 1, got 0."],
        no_recipe=True,
    ),
    Case("test share leaves no example", ["--data.init_args.test_fraction", "0.001"], ["test_fraction 0.001", "raise"]),
    Case("optimizer option misspelled", ["--training.optimizer.init_args.momentun", "0.9"], ["'momentun'", "momentum"]),
    Case("model option one key at a time", ["--models.global.args.width", "0.5"], ["models.global.args", "mapping"]),
    Case("reference not a mapping", ["--reference", "paper"], ["reference"]),
    # ---------------------------------------------------------------- sweep files (flrun sweep)
    Case(
        "sweep file yaml error",
        ["--config", "{tmp}/sweep.yaml"],
        ["sweep.yaml", "line 3"],
        files={"sweep.yaml": b"base: recipes/quickstart.yaml\nparameters: {lr: 1\n"},
        command="sweep",
    ),
    Case(
        "sweep file empty",
        ["--config", "{tmp}/sweep.yaml"],
        ["sweep.yaml", "mapping"],
        files={"sweep.yaml": b""},
        command="sweep",
    ),
    Case("sweep file missing", ["--config", "{tmp}/nosweep.yaml"], ["nosweep.yaml", "sweeps/"], command="sweep"),
    Case(
        "sweep file key misspelled",
        ["--config", "{tmp}/sweep.yaml"],
        ["'n_trial'", "did you mean 'n_trials'"],
        files={"sweep.yaml": b"base: base.yaml\nmetric: global/test_acc\nn_trial: 3\nparameters: {}\n"},
        command="sweep",
    ),
    Case(
        "sweep base from the working directory",
        ["--config", "{tmp}/sweep.yaml"],
        ["base: recipes/quickstart.yaml", "relative to the sweep file's folder"],
        files={"sweep.yaml": b"base: recipes/quickstart.yaml\nmetric: global/test_acc\nparameters: {}\n"},
        command="sweep",
    ),
    Case(
        "sweep type loguniform",
        ["--config", "{tmp}/sweep.yaml"],
        ["'loguniform'", "log: true"],
        files={
            "sweep.yaml": b"base: base.yaml\nmetric: global/test_acc\nparameters: {lr: {type: loguniform}}\n",
            "base.yaml": yaml.safe_dump(TINY).encode(),
        },
        command="sweep",
    ),
    Case(
        "recipe given to sweep", ["--config", "recipes/quickstart.yaml"], ["is a recipe", "flrun fit"], command="sweep"
    ),
    Case(
        "sweep file given to fit",
        ["--config", "sweeps/digits_quickstart.yaml"],
        ["is a sweep file", "flrun sweep"],
        no_recipe=True,
    ),
    Case("several seeds", ["--seed", "0", "1", "2"], ["one seed per run", "for seed in 0 1 2", "flrun table"]),
    Case(
        "OnDeviceKD without its roles",
        ["--strategy", "fl_lightning.strategies.OnDeviceKD"],
        ["OnDeviceKD needs the model roles 'aux'", "models: {aux:"],
    ),
    # ---------------------------------------------------------------- hostile files (more in test_hostile_files.py)
    Case(
        "recipe key given twice",
        ["--config", "{tmp}/twice.yaml"],
        ["twice.yaml", "'rounds' twice", "lines 1 and 3"],
        files={"twice.yaml": b"rounds: 3\nseed: 1\nrounds: 30\n"},
        no_recipe=True,
    ),
    Case(
        "recipe alias bomb",
        ["--config", "{tmp}/bomb.yaml"],
        ["bomb.yaml", "aliases", "10,000"],
        files={"bomb.yaml": BOMB},
        no_recipe=True,
    ),
    Case(
        "recipe nested too deep",
        ["--config", "{tmp}/deep.yaml"],
        ["deep.yaml", "deeper than 100 levels"],
        files={"deep.yaml": b"rounds: " + b"[" * 100_000 + b"]" * 100_000 + b"\n"},
        no_recipe=True,
    ),
    Case(
        "option value with a key twice",
        ["--models", "{global: {builder: digits_mlp}, global: {builder: digits_cnn}}"],
        ["'global' twice"],
    ),
    Case(
        "partition leaves a client empty",
        [
            "--population.num_clients",
            "100",
            "--data.init_args.partitioner.init_args.alpha",
            "0.05",
            "--data.init_args.partitioner.init_args.min_partition_size",
            "0",
        ],
        ["of 100 clients without a training example", "min_partition_size"],
    ),
    Case(
        "run file is a directory",
        ["--output_dir", "{tmp}/run"],
        ["metrics.csv is a directory", "move it away"],
        files={"run/run.json": MARKER, "run/metrics.csv/keep": b""},
    ),
    Case(
        "sweep file key given twice",
        ["--config", "{tmp}/sweep.yaml"],
        ["sweep.yaml", "'metric' twice"],
        files={"sweep.yaml": SWEEP + b"metric: global/test_loss\n"},
        command="sweep",
    ),
    Case(
        "sweep choices not a list",
        ["--config", "{tmp}/sweep.yaml"],
        ["training.batch_size", "choices", "'816'"],
        files={"sweep.yaml": SWEEP.replace(b"[8, 16]", b"'816'")},
        command="sweep",
    ),
    Case(
        "sweep bound not finite",
        ["--config", "{tmp}/sweep.yaml"],
        ["training.optimizer.init_args.lr", "high must be a finite number", "inf"],
        files={"sweep.yaml": SWEEP.replace(b"high: 0.5", b"high: .inf")},
        command="sweep",
    ),
    Case(
        "sweep int bound not whole",
        ["--config", "{tmp}/sweep.yaml"],
        ["training.local_steps", "whole number", "2.5"],
        files={"sweep.yaml": SWEEP.replace(b"low: 1, high: 8", b"low: 2.5, high: 8")},
        command="sweep",
    ),
    Case(
        "sweep int bound too large",
        ["--config", "{tmp}/sweep.yaml"],
        ["training.local_steps", "whole number", "1e+20"],
        files={"sweep.yaml": SWEEP.replace(b"high: 8", b"high: 1.0e+20")},
        command="sweep",
    ),
    Case(
        "sweep step wider than range",
        ["--config", "{tmp}/sweep.yaml"],
        ["training.local_steps", "step must be positive and at most high - low (7)", "20"],
        files={"sweep.yaml": SWEEP.replace(b"high: 8}", b"high: 8, step: 20}")},
        command="sweep",
    ),
    Case(
        "storage not a database",
        ["--config", "{tmp}/sweep.yaml", "--storage", "sqlite:///{tmp}/notes.txt"],
        ["notes.txt is not an SQLite database"],
        files={"sweep.yaml": SWEEP, "notes.txt": b"my notes\n"},
        command="sweep",
    ),
    Case(
        "storage folder under a file",
        ["--config", "{tmp}/sweep.yaml", "--storage", "sqlite:///{tmp}/notes.txt/sweeps/study.db"],
        ["notes.txt is a file, so the folder", "cannot be made"],
        files={"sweep.yaml": SWEEP, "notes.txt": b"my notes\n"},
        command="sweep",
    ),
    Case(
        "storage driver missing",
        ["--config", "{tmp}/sweep.yaml", "--storage", "postgresql+pg8000://me@localhost/studies"],
        ["needs the Python driver pg8000", "not installed"],
        files={"sweep.yaml": SWEEP},
        command="sweep",
    ),
    Case(
        "storage garbage",
        ["--config", "{tmp}/sweep.yaml", "--storage", "not a url at all"],
        ["'not a url at all' is not a database URL"],
        files={"sweep.yaml": SWEEP},
        command="sweep",
    ),
    Case(
        "inspect output without a name",
        ["inspect", "--config", "recipes/quickstart.yaml", "--output"],
        ["--output needs the chart's file name", "e.g. --output partition.png"],
        command="data",
    ),
    Case(
        "inspect output not a chart",
        ["inspect", "--config", "recipes/quickstart.yaml", "--output", "{tmp}/partition.txt"],
        ["partition.txt is not a chart file", "suffix .png, .pdf or .svg"],
        command="data",
    ),
    Case(
        "inspect output a folder",
        ["inspect", "--config", "recipes/quickstart.yaml", "--output", "{tmp}/charts.png"],
        ["charts.png is a folder", "give a file name"],
        files={"charts.png/keep": b""},
        command="data",
    ),
    Case(
        "inspect output in a run folder",
        ["inspect", "--config", "recipes/quickstart.yaml", "--output", "{tmp}/run/partition.png"],
        ["run/partition.png lies in the run folder", "give a path outside it"],
        files={"run/summary.json": b"{}"},
        command="data",
    ),
    Case(
        "table data missing",
        ["paper-9/table-1", "--recipes", "{tmp}/recipes", "--runs", "{tmp}/runs", "--seeds", "0"],
        ["no run was started: 1 of the 1 runs to do lack their data", "CIFAR-10 (1 run) is not in no_such_folder"],
        files={"recipes/cifar.yaml": TABLE_RECIPE},
        command="table",
    ),
    # ---------------------------------------------------------------- every command's options
    Case("option before any command", [], ["unknown command '--bogus'", "use one of"], command="--bogus"),
    Case("unknown option of models", ["--bogus"], ["unknown option --bogus", "flrun models --help"], command="models"),
    Case("argument models takes none of", ["resnet18"], ["unknown argument resnet18"], command="models"),
    Case("unknown option of report", ["{tmp}", "--bogus"], ["unknown option --bogus"], command="report"),
    Case("abbreviated option of report", ["{tmp}", "--out", "x.html"], ["unknown option --out"], command="report"),
    Case(
        "unknown option of sweep",
        ["--config", "{tmp}/sweep.yaml", "--n_job", "2"],
        ["unknown option --n_job", "flrun sweep --help"],
        files={"sweep.yaml": SWEEP},
        command="sweep",
    ),
    Case("unknown option of table", ["paper-001/table-5", "--seed", "1"], ["unknown option --seed"], command="table"),
    Case("unknown option of data fetch", ["fetch", "mnist", "--dir", "d"], ["unknown option --dir"], command="data"),
    # ---------------------------------------------------------------- privacy
    Case("privacy clip zero", ["--privacy.clip", "0", "--privacy.noise_multiplier", "1"], ["privacy.clip", "0.0"]),
    Case("privacy delta one", ["--privacy.delta", "1", "--privacy.noise_multiplier", "1"], ["privacy.delta", "1.0"]),
    Case("privacy epsilon zero", ["--privacy.target_epsilon", "0"], ["privacy.target_epsilon", "positive"]),
    Case("privacy noise negative", ["--privacy.noise_multiplier", "-1"], ["privacy.noise_multiplier", "-1.0"]),
    Case("privacy without noise or budget", ["--privacy.clip", "1"], ["noise_multiplier or a target_epsilon"]),
    Case(
        "privacy plan beyond the budget",
        ["--privacy.noise_multiplier", "0.5", "--privacy.target_epsilon", "1", "--privacy.delta", "1e-3"],
        ["the plan spends epsilon", "privacy.target_epsilon 1"],
    ),
    Case(
        "privacy on the server of FedGH",
        ["--config", str(ROOT / "recipes/digits_fedgh.yaml"), "--privacy.where", "server"]
        + ["--privacy.noise_multiplier", "1", "--privacy.delta", "1e-3"],
        ["where: server", "FedGH", "where: client"],
        no_recipe=True,
    ),
    Case(
        "privacy on the server with clients_per_round",
        ["--strategy.clients_per_round", "{global: 3}", "--privacy.where", "server"]
        + ["--privacy.noise_multiplier", "1", "--privacy.delta", "1e-3"],
        ["where: server", "clients_per_round", "where: client"],
    ),
    Case(
        "privacy in asynchronous mode",
        ["--config", str(ROOT / "recipes/digits_fedhe_async.yaml"), "--privacy.noise_multiplier", "1"]
        + ["--privacy.delta", "1e-3"],
        ["privacy", "schedule"],
        no_recipe=True,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_sentence_with_exit_2(case, tmp_path, capsys):
    for name, content in case.files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(content)
    args = [a.replace("{tmp}", str(tmp_path)) for a in case.args]
    if case.command == "fit" and not case.no_recipe:
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(yaml.safe_dump(_deep_merge(TINY, case.recipe)))
        args = ["--config", str(recipe), *args]
    if case.command == "fit" and "--output_dir" not in args:
        args += ["--output_dir", str(tmp_path / "out")]
    code = run_cli(case.command, *args)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip() and "Warning" not in line]
    assert code == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    message = lines[0]
    for part in case.expect:
        assert part in message, (part, message)
    assert HINT.search(message), message


def test_at_least_sixty_cases():
    assert len(CASES) >= 60 and len({c.id for c in CASES}) == len(CASES)


def test_docs_list_the_errors():
    section = (ROOT / "docs" / "reference" / "errors.md").read_text()
    missing = [c.id for c in CASES if c.id not in section]
    assert not missing, missing
