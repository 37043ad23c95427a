"""Client-level differential privacy of the uploads: the mechanism, its accounting, the recipe section."""

import csv
import math
import sys

import pytest
import torch
from conftest import ROOT, read_summary, run_cli, write_recipe

from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.ledger import CommunicationLedger
from fl_lightning.federation.sampling import PoissonSampler, UniformSampler
from fl_lightning.federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, TensorPayload
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.run.privacy import Privacy, PrivacyMechanism, dp_accounting_module, epsilon_spent

dp_accounting = pytest.importorskip("dp_accounting")  # the `privacy` extra, part of `dev`

CLIENT = ClientSpec(3, "all", ("global",))
POPULATION = [ClientSpec(i, "weak" if i % 2 else "strong", ("global",)) for i in range(8)]


def _mechanism(z=1.0, clip=1.0, where="client", sampler=None, clients=10, rounds=4, classes=10):
    privacy = Privacy(where=where, clip=clip, noise_multiplier=z, delta=1e-3)
    return PrivacyMechanism(privacy, sampler or UniformSampler(), clients, rounds, 1, classes, seed=0)


def _update(uplink, downlink=None):
    task = ClientTask(CLIENT, 1, downlink or {})
    return task, ClientUpdate(CLIENT, 57, uplink)


def _norm(tensors):
    return math.sqrt(sum(float(t.double().square().sum()) for t in tensors))


def _rows(out):
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


# ------------------------------------------------------------------ accounting


@pytest.mark.parametrize("z, rate, steps, delta", [(1.0, 1.0, 3, 1e-5), (0.8, 0.3, 10, 1e-4), (2.0, 0.05, 50, 1e-6)])
def test_epsilon_is_dp_accountings_own(z, rate, steps, delta):
    accountant = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.GaussianDpEvent(z)
    if rate < 1:
        event = dp_accounting.PoissonSampledDpEvent(rate, event)
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    assert epsilon_spent(z, rate, steps, delta) == accountant.get_epsilon(delta)


def test_the_phases_of_a_round_share_one_draw_of_the_clients():
    """Three phases of a round on the same Poisson-sampled clients are one mechanism of the three uploads side by
    side (sensitivity sqrt(3) times the bound), subsampled once a round; without sampling that is 3 steps a round."""
    accountant = dp_accounting.rdp.RdpAccountant()
    round_event = dp_accounting.PoissonSampledDpEvent(0.3, dp_accounting.GaussianDpEvent(1.5 / math.sqrt(3)))
    accountant.compose(dp_accounting.SelfComposedDpEvent(round_event, 4))
    assert epsilon_spent(1.5, 0.3, 12, 1e-5, per_round=3) == accountant.get_epsilon(1e-5)
    assert epsilon_spent(1.5, 1.0, 12, 1e-5, per_round=3) == pytest.approx(epsilon_spent(1.5, 1.0, 12, 1e-5))
    mechanism = PrivacyMechanism(
        Privacy(where="server", noise_multiplier=1.5, delta=1e-5), PoissonSampler(0.3), 8, 4, 3, 10, 0, POPULATION
    )
    assert (mechanism.steps(4), mechanism.epsilon(4)) == (12, accountant.get_epsilon(1e-5))


def test_the_worked_value_of_the_literature():
    # Poisson rate 0.5, noise multiplier 1, 40 steps, delta 1e-5: RDP's epsilon is about 24.4
    assert epsilon_spent(1.0, 0.5, 40, 1e-5) == pytest.approx(24.42, abs=0.01)
    assert epsilon_spent(1.0, 0.5, 0, 1e-5) == 0.0
    assert epsilon_spent(0.0, 1.0, 1, 1e-5) == math.inf


def test_poisson_sampling_amplifies_under_central_noise_only():
    assert _mechanism(where="server", sampler=PoissonSampler(0.25)).rate == 0.25
    assert _mechanism(where="client", sampler=PoissonSampler(0.25)).rate == 1.0  # the server knows who was sampled
    assert _mechanism(where="server", sampler=UniformSampler(0.25)).rate == 1.0  # a fixed-size draw: no amplification


