"""Option bounds written as annotations in a signature: a value outside its bound is refused when the object is
built, in one sentence naming the method, the option, the bound and the value, whether it comes from Python,
``fl_lightning.fit`` or ``flrun fit``; a value on the bound is accepted."""

import inspect
from typing import Annotated

import pytest
import yaml
from conftest import ROOT, read_summary, run_cli

import fl_lightning
import fl_lightning.strategies as strategies
from fl_lightning.federation.bounds import Ge, Interval, NonNegative, Positive, PositiveInt, bound_text, violation
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.sampling import UniformSampler
from fl_lightning.strategies import FD, FML, FedAdam, FedAvg, FedKD, FedMD, MergedCodist, PeriodicCodist, Velo
from fl_lightning.strategies.codistillation import Codistillation

QUICKSTART = str(ROOT / "recipes" / "quickstart.yaml")

REFUSED = [
    # (what is built, the sentence): one row per kind of bound
    (lambda: FedMD(temperature=0), "FedMD temperature must be > 0, got 0."),  # Gt
    (lambda: FD(lam=-0.5), "FD lam must be >= 0, got -0.5."),  # Ge
    (lambda: PeriodicCodist(period=0), "PeriodicCodist period must be >= 1, got 0."),  # an integer count
    (lambda: Velo(max_features=1), "Velo max_features must be >= 2, got 1."),  # Ge(2)
    (lambda: FML(beta=1.5), "FML beta must be in [0, 1], got 1.5."),  # Interval, closed
    (lambda: UniformSampler(fraction=0.0), "sampler fraction must be in (0, 1], got 0.0."),  # open below
    (lambda: FedAdam(beta1=1.0), "FedAdam beta1 must be in [0, 1), got 1.0."),  # open above
    (lambda: FedMD(digest_batch_size=0), "FedMD digest_batch_size must be >= 1 (or null), got 0."),  # optional
    (lambda: FedAdam(server_lr={"a": 0.1, "b": 0.0}), "FedAdam server_lr['b'] must be > 0, got 0.0."),  # per role
    (lambda: Codistillation(temperature=float("nan")), "Codistillation temperature must be > 0, got nan."),
    (lambda: Velo(forget=-0.1), "Velo forget must be in [0, 1], got -0.1."),  # Felo's option through **kwargs
    (lambda: MergedCodist(server_lr=-1), "MergedCodist server_lr must be > 0, got -1."),  # FedAdam's
]


@pytest.mark.parametrize("build, sentence", REFUSED, ids=[s.split(" must")[0] for _, s in REFUSED])
def test_a_value_outside_its_bound_is_refused_in_one_sentence(build, sentence):
    with pytest.raises(ConfigError) as raised:
        build()
    assert str(raised.value) == sentence


def test_values_on_the_bound_are_accepted_and_kept():
    assert FD(lam=0.0).lam == 0.0
    fml = FML(alpha=0.0, beta=1.0)
    assert (fml.alpha, fml.beta) == (0.0, 1.0)
    assert UniformSampler(fraction=1.0).fraction == 1.0
    assert PeriodicCodist(period=1).period == 1
    assert Velo(max_features=2).max_features == 2
    assert FedMD(digest_batch_size=None, temperature=1e-9).digest_batch_size is None
    assert FedAdam(beta1=0.0, server_lr={"a": 1e-9}).server_lr == {"a": 1e-9}
    assert Codistillation(mixup=None, student_reg=1.0, steps=0).steps == 0


def test_checks_that_relate_two_options_stay_with_the_class():
    with pytest.raises(ConfigError, match=r"^FedKD needs 0 < energy_start <= energy_end <= 1, got 0.99 and 0.98.$"):
        FedKD(energy_start=0.99)


def test_every_strategys_defaults_lie_within_its_bounds():
    classes = [c for c in vars(strategies).values() if inspect.isclass(c) and issubclass(c, strategies.Strategy)]
    classes.remove(strategies.Strategy)
    assert len(classes) >= 25
    for cls in classes:
        cls()  # raises if a default broke its own bound


def test_a_users_own_strategy_gets_its_bounds_checked_by_declaring_them():
    class Proximal(FedAvg):
        name = "FedProx"

        def __init__(self, mu: NonNegative = 0.01, local_rounds: PositiveInt = 1, **kwargs):
            super().__init__(**kwargs)
            self.mu, self.local_rounds = mu, local_rounds

    assert Proximal(mu=0.0).mu == 0.0
    with pytest.raises(ConfigError) as raised:
        Proximal(0.1, 0)  # positional arguments are checked too
    assert str(raised.value) == "FedProx local_rounds must be >= 1, got 0."


