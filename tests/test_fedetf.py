"""FedETF: the ETF logits and balanced loss by hand, the server's averages, the folded evaluation, personalisation."""

import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, phase_tasks, read_summary, run_cli

from fl_lightning.data import DigitsData
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights, TensorPayload
from fl_lightning.knowledge.cosine_classifier import cosine_logits
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedETF
from fl_lightning.strategies.fedetf import balanced_softmax_loss

SMALL = {"small": ModelSpec("digits_cnn", {"width": 0.25})}  # 16 features, a Linear(16, 10) projection
LOCAL = dict(data=DigitsData(local_split=(0.8, 0.1, 0.1)))


def test_cosine_logits_scale_the_cosines_to_the_class_vectors():
    projected = torch.tensor([[3.0, 4.0], [0.0, -2.0]])  # unit: (0.6, 0.8) and (0, -1)
    etf = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    logits = cosine_logits(projected, etf, torch.tensor(2.0))
    assert torch.allclose(logits, torch.tensor([[1.2, -1.2, 1.6], [0.0, 0.0, -2.0]]))


def test_the_balanced_softmax_adds_the_log_class_counts():
    logits = torch.zeros(2, 2)
    log_prior = torch.tensor([3.0, 1.0]).log()
    # softmax(log 3, log 1) = (3/4, 1/4): -log(3/4) = 0.287682 for label 0, -log(1/4) = 1.386294 for label 1
    loss = balanced_softmax_loss(logits, torch.tensor([0, 1]), log_prior)
    assert loss.item() == pytest.approx((-math.log(0.75) - math.log(0.25)) / 2, abs=1e-6)


def test_the_etf_is_a_simplex_fixed_by_the_run_s_seed():
    strategy = FedETF()
    method_env(strategy, SMALL, [Tier("all", ["small"])])
    etf = strategy.state.etf
    gram = etf @ etf.T
    assert torch.allclose(gram.diagonal(), torch.ones(10), atol=1e-6)
    off = gram[~torch.eye(10, dtype=torch.bool)]
    assert torch.allclose(off, torch.full_like(off, -1 / 9), atol=1e-6)
    again = FedETF()
    method_env(again, SMALL, [Tier("all", ["small"])])
    assert torch.equal(again.state.etf, etf) and strategy.state.scale.item() == 1.0


def test_several_architectures_and_bad_options_are_refused():
    two = {"a": SMALL["small"], "b": ModelSpec("digits_mlp", {"hidden": 8})}
    with pytest.raises(ConfigError, match="FedETF is defined for one architecture"):
        method_env(FedETF(), two, [Tier("a", ["a"], count=2), Tier("b", ["b"])])
    with pytest.raises(ConfigError, match="FedETF scale_init must be > 0, got 0.0."):
        FedETF(scale_init=0.0)


def test_the_server_averages_models_and_beta_weighted_by_examples():
    strategy = FedETF()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    uploads = []
    for client, value, n in ((server.clients[0], 1.0, 1), (server.clients[1], 3.0, 3)):
        state = {k: torch.full_like(v, value) for k, v in server.initial_weights("small").items()}
        scale = TensorPayload("scale", {"scale": torch.tensor(value)})
        uploads.append(ClientUpdate(client, n, {"small": ModelWeights("small", state), "scale": scale}))
    metrics = strategy.aggregate(1, iter(uploads))
    # (1 x 1 + 3 x 3) / 4 = 2.5 in every tensor and in beta
    assert metrics == {"etf/scale": 2.5}
    assert all(torch.allclose(w, torch.full_like(w, 2.5)) for w in strategy.state.global_weights["small"].values())


def test_the_folded_model_predicts_the_nearest_class_vector():
    strategy = FedETF()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    strategy.state.scale = torch.tensor(-0.5)  # a negative beta turns the nearest vector into the farthest
    model = server.model("small").eval()
    x = server.data.x[:64]
    with torch.no_grad():
        fedetf = cosine_logits(model.head(model.features(x)), strategy.state.etf, strategy.state.scale)
        model.load_state_dict(strategy.folded(strategy.state.global_weights["small"]))
        folded = model(x)
    assert torch.equal(folded.argmax(1), fedetf.argmax(1))


def test_a_round_sends_the_model_the_etf_and_beta_and_gets_the_model_and_beta_back():
    strategy = FedETF()
    server = method_env(strategy, SMALL, [Tier("all", ["small"])])
    task = strategy.configure_round(1, [server.clients[0]])[0]
    # the model: 2,570 float32; the ETF 10 x 10 and beta: 101 float32
    assert task.downlink["small"].nbytes == 2570 * 4 and task.downlink["etf"].nbytes == 101 * 4
    update = client_update(strategy, server, task)
    assert update.uplink["small"].nbytes == 2570 * 4 and update.uplink["scale"].nbytes == 4
    assert update.uplink["scale"].tensors["scale"].item() != 1.0  # beta trained with the model


def test_personalisation_runs_in_the_last_round_on_every_client_and_moves_the_head_and_etf_only():
    strategy = FedETF(finetune_cycles=1, finetune_epochs=1)
    server = method_env(strategy, SMALL, [Tier("all", ["small"])], rounds=3, **LOCAL)
    assert phase_tasks(strategy, 2, server.clients[:1], "personalize") == []
    tasks = phase_tasks(strategy, 3, server.clients[:1], "personalize")
    assert [t.client.id for t in tasks] == [c.id for c in server.clients]
    state: dict = {}
    plain = client_update(strategy, server, strategy.configure_round(3, [tasks[0].client])[0])
    assert client_update(strategy, server, tasks[0], state).uplink == {}
    personal, trained = state["weights"], plain.uplink["small"].state
    # the round's training is the same (the same batches); the fine-tuning moves only the projection and the ETF
    for name, value in trained.items():
        if not name.startswith("head."):
            assert torch.equal(personal[name], value), name
    folded_trained = strategy.state.etf @ trained["head.weight"]
    assert personal["head.weight"].shape == (10, 16) and not torch.allclose(personal["head.weight"], folded_trained)
    strategy.personalized(3, iter([]))
    assert not strategy.state.personalized  # nobody personalised: nothing to evaluate
    strategy.personalized(3, iter([plain]))
    assert strategy.state.personalized


def test_a_run_reports_the_global_and_the_personal_models(tmp_path):
    recipe = ["--config", str(ROOT / "recipes" / "digits_fedetf.yaml"), "--rounds", "2", "--eval_every", "1"]
    recipe += ["--strategy.init_args.finetune_cycles", "1", "--runtime.progress", "false"]
    assert run_cli("fit", *recipe, "--output_dir", str(tmp_path / "run")) == 0
    summary = read_summary(tmp_path / "run")
    assert {"small/test_acc", "personal/test_acc"} <= set(summary["final"])
    # per round 10 clients: the model and beta up; the model, ETF and beta down, and in round 2 to all 20 again
    comm = summary["comm"]["by_payload"]
    assert comm["uplink"] == {"small": 2 * 10 * 2570 * 4, "scale": 2 * 10 * 4}
    assert comm["downlink"] == {"small": 40 * 2570 * 4, "etf": 40 * 101 * 4}