def test_calibration_meets_the_target_and_a_plan_beyond_it_is_refused():
    privacy = Privacy(clip=1.0, target_epsilon=2.0, delta=1e-3)
    mechanism = PrivacyMechanism(privacy, UniformSampler(), 10, 5, 2, 10, 0)
    assert mechanism.planned_steps == 10
    assert 1.99 <= mechanism.epsilon(5) <= 2.0
    assert epsilon_spent(mechanism.noise_multiplier * 0.99, 1.0, 10, 1e-3) > 2.0  # the smallest that meets it
    with pytest.raises(ConfigError, match=r"the plan spends epsilon .* more than privacy.target_epsilon 2"):
        PrivacyMechanism(
            Privacy(noise_multiplier=1.0, target_epsilon=2.0, delta=1e-3), UniformSampler(), 10, 5, 2, 10, 0
        )


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"target_epsilon": 0.0}, "privacy.target_epsilon must be positive, got 0.0"),
        ({"target_epsilon": -1.0}, "privacy.target_epsilon must be positive"),
        ({"noise_multiplier": 1.0, "delta": 0.0}, "privacy.delta must be between 0 and 1"),
        ({"noise_multiplier": 1.0, "delta": 1.0}, "privacy.delta must be between 0 and 1"),
        ({"noise_multiplier": -0.5}, "privacy.noise_multiplier must be 0 or more, got -0.5"),
        ({"noise_multiplier": 1.0, "clip": 0.0}, "privacy.clip must be a positive L2 bound, got 0.0"),
        ({}, "privacy needs a noise_multiplier or a target_epsilon"),
    ],
)
def test_wrong_settings_are_refused_in_one_sentence(kwargs, words):
    with pytest.raises(ConfigError, match=words) as err:
        Privacy(**kwargs)
    assert str(err.value).replace("e.g. ", "").count(". ") == 0 and str(err.value).endswith(".")  # one sentence


def test_a_delta_above_one_over_the_clients_warns():
    with pytest.warns(UserWarning, match=r"privacy.delta 0.2 is above 1 / 10 clients"):
        PrivacyMechanism(Privacy(noise_multiplier=1.0, delta=0.2), UniformSampler(), 10, 4, 1, 10, 0)


def test_without_the_package_privacy_is_refused_naming_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "dp_accounting", None)  # as if not installed
    with pytest.raises(ConfigError, match=r"install the extra with pip install 'fl-lightning\[privacy\]'"):
        dp_accounting_module()


# ------------------------------------------------------------------ the mechanism


def test_the_noise_has_the_standard_deviation_noise_multiplier_times_the_bound():
    mechanism = _mechanism(z=0.7, clip=2.0)
    task, update = _update({"logits": TensorPayload("logits", {"z": torch.zeros(400_000)})})
    noise = mechanism.privatize("FD", task, update, 0).uplink["logits"].tensors["z"]
    assert float(noise.std()) == pytest.approx(1.4, rel=0.01)
    assert abs(float(noise.mean())) < 0.01
    assert update.num_samples == 1  # the example count is not sent


def test_a_huge_payload_is_clipped_to_the_bound_as_a_whole():
    mechanism = _mechanism(z=0.0, clip=3.0)
    uplink = {
        "a": TensorPayload("a", {"x": torch.full((100,), 1e6)}),
        "b": TensorPayload("b", {"y": torch.full((10, 10), -1e6)}),
    }
    task, update = _update(uplink)
    sent = mechanism.privatize("FD", task, update, 0).uplink
    assert _norm([sent["a"].tensors["x"], sent["b"].tensors["y"]]) == pytest.approx(3.0, rel=1e-6)
    small = {"a": TensorPayload("a", {"x": torch.tensor([0.6, 0.8])})}  # norm 1, below the bound: unchanged
    assert torch.equal(mechanism.privatize("FD", *_update(small), 0).uplink["a"].tensors["x"], torch.tensor([0.6, 0.8]))