def test_violation_reads_annotated_unions_mappings_and_lists():
    assert violation(Positive, 1) is None
    assert violation(Positive | None, None) is None
    assert violation(Positive | None, 0) == ("", "> 0 (or null)", 0)
    assert violation(list[Annotated[int, Ge(2)]], [3, 1]) == ("[1]", ">= 2", 1)
    assert violation(dict[str, Annotated[float, Interval(gt=0, lt=1)]], {"a": 1.0}) == ("['a']", "in (0, 1)", 1.0)
    assert violation(Positive, "fast") is None  # not a number: the parser's or the class's to refuse
    assert violation(Annotated[float, Interval(ge=0)], -1) == ("", ">= 0", -1)


def test_bound_text_states_the_bound_a_help_line_shows():
    assert bound_text(Positive) == "> 0"
    assert bound_text(PositiveInt | None) == ">= 1"
    assert bound_text(Annotated[float, Interval(gt=0, le=1)]) == "in (0, 1]"
    assert bound_text(dict[str, Positive]) == "each value > 0"
    assert bound_text(list[Annotated[int, Ge(2)]]) == "each >= 2"
    assert bound_text(int) is None and bound_text(int | None) is None


def test_a_strategys_help_names_the_command_and_states_each_bound_beside_its_type(capsys):
    with pytest.raises(SystemExit) as ended:
        run_cli("fit", "--config", QUICKSTART, "--strategy.help", "FedMD")
    assert ended.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # the formatter wraps lines at the terminal's width
    assert text.startswith("usage: flrun fit [--strategy.public_size PUBLIC_SIZE]")
    assert "T of ``digest_loss: kl``. (type: float, > 0, default: 1.0)" in text
    assert "(type: Optional[int], >= 1, default: null)" in text  # digest_batch_size
    assert "(type: Literal['l1', 'mse', 'kl'], default: l1)" in text  # no bound: the type alone


def test_flrun_fit_refuses_an_annotated_option_before_the_run(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["fit", "--config", QUICKSTART, "--strategy", "FedAdam", "--strategy.init_args.server_lr_final", "-0.5"]
    assert run_cli(*argv, "--output_dir", str(out)) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "Warning" not in line]
    assert lines == ["flrun fit: error: FedAdam server_lr_final must be >= 0, got -0.5."]
    assert not out.exists()


def test_fit_from_python_raises_the_same_sentence(tmp_path):
    strategy = {"class_path": "fl_lightning.strategies.FedAdam", "init_args": {"beta2": 1.0}}
    with pytest.raises(ConfigError) as raised:
        fl_lightning.fit(config=QUICKSTART, output_dir=str(tmp_path / "run"), strategy=strategy)
    assert str(raised.value) == "FedAdam beta2 must be in [0, 1), got 1.0."
    assert not (tmp_path / "run").exists()


def test_flrun_fit_accepts_options_on_their_bounds_and_trains(tmp_path):
    out = tmp_path / "out"
    argv = ["fit", "--config", QUICKSTART, "--strategy", "FedAdam", "--strategy.init_args.server_lr_final", "0"]
    argv += ["--strategy.init_args.beta1", "0", "--sampler.init_args.fraction", "1.0"]
    argv += ["--rounds", "1", "--runtime.progress", "false", "--population.num_clients", "4"]
    assert run_cli(*argv, "--output_dir", str(out)) == 0
    summary = read_summary(out)
    assert summary["complete"] and summary["final_round"] == 1 and 0.0 < summary["final"]["global/test_acc"] <= 1.0
    config = yaml.safe_load((out / "config.yaml").read_text())
    assert config["strategy"]["init_args"]["server_lr_final"] == 0.0 and config["strategy"]["init_args"]["beta1"] == 0.0
    assert config["sampler"]["init_args"]["fraction"] == 1.0


def test_an_annotation_that_names_a_type_checkers_only_import_bounds_nothing_and_the_rest_still_hold():
    class Partial(FedAvg):
        def __init__(self, lam: "NonNegative" = 1.0, hook: "NotImportedHere | None" = None):  # noqa: F821
            super().__init__()
            self.lam, self.hook = lam, hook

    assert Partial(hook=object()).lam == 1.0
    with pytest.raises(ConfigError, match=r"^Partial lam must be >= 0, got -1.0.$"):
        Partial(lam=-1.0)
