"""Every kind of jsonargparse error that ``flrun fit`` rewrites becomes its one sentence, word for word.

Each row gives the real ``flrun fit`` parser a bad command line or recipe, takes jsonargparse's own error text,
checks that it still says what the rewriting reads (``raw``), and that the rewriting turns it into the sentence a
user sees. A jsonargparse release that words an error differently fails here: pyproject.toml pins jsonargparse
to the versions these rows pass on, and a new version is admitted only once they pass on it.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field

import pytest
import yaml
from conftest import TINY

STRATEGIES = (
    "CCVR, DSFL, FD, FedAdam, FedAvg, FedDF, FedETF, FedGEMS, FedGen, FedGH, FedGKT, FedHe, FedHKD, FedKD, "
    "FedKTL, FedL2G, FedMD, FedMRL, FedNH, FedNTD, FedPAC, FedPCL, FedProto, FedSA, FedTGP, Felo, FML, FPL, "
    "HeteroFL, LGFedAvg, MergedCodist, MOON, OnDeviceKD, PeriodicCodist, Standalone, Velo"
)
SGD_OPTIONS = "lr, momentum, dampening, weight_decay, nesterov, maximize, foreach, differentiable, fused"
FEDAVG = "fl_lightning.strategies.FedAvg"


@dataclass
class Rewrite:
    """One kind of error: ``args`` after the tiny recipe (changed by ``recipe``), the fragment of jsonargparse's
    text the rewriting depends on, and the sentence it becomes."""

    kind: str
    args: list[str]
    raw: str
    sentence: str
    recipe: dict = field(default_factory=dict)
    no_recipe: bool = False
    env: dict[str, str] = field(default_factory=dict)


REWRITES = [
    Rewrite(
        "unrecognized option",
        ["--roundz", "3"],
        "unrecognized arguments: --roundz 3",
        "unknown option --roundz (did you mean --rounds?); see `flrun fit --help` for the options.",
    ),
    Rewrite(
        "unrecognized positional argument",
        ["recipes/quickstart.yaml"],
        "unrecognized arguments: recipes/quickstart.yaml",
        "unexpected argument 'recipes/quickstart.yaml'; options start with --: give a recipe with --config, "
        "e.g. --config recipes/quickstart.yaml.",
    ),
    Rewrite(
        "unknown top-level key",
        [],
        "Option 'roundz' is not accepted",
        "unknown key 'roundz' in the recipe (did you mean 'rounds'?); check its spelling against `flrun fit --help`.",
        recipe={"roundz": 3},
    ),
    Rewrite(
        "unknown key of a group",
        [],
        "Group 'training' does not accept option 'batch_sise'",
        "unknown key 'training.batch_sise' in the recipe (did you mean 'training.batch_size'?); check its spelling "
        "against `flrun fit --help`.",
        recipe={"training": {"batch_sise": 8}},
    ),
    Rewrite(
        "unknown option of a class",
        ["--data.init_args.test_fractoin", "0.3"],
        "Parser key \"data\": Problem with given class_path 'fl_lightning.data.DigitsData': "
        "Option 'test_fractoin' is not accepted",
        "fl_lightning.data.DigitsData (data) has no option 'test_fractoin' (did you mean 'test_fraction'?); its "
        "options: normalize, test_fraction, test_seed, partitioner, server_fraction, unlabeled_fraction, local_split, "
        "partition_seed, server_dataset, server_examples, pool_test_set "
        "(see `flrun fit --data.help fl_lightning.data.DigitsData`).",
    ),
    Rewrite(
        "unknown option of a class behind a callable",
        ["--training.optimizer.init_args.lrr", "0.1"],
        "expects a function or a callable class: Option 'lrr' is not accepted. "
        "Got value: Namespace(class_path='torch.optim.SGD'",
        f"torch.optim.SGD (training.optimizer) has no option 'lrr' (did you mean 'lr'?); its options: {SGD_OPTIONS} "
        "(see `flrun fit --training.optimizer.help torch.optim.SGD`).",
    ),
    Rewrite(
        "required options missing",
        [],
        "the following arguments are required: data, models, strategy",
        "no data, models, strategy given; pass a recipe that sets them with --config, "
        "e.g. --config recipes/quickstart.yaml.",
        no_recipe=True,
    ),
    Rewrite(
        "init_args not a mapping",
        [],
        f"Parser key \"strategy\": Problem with given class_path '{FEDAVG}': 'list' object has no attribute 'keys'",
        "strategy.init_args must be a mapping of option names to values, not a list; give e.g. init_args: "
        "{roles: ...} (its options: roles, weighted, clients_per_round).",
        recipe={"strategy": {"class_path": FEDAVG, "init_args": [1]}},
    ),
    Rewrite(
        "init_args not a mapping behind a callable",
        [],
        "callable class: 'list' object has no attribute 'keys'. "
        "Got value: Namespace(class_path='torch.optim.SGD', init_args=[0.1])",
        "training.optimizer.init_args must be a mapping of option names to values, not a list; give e.g. init_args: "
        f"{{lr: ...}} (its options: {SGD_OPTIONS}).",
        recipe={"training": {"optimizer": {"class_path": "torch.optim.SGD", "init_args": [0.1]}}},
    ),
    Rewrite(
        "class path outside the trusted modules",
        ["--strategy", "os.path.Foo"],
        "Importing 'os.path.Foo' is not allowed",
        "class_path 'os.path.Foo' for strategy is not in a trusted module (fl_lightning, torch.optim or one named in "
        "FLRUN_TRUSTED_MODULES), so it was not imported: importing a module runs its code; if you trust it, set "
        "FLRUN_TRUSTED_MODULES=os.path.",
    ),
    Rewrite(
        "unknown short class name",
        ["--strategy", "FedProx"],
        'Parser key "strategy": Expected a dot import path string: FedProx',
        f"unknown Strategy 'FedProx' for strategy (did you mean FedProto?); available: {STRATEGIES} (or give the "
        "dotted class_path of your own Strategy).",
    ),
    Rewrite(
        "class path of a missing module",
        ["--strategy", "nosuchpkg.Strategy"],
        "Problem with given class_path 'nosuchpkg.Strategy': No module named 'nosuchpkg'",
        "class_path 'nosuchpkg.Strategy' cannot be imported (No module named 'nosuchpkg') for strategy; available: "
        f"{STRATEGIES} (or give the dotted class_path of your own Strategy).",
        env={"FLRUN_TRUSTED_MODULES": "nosuchpkg"},
    ),
    Rewrite(
        "class path of a missing class",
        ["--strategy", "fl_lightning.strategies.NoSuch"],
        "module 'fl_lightning.strategies' has no attribute 'NoSuch'",
        "class_path 'fl_lightning.strategies.NoSuch' cannot be imported (module 'fl_lightning.strategies' has no "
        f"attribute 'NoSuch') for strategy; available: {STRATEGIES} (or give the dotted class_path of your own "
        "Strategy).",
    ),
    Rewrite(
        "class of the wrong kind",
        ["--strategy", "fl_lightning.data.DigitsData"],
        "Import path fl_lightning.data.DigitsData does not correspond to a subclass of Strategy",
        f"fl_lightning.data.DigitsData is not a Strategy for strategy; available: {STRATEGIES} (or give the dotted "
        "class_path of your own Strategy).",
    ),
    Rewrite(
        "mapping given one key at a time",
        ["--models.global.args.width", "0.5"],
        "Parser key \"args\": Expected a <class 'dict'>. Got value: Namespace(width='0.5')",
        "models.global.args takes a mapping, not one key at a time: give --models.global.args '{width: 0.5}' "
        "(or set it in the recipe).",
    ),
    Rewrite(
        "value outside a Literal's choices",
        ["--training.optimizer_state", "global"],
        "Expected a typing.Literal['reset', 'per_client', 'shared', 'shared_per_phase']. Got value: global",
        "bad value 'global' for training.optimizer_state: use one of reset, per_client, shared, shared_per_phase.",
    ),
    Rewrite(
        "value of the wrong type",
        ["--seed", "abc"],
        "Parser key \"seed\": Expected a <class 'int'>. Got value: abc",
        "bad value 'abc' for seed: expected int; fix it in the recipe or the command line.",
    ),
    Rewrite(
        "value of the wrong type inside a class's options",
        [],
        "Expected a <class 'float'> - Expected a dot import path string: fast Given value type: <class 'str'> "
        "Given value: fast. Got value:",
        "bad value 'fast' for training.optimizer.lr: expected float; fix it in the recipe or the command line.",
        recipe={"training": {"optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": "fast"}}}},
    ),
    Rewrite(
        "mapping expected",
        ["--models", "[1]"],
        "Parser key \"models\": Expected a <class 'dict'>. Got value: [1]",
        "bad value '[1]' for models: expected a mapping (key: value); fix it in the recipe or the command line.",
    ),
]


def _jsonargparse_error(rewrite: Rewrite, tmp_path, monkeypatch) -> tuple[str, object]:
    """jsonargparse's error text for the row's input, from the parser ``flrun fit`` uses, and the parser."""
    from jsonargparse import ArgumentError

    from fl_lightning.run.arguments import DEFAULT_OPTIMIZER, fit_parser

    for name, value in rewrite.env.items():
        monkeypatch.setenv(name, value)
    recipe = copy.deepcopy(TINY)
    recipe.update(rewrite.recipe)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    config = [] if rewrite.no_recipe else ["--config", str(path)]
    parser = fit_parser()  # the trusted modules are read again here, after the row's environment
    with pytest.raises(ArgumentError) as raised:  # what parse_fit does before it reads the error
        parser.parse_args(["--training.optimizer", DEFAULT_OPTIMIZER, *config, *rewrite.args])
    return str(raised.value), parser


def _bundled_choices_only(sentence: str) -> str:
    """``sentence`` without the choices that test modules define (strategies made by other tests in this process
    are the user's own classes to the listing, which names every subclass it can see)."""
    return re.sub(r"(?:test_\w+|conftest)\.[\w.]+, ", "", sentence)


@pytest.mark.parametrize("rewrite", REWRITES, ids=[r.kind for r in REWRITES])
def test_jsonargparse_error_becomes_its_sentence(rewrite, tmp_path, monkeypatch):
    from fl_lightning.run.input_errors import readable

    text, parser = _jsonargparse_error(rewrite, tmp_path, monkeypatch)
    flat = " ".join(line.strip() for line in text.splitlines() if line.strip())
    assert rewrite.raw in flat, f"jsonargparse words this error differently now:\n{flat}"
    assert _bundled_choices_only(readable(text, parser)) == rewrite.sentence, flat


def test_an_unknown_wording_keeps_jsonargparse_words():
    """Text no rewriting recognises is passed on as jsonargparse's last reason, with where to look."""
    from fl_lightning.run.input_errors import readable

    text = 'Parser key "rounds":\n  Something new went wrong.\n  - detail'
    assert readable(text) == "Something new went wrong; see `flrun fit --help`."