def test_weights_are_bounded_as_their_change_and_counters_go_back_as_received():
    mechanism = _mechanism(z=0.0, clip=1.0)
    received = {"w": torch.full((4,), 5.0), "steps": torch.tensor(7)}
    trained = {"w": torch.tensor([15.0, 5.0, 5.0, 5.0]), "steps": torch.tensor(12)}
    task, update = _update({"global": ModelWeights("global", trained)}, {"global": ModelWeights("global", received)})
    sent = mechanism.privatize("FedAvg", task, update, 0).uplink["global"].state
    assert torch.allclose(sent["w"], torch.tensor([6.0, 5.0, 5.0, 5.0]))  # a change of 10 clipped to 1
    assert int(sent["steps"]) == 7


def test_class_tables_go_whole_so_the_held_classes_are_not_sent():
    mechanism = _mechanism(z=0.0, clip=100.0, classes=4)
    table = ClassStatistics("lars", {"representations": torch.tensor([[1.0, 2.0], [3.0, 4.0]])}, torch.tensor([1, 3]))
    sent = mechanism.privatize("FedGH", *_update({"lars": table}), 0).uplink["lars"]
    assert sent.labels.tolist() == [0, 1, 2, 3]
    assert sent.vectors["representations"].tolist() == [[0, 0], [1, 2], [0, 0], [3, 4]]


@pytest.mark.parametrize(
    "payload, words",
    [
        (TensorPayload("features", {"labels": torch.tensor([1, 2])}), "its torch.int64 tensor 'labels'"),
        (
            ClassStatistics("p", {"prototypes": torch.ones(1, 2), "counts": torch.ones(1, 1)}, torch.tensor([0])),
            "it carries per-class counts",
        ),
    ],
)
def test_a_payload_the_bound_cannot_cover_is_refused_naming_method_and_payload(payload, words):
    with pytest.raises(ConfigError, match=rf"privacy cannot bound FedX's upload 'up': {words}") as err:
        _mechanism().privatize("FedX", *_update({"up": payload}), 0)
    assert str(err.value).endswith("run FedX without privacy.")


def _central(z=1.0, clip=2.0, sampler=None, population=POPULATION):
    privacy = Privacy(where="server", clip=clip, noise_multiplier=z, delta=1e-3)
    sampler = sampler or PoissonSampler(0.25)
    mechanism = PrivacyMechanism(privacy, sampler, len(population), 4, 1, 10, seed=0, population=population)
    mechanism.begin_round(1)
    return mechanism


def test_central_noise_is_on_the_sum_and_only_on_the_server():
    central = _central(z=1.0, clip=2.0)
    zeros = {"w": torch.zeros(200_000), "n": torch.zeros(3, dtype=torch.long)}
    noised, _ = central.central_noise(zeros, POPULATION)
    assert float(noised["w"].std()) == pytest.approx(2.0, rel=0.01)  # z S on the sum: one client moves it by S
    assert torch.equal(noised["n"], zeros["n"])  # integers stay
    assert not torch.equal(central.central_noise(zeros, POPULATION)[0]["w"], noised["w"])  # each aggregate its own
    with pytest.raises(RuntimeError, match="never adds"):
        _mechanism(where="client").central_noise(zeros, POPULATION)


@pytest.mark.parametrize(
    "sampler, senders, expected",
    [
        (PoissonSampler(0.25), POPULATION, 2.0),  # 8 clients at rate 1/4
        (PoissonSampler(0.25), POPULATION[:3], 0.75),  # the 3 that may send to this aggregate
        (PoissonSampler(0.5, tiers=["weak"]), POPULATION, 2.0),  # 4 weak clients at 1/2, the strong never
        (UniformSampler(num_per_round=3), POPULATION, 3.0),
        (UniformSampler(fraction=0.5, tiers=["strong"]), POPULATION, 2.0),  # 2 of the 4 strong
    ],
)
def test_the_central_denominator_is_the_expected_number_of_uploads(sampler, senders, expected):
    assert _central(sampler=sampler).expected_count(senders) == expected
    assert _central(sampler=sampler).central_noise({"w": torch.zeros(2)}, senders)[1] == expected


