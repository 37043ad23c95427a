"""Global models scored on the clients' pooled local val splits when the data has a val share: what a sweep
tunes on instead of the test set."""

import pytest
import torch
from conftest import ROOT, method_env, metrics_rows, read_summary, run_cli

from fl_lightning.client.evaluation import Evaluator
from fl_lightning.data import DigitsData
from fl_lightning.federation.population import Tier
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedAvg

CONSTANT = {"m": ModelSpec("conftest.constant_logits_model")}  # logits = head bias = (0, ..., 9): always class 9


def test_val_scores_are_those_of_the_pooled_val_splits_computed_by_hand():
    data = DigitsData(local_split=(0.8, 0.2, 0.0))
    strategy = FedAvg()
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])], data=data)
    evaluator = Evaluator(server._loop, server.data, server.clients)
    evaluator.begin(1, final=False)
    metrics = strategy.evaluate(evaluator)
    assert set(metrics) == {"m/test_acc", "m/test_loss", "m/test_top_class_share"}  # the strategy's own names
    labels = torch.cat([server.data.y[client.val] for client in server.data.clients])
    assert len(labels) == sum(len(client.val) for client in server.data.clients) > 0
    log_probs = torch.log_softmax(torch.arange(10, dtype=torch.float32), 0)
    assert evaluator.validation_metrics() == {
        "m/val_acc": pytest.approx(float((labels == 9).float().mean())),
        "m/val_loss": pytest.approx(float(-log_probs[labels].mean()), rel=1e-5),
    }
    evaluator.begin(2, final=False)  # a new evaluation starts empty
    assert evaluator.validation_metrics() == {}


def test_without_a_val_share_there_are_no_val_scores():
    strategy = FedAvg()
    server = method_env(strategy, CONSTANT, [Tier("all", ["m"])])
    evaluator = Evaluator(server._loop, server.data, server.clients)
    strategy.evaluate(evaluator)
    assert not evaluator.validating and evaluator.validation_metrics() == {}


def test_a_run_with_a_val_share_writes_val_scores_and_may_monitor_them(tmp_path):
    out = tmp_path / "run"
    argv = ["fit", "--config", str(ROOT / "recipes/quickstart.yaml"), "--rounds", "3", "--eval_every", "1"]
    argv += ["--data.init_args.local_split", "[0.8, 0.2, 0.0]", "--monitor", "global/val_acc"]
    assert run_cli(*argv, "--output_dir", str(out), "--runtime.progress", "false") == 0
    rows = metrics_rows(out)
    assert all(0 <= float(r["global/val_acc"]) <= 1 and float(r["global/val_loss"]) > 0 for r in rows)
    summary = read_summary(out)
    best = max(rows, key=lambda r: float(r["global/val_acc"]))  # the first of equals: > keeps the earlier
    assert summary["best_round"] == int(best["round"])
    assert summary["best"]["global/test_acc"] == pytest.approx(float(best["global/test_acc"]))
