"""Digits normalisation (statistics of the clients' training data only) and the collapsed-model warning."""

import logging

import pytest
import torch
from conftest import method_env

from fl_lightning.client.evaluation import Evaluator
from fl_lightning.data import DigitsData, IidPartitioner
from fl_lightning.federation.population import Tier
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedAvg, Standalone

CONSTANT = {"m": ModelSpec("conftest.constant_logits_model")}  # logits = head bias = (0, ..., 9): always class 9


def _raw(**kwargs) -> DigitsData:
    data = DigitsData(normalize="none", **kwargs)
    data.setup(num_clients=4, seed=0)
    return data


def test_pixel_standardisation_uses_the_clients_training_examples_only():
    split = {"partitioner": IidPartitioner(), "server_fraction": 0.2, "local_split": (0.8, 0.1, 0.1)}
    raw = _raw(**split)
    data = DigitsData(**split)  # normalize: pixel is the default
    data.setup(num_clients=4, seed=0)
    seen = torch.cat([torch.cat([c.train, c.unlabeled]) for c in raw.clients])
    assert len(seen) < 0.75 * len(raw.x)  # the server's share and the local val / test splits are left out
    mean, std = raw.x[seen].mean(0), raw.x[seen].std(0)
    std = torch.where(std > 1e-6, std, torch.ones_like(std))  # digits' blank corners keep std 1
    assert (std == 1).sum() >= 2
    assert torch.allclose(data.x, (raw.x - mean) / std, atol=1e-5)
    assert torch.allclose(data.test_x, (raw.test_x - mean) / std, atol=1e-5)
    trained_on, varies = data.x[seen], std != 1
    assert trained_on.mean(0).abs().max() < 1e-5
    assert torch.allclose(trained_on.std(0)[varies], torch.ones(int(varies.sum())), atol=1e-4)
    assert not trained_on.std(0)[~varies].any()  # constant in the clients' data, still constant


def test_none_keeps_pixels_over_16_and_other_options_standardise_differently():
    raw = _raw()
    assert float(raw.x.min()) == 0.0 and float(raw.x.max()) == 1.0
    seen = torch.cat([torch.cat([c.train, c.unlabeled]) for c in raw.clients])
    for normalize, expected in [
        ("channel", (raw.x - raw.x[seen].mean()) / raw.x[seen].std()),
        ("mean_image", raw.x - raw.x[seen].mean(0)),
    ]:
        data = DigitsData(normalize=normalize)
        data.setup(num_clients=4, seed=0)
        assert torch.allclose(data.x, expected, atol=1e-5), normalize


def test_a_global_model_that_predicts_one_class_is_reported_as_collapsed(caplog):
    strategy = FedAvg()
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])])
    evaluator = Evaluator(server._loop, server.data, server.clients)
    with caplog.at_level(logging.WARNING, logger="fl_lightning.client.evaluation"):
        metrics = strategy.evaluate(evaluator)
    test_y = server.data.test_y
    assert metrics["m/test_top_class_share"] == 1.0
    assert metrics["m/test_acc"] == pytest.approx(float((test_y == 9).float().mean()))
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "m gives one class to 100% of the 359 test examples at round 0" in warnings[0]
    assert "collapsed" in warnings[0]


def test_personal_models_and_one_class_test_sets_raise_no_collapse_warning(caplog):
    strategy = Standalone()
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])])
    evaluator = Evaluator(server._loop, server.data, server.clients)
    with caplog.at_level(logging.WARNING, logger="fl_lightning.client.evaluation"):
        metrics = strategy.evaluate(evaluator)  # a personal model may rightly favour its client's classes
        assert "personal/test_acc" in metrics
        server.data.test_y = torch.full_like(server.data.test_y, 9)  # predicting the only class is no collapse
        assert evaluator.global_model("m", None)["top_class_share"] == 1.0
    assert not caplog.records