def test_a_sampler_without_sampling_probabilities_is_refused_for_central_noise():
    class Firsts(UniformSampler):
        def inclusion(self, clients):
            raise NotImplementedError

    with pytest.raises(ConfigError, match=r"which Firsts does not give .*; use UniformSampler or PoissonSampler"):
        _central(sampler=Firsts())


def _fedavg_with_central_noise(sampler):
    from conftest import method_env

    from fl_lightning.federation.population import Tier
    from fl_lightning.models import ModelSpec
    from fl_lightning.strategies import FedAvg

    strategy = FedAvg(weighted=False)
    server = method_env(strategy, {"global": ModelSpec("digits_mlp", {"hidden": 4})}, [Tier("all", ["global"])])
    mechanism = PrivacyMechanism(
        Privacy(where="server", clip=100.0, noise_multiplier=0.0, delta=1e-3), sampler, 4, 1, 1, 10, 0, server.clients
    )
    mechanism.begin_round(1)
    server.central_noise = mechanism.central_noise
    return strategy, server


def test_central_fedavg_divides_the_sum_of_the_changes_by_the_expected_count():
    """Three uploads whose changes are 1, 2 and 3 everywhere, 4 clients Poisson-sampled at 1/2: the new weights are
    the sent ones plus (1 + 2 + 3) / 2 = 3, not plus their mean 2 over the 3 that came."""
    strategy, server = _fedavg_with_central_noise(PoissonSampler(0.5))
    sent = {k: v.clone() for k, v in strategy.state.global_weights["global"].items()}
    updates = [
        ClientUpdate(
            server.clients[i], 1, {"global": ModelWeights("global", {k: v + (i + 1) for k, v in sent.items()})}
        )
        for i in range(3)
    ]
    new = strategy.client_averages(iter(updates))["global"]
    for key, value in sent.items():
        assert torch.allclose(new[key], value + 3.0, atol=1e-5), key
    # a uniform draw of 3 of the 4: the same changes over 3
    strategy, server = _fedavg_with_central_noise(UniformSampler(num_per_round=3))
    new = strategy.client_averages(iter(updates))["global"]
    assert all(torch.allclose(new[k], v + 2.0, atol=1e-5) for k, v in sent.items())


def test_central_fd_and_fedproto_divide_the_noised_sums_by_the_expected_count():
    """Per-class tables of 1, 2 and 3 everywhere from 3 of 8 clients at rate 1/4: the server's class means are
    6 / 2 = 3, and FD's teacher of a client that sent the 1s leaves it out: (6 - 1) / (2 - 1) = 5."""
    from conftest import method_env

    from fl_lightning.federation.population import Tier
    from fl_lightning.models import ModelSpec
    from fl_lightning.strategies import FD, FedProto

    models = {"m": ModelSpec("digits_mlp", {"hidden": 4})}
    for strategy, name, key in ((FD(), "class_logits", "logits"), (FedProto(), "local_prototypes", "prototypes")):
        server = method_env(strategy, models, [Tier("all", ["m"])], num_clients=8)
        mechanism = PrivacyMechanism(
            Privacy(where="server", clip=1e3, noise_multiplier=0.0, delta=1e-3), PoissonSampler(0.25), 8, 1, 1, 10, 0,
            server.clients,
        )  # fmt: skip
        mechanism.begin_round(1)
        server.central_noise, server.whole_class_tables = mechanism.central_noise, True
        dim = 10 if name == "class_logits" else 4  # FD: a logit per class; FedProto: the 4 features
        updates = [
            ClientUpdate(server.clients[i], 1, {name: ClassStatistics(name, {key: table}, torch.arange(10))})
            for i, table in enumerate(torch.full((3, 10, dim), 1.0).cumsum(0))
        ]
        strategy.aggregate(1, iter(updates))
        if isinstance(strategy, FD):
            state = strategy.state
            assert torch.allclose(
                state.round_sums / state.round_counts[:, None], torch.tensor(3.0, dtype=torch.float64)
            )
            teacher = strategy.teacher(server.clients[0])
            assert torch.allclose(teacher.tensors["logits"], torch.tensor(5.0))
        else:
            assert torch.allclose(strategy.state.bank.mean(), torch.tensor(3.0))


