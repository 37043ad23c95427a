"""MergedCodist: the merge of the FedAvg and distillation directions (paper 002 eq. 2), alpha 1 being FedAdam
exactly, the models sent each way, and a run that resumes exactly."""

import math

import torch
from conftest import check_resume, client_update, fit_recipe, metrics_rows, read_summary
from test_fedavg import LARGE_BYTES, SMALL_BYTES
from test_periodic_codist import NO_STEPS, all_equal, ones_upload, pools_env

from fl_lightning.knowledge.server_optim import merge_gradients
from fl_lightning.strategies import MergedCodist


def test_merge_scales_the_distillation_direction_to_the_fedavg_norm():
    g, delta = {"w": torch.tensor([3.0, 4.0])}, {"w": torch.tensor([1.0, 0.0])}  # norms 5 and 1
    assert torch.equal(merge_gradients(g, delta, 0.5)["w"], torch.tensor([0.5 * 3 + 0.5 * 5, 0.5 * 4]))  # (4, 2)
    assert torch.equal(merge_gradients(g, delta, 0.0)["w"], torch.tensor([5.0, 0.0]))  # ||g|| along delta
    assert merge_gradients(g, delta, 1.0) is g
    assert torch.equal(merge_gradients(g, {"w": torch.zeros(2)}, 0.5)["w"], torch.tensor([1.5, 2.0]))  # no delta


def test_merged_codist_without_distillation_moves_only_by_alpha_times_fedadams_gradient():
    strategy = MergedCodist(alpha=0.5, server_lr=0.01, distillation=NO_STEPS)
    server = pools_env(strategy)
    metrics = strategy.aggregate(1, iter([ones_upload(strategy, server.clients[0])]))
    assert metrics["server/small/distill_to_fedavg_norm"] == 0.0  # the students stayed: delta = 0
    # g = 0.5 x (0 - 1): m = 0.1 g, v = 0.001 g^2; Adam's step m / sqrt(v) does not depend on |g|
    step = 0.01 * 0.1 * 0.5 / (math.sqrt(0.001) * 0.5 + 1e-5)
    assert all_equal(strategy.state.global_weights["small"], step)
    assert all_equal(strategy.state.global_weights["large"], step)


def test_merged_codist_sends_each_pools_model_down_and_back():
    strategy = MergedCodist(distillation=NO_STEPS)
    server = pools_env(strategy)
    high, low = strategy.configure_round(1, [server.clients[0], server.clients[-1]])
    assert {role: sent.nbytes for role, sent in high.downlink.items()} == {"small": SMALL_BYTES, "large": LARGE_BYTES}
    assert {role: sent.nbytes for role, sent in low.downlink.items()} == {"small": SMALL_BYTES}
    update = client_update(strategy, server, low)
    assert {role: sent.nbytes for role, sent in update.uplink.items()} == {"small": SMALL_BYTES}


def test_merged_codist_resumes_exactly(tmp_path):
    """Two rounds stopped after round 1 and resumed equal the uninterrupted run (Adam moments, codistillation)."""
    argv = ["--rounds", "2", "--eval_every", "1", "--training.local_steps", "2"]
    rows = metrics_rows(
        check_resume(tmp_path, "digits_merged_codist", *argv, "--strategy.init_args.distillation.init_args.steps", "2")
    )
    assert all(float(row["server/small/distill_to_fedavg_norm"]) > 0 for row in rows)


def test_merged_codist_with_alpha_one_is_exactly_fedadam(tmp_path):
    """alpha 1 takes FedAdam's update exactly, whatever the distillation gives: the same metrics, round by round."""
    merged = fit_recipe(
        tmp_path / "merged",
        "digits_merged_codist",
        "--rounds",
        "3",
        "--eval_every",
        "1",
        "--strategy.init_args.alpha",
        "1.0",
    )
    fedadam = fit_recipe(tmp_path / "fedadam", "digits_fedadam", "--rounds", "3", "--eval_every", "1")
    assert read_summary(merged)["final"] == read_summary(fedadam)["final"]
    assert read_summary(merged)["best"] == read_summary(fedadam)["best"]
