"""Faults injected into the simulation (crash, nan, straggle, drop_upload): seeded per round and client, limited to
the chosen clients, and counted in the metrics and summary as the clients they remove from a round."""

import pytest
from conftest import ROOT, assert_resumed_equals, metrics_rows, read_summary, run_cli, write_recipe

from fl_lightning.federation.errors import ConfigError
from fl_lightning.run.robustness import Faults

CLIENTS, ROUNDS = 8, 4


def _model_bytes():
    from fl_lightning.models import ModelSpec

    model = ModelSpec("digits_mlp", {"hidden": 32}).build()
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def _run(tmp_path, name="run", *extra, **changes):
    out = tmp_path / name
    sampler = {"class_path": "fl_lightning.federation.sampling.UniformSampler", "init_args": {"fraction": 1.0}}
    recipe = write_recipe(tmp_path / f"{name}.yaml", eval_every=1, sampler=sampler, **changes)
    return run_cli("fit", "--config", str(recipe), "--output_dir", str(out), *extra), out


def test_the_draw_is_seeded_per_round_and_client_and_respects_the_chosen_clients():
    faults = Faults(crash=0.3, nan=0.2, straggle=0.2, drop_upload=0.2)
    draws = [faults.draw(0, r, c) for r in range(1, 30) for c in range(8)]
    assert draws == [faults.draw(0, r, c) for r in range(1, 30) for c in range(8)]  # no hidden state
    assert set(draws) == {"crash", "nan", "straggle", "drop_upload", None}
    assert draws != [faults.draw(1, r, c) for r in range(1, 30) for c in range(8)]  # the seed matters
    chosen = Faults(crash=1.0, clients=[2, 5])
    assert [chosen.draw(0, 1, c) for c in range(8)] == [None, None, "crash", None, None, "crash", None, None]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"crash": 1.5}, "faults.crash must be a probability"),
        ({"nan": -0.1}, "faults.nan must be a probability"),
        ({"crash": 0.6, "straggle": 0.6}, "add up to 1.2, more than 1"),
        ({"straggle_factor": 0.5}, "faults.straggle_factor must be at least 1"),
    ],
)
def test_bad_fault_options_are_one_sentence(kwargs, words):
    with pytest.raises(ConfigError, match=words):
        Faults(**kwargs)


def test_unknown_fault_client_exits_2(tmp_path, capsys):
    code, _ = _run(tmp_path, faults={"crash": 0.5, "clients": [3, 99]})
    assert code == 2
    assert "faults.clients names client id(s) [99] but the population has 8 clients" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["crash", "straggle", "drop_upload"])
def test_each_lost_update_kind_is_counted_and_sends_no_uplink(tmp_path, kind):
    code, out = _run(tmp_path, faults={kind: 0.4})
    assert code == 0
    faults = Faults(**{kind: 0.4})
    expected = [sum(faults.draw(0, r, c) == kind for c in range(CLIENTS)) for r in range(1, ROUNDS + 1)]
    assert 0 < sum(expected) < CLIENTS * ROUNDS  # the rate hits some tasks, not all
    rows = metrics_rows(out)
    assert [int(r[f"faults/{kind}"]) for r in rows] == expected
    size = _model_bytes()
    # every client receives the model; only the survivors' uploads reach the server
    assert [int(r["comm/round_downlink_bytes"]) for r in rows] == [CLIENTS * size] * ROUNDS
    assert [int(r["comm/round_uplink_bytes"]) for r in rows] == [(CLIENTS - n) * size for n in expected]
    summary = read_summary(out)
    assert summary["faults"][kind] == sum(expected) and summary["complete"]


def test_nan_fault_stops_by_default_and_is_dropped_with_the_drop_policy(tmp_path, capsys):
    code, _ = _run(tmp_path, "stop", faults={"nan": 0.3})
    assert code == 2
    assert "non-finite uplink global (an injected nan fault)" in capsys.readouterr().err
    code, out = _run(tmp_path, "drop", divergence="drop", faults={"nan": 0.3})
    assert code == 0
    faults = Faults(nan=0.3)
    expected = [sum(faults.draw(0, r, c) == "nan" for c in range(CLIENTS)) for r in range(1, ROUNDS + 1)]
    rows = metrics_rows(out)
    assert [int(r["faults/nan"]) for r in rows] == expected
    assert [int(r["faults/dropped_nonfinite"]) for r in rows] == expected


def test_a_round_without_any_update_keeps_the_server_state(tmp_path):
    code, out = _run(tmp_path, faults={"crash": 1.0})
    assert code == 0
    rows = metrics_rows(out)
    assert [r["faults/phases_without_updates"] for r in rows] == ["1"] * ROUNDS
    assert [r["faults/crash"] for r in rows] == [str(CLIENTS)] * ROUNDS
    assert len({r["global/test_acc"] for r in rows}) == 1  # never aggregated: the initial model each time
    assert read_summary(out)["comm"]["uplink_bytes"] == 0


FAULTY = {"crash": 0.2, "straggle": 0.2, "drop_upload": 0.2, "nan": 0.1}


@pytest.mark.parametrize(
    "recipe", ["digits_fedhe.yaml", "digits_ondevice_kd.yaml", "quickstart.yaml", "digits_fedhe_async.yaml"]
)
def test_methods_complete_on_the_survivors(tmp_path, recipe):
    out = tmp_path / "run"
    args = ["--rounds", "2", "--eval_every", "1", "--output_dir", str(out), "--runtime.progress", "false"]
    args += ["--divergence", "drop", "--faults", str(FAULTY).replace("'", '"')]
    assert run_cli("fit", "--config", str(ROOT / "recipes" / recipe), *args) == 0
    summary = read_summary(out)
    assert summary["complete"] and not summary["diverged"]
    lost = summary["faults"]
    assert lost["crash"] + lost["straggle"] + lost["drop_upload"] + lost["nan"] > 0
    assert lost["dropped_nonfinite"] == lost["nan"]


@pytest.mark.parametrize("recipe", ["quickstart.yaml", "digits_fedhe_async.yaml"])
def test_resume_with_faults_equals_the_uninterrupted_run(tmp_path, recipe):
    base = ["--config", str(ROOT / "recipes" / recipe), "--rounds", "4", "--eval_every", "1"]
    base += ["--runtime.progress", "false", "--divergence", "drop", "--faults", str(FAULTY).replace("'", '"')]
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    assert run_cli("fit", *base, "--output_dir", str(whole)) == 0
    assert run_cli("fit", *base, "--output_dir", str(parts), "--stop_after", "2") == 0
    assert run_cli("fit", *base, "--output_dir", str(parts), "--resume", "auto") == 0
    assert_resumed_equals(parts, whole)
    assert sum(read_summary(whole)["faults"].values()) > 0