def test_the_poisson_sampler_takes_each_client_with_its_rate():
    import numpy as np

    clients = [ClientSpec(i, "all", ("global",)) for i in range(200)]
    sampler = PoissonSampler(0.3)
    sizes = [len(sampler.sample(r, clients, np.random.default_rng(r))) for r in range(50)]
    assert sum(sizes) / (50 * 200) == pytest.approx(0.3, abs=0.02)
    assert len(set(sizes)) > 5  # the number varies from round to round
    assert PoissonSampler(0.01).sample(1, clients[:3], np.random.default_rng(0)) == []  # a round may be empty
    with pytest.raises(ConfigError, match="sampler rate must be in"):
        PoissonSampler(0.0)


# ------------------------------------------------------------------ runs


def _privacy_run(tmp_path, name, *extra, rounds=4, **changes):
    out = tmp_path / name
    privacy = {"where": "client", "clip": 1.0, "noise_multiplier": 1.2, "delta": 1e-3}
    privacy.update(changes.pop("privacy", {}))
    recipe = write_recipe(tmp_path / f"{name}.yaml", rounds=rounds, eval_every=1, privacy=privacy, **changes)
    return run_cli("fit", "--config", str(recipe), "--output_dir", str(out), *extra), out


def test_each_round_reports_the_epsilon_spent_and_the_summary_its_block(tmp_path):
    code, out = _privacy_run(tmp_path, "run")
    assert code == 0
    expected = [epsilon_spent(1.2, 1.0, r, 1e-3) for r in range(1, 5)]
    assert [float(row["privacy/epsilon"]) for row in _rows(out)] == expected
    block = read_summary(out)["privacy"]
    assert block == {
        "epsilon": expected[-1],
        "delta": 1e-3,
        "noise_multiplier": 1.2,
        "clip": 1.0,
        "sampling_rate": 1.0,
        "steps": 4,
        "accountant": "rdp",
        "where": "client",
    }


def test_the_progress_line_shows_the_epsilon_spent(tmp_path, capsys):
    code, _ = _privacy_run(tmp_path, "run", "--runtime.progress", "true", rounds=2)
    assert code == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("round ")]
    for rnd, line in enumerate(lines, 1):
        assert f"  epsilon {epsilon_spent(1.2, 1.0, rnd, 1e-3):.3g}  " in line
    assert len(lines) == 2


def test_central_noise_with_poisson_sampling_is_amplified_and_survives_empty_rounds(tmp_path):
    poisson = {"class_path": "fl_lightning.federation.sampling.PoissonSampler", "init_args": {"rate": 0.1}}
    code, out = _privacy_run(tmp_path, "poisson", sampler=poisson, privacy={"where": "server"})
    assert code == 0
    rows = _rows(out)
    assert "0" in [row["clients"] for row in rows]  # 8 clients at rate 0.1: a round without any
    block = read_summary(out)["privacy"]
    assert (block["sampling_rate"], block["steps"], block["where"]) == (0.1, 4, "server")
    assert block["epsilon"] == epsilon_spent(1.2, 0.1, 4, 1e-3) < epsilon_spent(1.2, 1.0, 4, 1e-3)


def test_resume_continues_the_accountant_and_the_noise_exactly(tmp_path):
    assert _privacy_run(tmp_path, "whole")[0] == 0
    code, cut = _privacy_run(tmp_path, "cut", "--stop_after", "2")
    assert code == 0 and read_summary(cut)["privacy"]["steps"] == 2
    assert _privacy_run(tmp_path, "cut", "--resume", "auto")[0] == 0
    whole, resumed = _rows(tmp_path / "whole"), _rows(cut)
    for key in ("privacy/epsilon", "global/test_acc", "global/test_loss"):
        assert [row[key] for row in resumed] == [row[key] for row in whole]
    assert read_summary(cut)["privacy"] == read_summary(tmp_path / "whole")["privacy"]


def test_a_longer_resume_keeps_the_calibrated_noise_and_its_budget(tmp_path, capsys):
    budget = {"noise_multiplier": None, "target_epsilon": 4.0}
    code, out = _privacy_run(tmp_path, "run", rounds=2, privacy=budget)
    assert code == 0
    z = read_summary(out)["privacy"]["noise_multiplier"]
    assert epsilon_spent(z, 1.0, 2, 1e-3) == pytest.approx(4.0, abs=0.01)
    # three rounds would calibrate a larger multiplier; the two rounds done used this one, and a third exceeds 4
    code, _ = _privacy_run(tmp_path, "run", "--resume", "auto", rounds=3, privacy=budget)
    assert code == 2
    assert "the plan spends epsilon" in capsys.readouterr().err


def test_a_plan_beyond_the_target_is_refused_before_round_one(tmp_path, capsys):
    code, out = _privacy_run(tmp_path, "over", privacy={"target_epsilon": 1.0})
    assert code == 2
    assert "the plan spends epsilon" in capsys.readouterr().err
    assert not (out / "metrics.csv").exists()


def test_central_noise_is_refused_for_a_server_that_uses_each_upload(tmp_path, capsys):
    recipe = ROOT / "recipes" / "digits_fedgh.yaml"
    out = tmp_path / "gh"
    flags = ["--privacy.where", "server", "--privacy.noise_multiplier", "1", "--privacy.delta", "1e-3"]
    assert run_cli("fit", "--config", str(recipe), "--rounds", "1", "--output_dir", str(out), *flags) == 2
    assert "FedGH's server uses each upload on its own; use where: client." in capsys.readouterr().err


def _uplinks(monkeypatch):
    """Every payload the ledger counts, in order: (direction, payloads)."""
    seen = []
    record = CommunicationLedger.record

    def spy(self, rnd, direction, payloads):
        seen.append((direction, dict(payloads)))
        return record(self, rnd, direction, payloads)

    monkeypatch.setattr(CommunicationLedger, "record", spy)
    return seen


@pytest.mark.parametrize("method", ["fedavg", "fedproto", "fd", "fedgh"])
def test_every_upload_passes_the_mechanism(method, tmp_path, monkeypatch):
    """Without noise, every upload the ledger counts is within the bound: clipped, so it went through the mechanism
    (unclipped, each is hundreds of times larger); class tables arrive whole."""
    seen = _uplinks(monkeypatch)
    bound = 1e-3
    flags = ["--privacy.clip", str(bound), "--privacy.noise_multiplier", "0", "--privacy.delta", "1e-3"]
    if method == "fedavg":
        recipe = write_recipe(tmp_path / "r.yaml", rounds=1)
        argv = ["--config", str(recipe)]
    else:
        argv = ["--config", str(ROOT / "recipes" / f"digits_{method}.yaml"), "--training.local_epochs", "1"]
    assert run_cli("fit", *argv, "--rounds", "1", "--output_dir", str(tmp_path / "run"), *flags) == 0
    uploads = 0
    for i, (direction, payloads) in enumerate(seen):
        if direction != "uplink":
            continue
        uploads += 1
        parts = []
        for name, payload in payloads.items():
            if isinstance(payload, ModelWeights):  # its change from what the client received just before
                received = seen[i - 1][1][name].state
                parts += [v - received[k] for k, v in payload.state.items() if v.dtype.is_floating_point]
            elif isinstance(payload, ClassStatistics):
                assert payload.labels.tolist() == list(range(10))
                parts += list(payload.vectors.values())
            else:
                parts += list(payload.tensors.values())
        assert 0 < _norm(parts) <= bound * (1 + 1e-4)
    assert uploads >= 4


# ------------------------------------------------------------------ votes on a public set: PATE's GNMax


def test_votes_with_central_noise_are_pates_gnmax_in_its_accounting():
    """GNMax answers each of n public examples with the noisy argmax of the vote counts, noise sigma on every
    count; one client changes one count of each example by 1 (add or remove), so its data-independent RDP is n
    Gaussian mechanisms of sigma. The same noise here is the noise multiplier sigma / sqrt(n) on the vote table,
    clipped at sqrt(n) (a client's n one-hot rows): the same epsilon."""
    n, sigma = 50, 40.0
    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.SelfComposedDpEvent(dp_accounting.GaussianDpEvent(sigma), n))
    assert epsilon_spent(sigma / math.sqrt(n), 1.0, 1, 1e-5) == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)


def test_ds_fl_releases_the_plurality_of_the_votes_over_the_expected_count():
    """Votes of 3 of 8 clients (rate 1/2: 4 expected) on 2 open examples, without noise: the classes 1 (two votes
    to one) and 3 go back one-hot; the soft labels of sa are the counts over 4, not over the 3 that came."""
    from conftest import method_env

    from fl_lightning.data import DigitsData
    from fl_lightning.federation.population import Tier
    from fl_lightning.models import ModelSpec
    from fl_lightning.strategies import DSFL

    votes = [[1, 2], [1, 3], [0, 3]]
    for aggregation in ("plurality", "sa"):
        strategy = DSFL(upload="votes", aggregation=aggregation)
        models = {"m": ModelSpec("digits_mlp", {"hidden": 4})}
        server = method_env(strategy, models, [Tier("all", ["m"])], num_clients=8, data=DigitsData(server_fraction=0.2))
        privacy = Privacy(where="server", clip=10.0, noise_multiplier=0.0, delta=1e-3)
        mechanism = PrivacyMechanism(privacy, PoissonSampler(0.5), 8, 1, 1, 10, 0, server.clients)
        mechanism.begin_round(1)
        server.central_noise = mechanism.central_noise
        updates = [
            ClientUpdate(server.clients[i], 1, {"open_outputs": TensorPayload("open_outputs", {"outputs": one_hot(v)})})
            for i, v in enumerate(votes)
        ]
        strategy.aggregate_soft_labels(1, iter(updates))
        if aggregation == "plurality":
            assert torch.equal(strategy.global_probs, one_hot([1, 3]))
        else:
            assert torch.allclose(strategy.global_probs[0, [0, 1]], torch.tensor([0.25, 0.5]))
            assert torch.allclose(strategy.global_probs[1, 3], torch.tensor(0.5))


def one_hot(classes):
    return torch.nn.functional.one_hot(torch.tensor(classes), 10).float()


def test_ds_fl_votes_go_up_as_one_hot_rows_and_the_distill_phase_is_no_step(tmp_path, monkeypatch):
    seen = _uplinks(monkeypatch)
    flags = ["--strategy.upload", "votes", "--strategy.aggregation", "plurality", "--strategy.open_size", "40"]
    flags += ["--privacy.where", "server", "--privacy.clip", "100", "--privacy.noise_multiplier", "0"]
    flags += ["--privacy.delta", "1e-3", "--training.local_steps", "2", "--strategy.distill_steps", "2"]
    out = tmp_path / "run"
    recipe = str(ROOT / "recipes" / "digits_dsfl.yaml")
    assert run_cli("fit", "--config", recipe, "--rounds", "1", "--output_dir", str(out), *flags) == 0
    votes = [p["open_outputs"].tensors["outputs"] for d, p in seen if d == "uplink" and "open_outputs" in p]
    assert len(votes) == 10
    for table in votes:
        assert (
            table.shape == (40, 10)
            and torch.equal(table.sum(1), torch.ones(40))
            and set(table.unique().tolist()) == {0, 1}
        )
    assert read_summary(out)["privacy"]["steps"] == 1  # the distill phase sends nothing the server uses


def test_the_how_to_names_every_method_with_central_noise():
    import inspect

    import fl_lightning.strategies as strategies
    from fl_lightning.strategies.base import Strategy

    text = " ".join((ROOT / "docs" / "howto" / "privacy.md").read_text().split())
    sentence = text[text.index("Only methods whose server sums or averages") :].split(";")[0]
    central = {
        cls.name
        for cls in vars(strategies).values()
        if inspect.isclass(cls) and issubclass(cls, Strategy) and cls.central_privacy
    }
    assert central >= {"FedAvg", "FedProto", "FD", "DS-FL"}
    assert [name for name in sorted(central) if name not in sentence] == []


DIGITS_RECIPES = sorted(path.stem for path in (ROOT / "recipes").glob("digits_*.yaml"))
# the recipes privacy refuses, and why: uploads it cannot bound, or asynchronous rounds
REFUSED = {
    "digits_fedgen": "privacy cannot bound FedGen's upload 'label_counts': its torch.int32 tensor 'counts'",
    "digits_fedgkt": "privacy cannot bound FedGKT's upload 'features': its torch.int32 tensor 'labels'",
    "digits_fedkd": "privacy cannot bound FedKD's upload 'mentee_update': a LowRankUpdate is no payload kind",
    "digits_heterofl": "privacy cannot bound HeteroFL's upload 'label_split': its torch.bool tensor 'classes'",
    "digits_fedhe_async": "privacy accounts synchronous rounds only",
    "digits_ccvr": "privacy cannot bound CCVR's upload 'class_moments': its torch.int64 tensor 'labels'",
    "digits_fednh": "privacy cannot bound FedNH's upload 'class_means': its torch.int64 tensor 'labels'",
    "digits_fedhkd": "privacy cannot bound FedHKD's upload 'hyper_knowledge': it carries per-class counts",
    "digits_fedpac": "privacy cannot bound FedPAC's upload 'local_prototypes': it carries per-class counts",
}


@pytest.mark.slow
@pytest.mark.parametrize("recipe", DIGITS_RECIPES)
def test_every_upload_of_every_method_passes_the_mechanism_or_is_refused(recipe, tmp_path, monkeypatch, capsys):
    """One round of each digits recipe with privacy and no noise: every payload the ledger counts is one the
    mechanism let out, within the bound; or the run is refused in one sentence before that upload leaves."""
    let_out = []  # (what the client received, what the mechanism sent) of every upload

    privatize = PrivacyMechanism.privatize

    def spy(self, method, task, update, phase):
        update = privatize(self, method, task, update, phase)
        let_out.append((dict(task.downlink), dict(update.uplink)))
        return update

    monkeypatch.setattr(PrivacyMechanism, "privatize", spy)
    seen = _uplinks(monkeypatch)
    bound = 1e-3
    flags = ["--privacy.clip", str(bound), "--privacy.noise_multiplier", "0", "--privacy.delta", "1e-3"]
    rounds = "2" if recipe == "digits_fedl2g" else "1"  # FedL2G's clients start training after its warm-up round
    argv = ["--config", str(ROOT / "recipes" / f"{recipe}.yaml"), "--rounds", rounds, "--eval_every", rounds]
    code = run_cli("fit", *argv, "--output_dir", str(tmp_path / "run"), *flags)
    if recipe in REFUSED:
        assert code == 2 and REFUSED[recipe] in capsys.readouterr().err
        return
    assert code == 0
    sent = {id(payload) for _, uplink in let_out for payload in uplink.values()}
    uploads = [payloads for direction, payloads in seen if direction == "uplink" and payloads]
    assert uploads and all(id(payload) in sent for payloads in uploads for payload in payloads.values())
    for received, uplink in let_out:
        parts = []
        for name, payload in uplink.items():
            if isinstance(payload, ModelWeights):
                base = received.get(name)
                reference = base.state if isinstance(base, ModelWeights) else {}
                for key, value in payload.state.items():
                    if value.dtype.is_floating_point:
                        ref = reference.get(key)
                        parts.append(value - ref.to(value) if ref is not None and ref.shape == value.shape else value)
            elif isinstance(payload, ClassStatistics):
                parts += list(payload.vectors.values())
            else:
                parts += list(payload.tensors.values())
        assert _norm(parts) <= bound * (1 + 1e-4), recipe
