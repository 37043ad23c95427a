"""Non-finite client updates and metrics: ``divergence: stop`` ends the run with exit 2 and one sentence naming the
round, client and part; ``drop`` leaves the client out of the round's aggregate and counts it."""

import math

import numpy as np
import pytest
import torch
from conftest import ROOT, metrics_rows, read_summary, run_cli, write_recipe

from fl_lightning.federation.types import ClientSpec, ClientUpdate, ModelWeights, TensorPayload
from fl_lightning.run.robustness import all_finite, nonfinite_metrics, nonfinite_parts


def test_quickstart_with_lr_1e6_stops_with_exit_2_and_one_sentence(tmp_path, capsys):
    out = tmp_path / "run"
    code = run_cli(
        "fit",
        "--config",
        str(ROOT / "recipes/quickstart.yaml"),
        "--rounds",
        "2",
        "--training.optimizer.init_args.lr",
        "1e6",
        "--output_dir",
        str(out),
        "--runtime.progress",
        "false",
    )
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert err.startswith("flrun fit: error: round 1 diverged: client ")
    assert "non-finite uplink global" in err and "lower the learning rate" in err
    summary = read_summary(out)
    assert summary["diverged"] is True and summary["diverged_round"] == 1
    assert summary["rounds"] == 0 and not summary["complete"]
    assert "lower the learning rate" in summary["diverged_reason"]


@pytest.mark.parametrize(
    "recipe, override",
    [
        ("digits_ondevice_kd.yaml", ["--training.optimizer.init_args.lr", "1e6"]),
        ("quickstart.yaml", ["--training.optimizer.init_args.lr", "1e3"]),
        ("digits_ondevice_kd.yaml", ["--strategy.init_args.kd_weight", "1e8"]),  # finite, but past LOSS_LIMIT
        ("digits_fedadam.yaml", ["--strategy.init_args.server_lr", "1e6"]),
    ],
)
def test_each_kind_of_blow_up_ends_with_exit_2(tmp_path, capsys, recipe, override):
    """Client weights, a loss past the limit and a server step that blow up each stop the run with exit 2."""
    out = tmp_path / "run"
    args = ["--rounds", "2", "--output_dir", str(out), "--runtime.progress", "false"]
    assert run_cli("fit", "--config", str(ROOT / "recipes" / recipe), *override, *args) == 2
    assert "diverged" in capsys.readouterr().err
    assert read_summary(out)["diverged"] is True


def test_a_later_divergence_keeps_the_last_good_checkpoint_and_summary(tmp_path, capsys):
    """A client that sends NaN only from round 2 on: round 1 is checkpointed and summarized, exit 2."""
    from fl_lightning.federation.sampling import UniformSampler
    from fl_lightning.federation.seeding import Owner, Stream, derive_seed

    clients = [ClientSpec(i, "all", ("global",)) for i in range(8)]

    def sampled(rnd):
        rng = np.random.default_rng(derive_seed(0, rnd, Owner.SERVER, Stream.SAMPLER))
        return {c.id for c in UniformSampler(fraction=0.5).sample(rnd, clients, rng)}

    late = min(sampled(2) - sampled(1))  # trains in round 2, not in round 1
    out = tmp_path / "run"
    recipe = write_recipe(tmp_path / "r.yaml", eval_every=1, faults={"nan": 1.0, "clients": [late]})
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(out)) == 2
    err = capsys.readouterr().err
    assert f"round 2 diverged: client {late} sent non-finite uplink global (an injected nan fault)" in err
    summary = read_summary(out)
    assert summary["diverged"] and summary["diverged_round"] == 2 and summary["rounds"] == 1
    assert summary["final_round"] == 1 and math.isfinite(summary["final"]["global/test_acc"])
    assert (out / "checkpoints" / "last.ckpt").exists()
    assert [r["round"] for r in metrics_rows(out)] == ["1"]


def test_drop_policy_skips_every_nonfinite_update_and_keeps_the_server_state(tmp_path):
    out = tmp_path / "run"
    optimizer = {"class_path": "torch.optim.SGD", "init_args": {"lr": 1e6}}
    recipe = write_recipe(
        tmp_path / "r.yaml", eval_every=1, divergence="drop", training={"optimizer": optimizer, "local_steps": 5}
    )
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(out)) == 0
    rows = metrics_rows(out)
    # 4 of 8 clients per round, every one diverges: aggregate never runs and the server keeps its weights
    assert [r["faults/dropped_nonfinite"] for r in rows] == ["4"] * 4
    assert [r["faults/phases_without_updates"] for r in rows] == ["1"] * 4
    assert len({r["global/test_acc"] for r in rows}) == 1  # the initial model, evaluated 4 times
    summary = read_summary(out)
    assert summary["diverged"] is False and summary["complete"]
    assert summary["faults"] == {"dropped_nonfinite": 16, "phases_without_updates": 4}
    assert summary["comm"]["uplink_bytes"] == 0 and summary["comm"]["downlink_bytes"] > 0


def test_nonfinite_parts_names_each_bad_payload_and_metric():
    client = ClientSpec(0, "all", ("global",))
    good = ClientUpdate(client, 3, {"global": ModelWeights("global", {"w": torch.ones(2)})}, {"global/loss": 0.5})
    assert nonfinite_parts(good) == []
    bad = ClientUpdate(
        client,
        3,
        {
            "global": ModelWeights("global", {"w": torch.ones(2), "n": torch.tensor([1], dtype=torch.long)}),
            "logits": TensorPayload("logits", {"x": torch.tensor([1.0, float("inf")])}),
        },
        {"global/loss": float("nan")},
    )
    assert nonfinite_parts(bad) == ["uplink logits", "metric global/loss"]


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_all_finite_finds_one_bad_element_among_many(bad, dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(s, generator=g).to(dtype) for s in [(7, 3, 3), (33,), (1,), ()]]
    mixed = [*tensors, torch.empty(0), torch.randn(4, dtype=torch.float64, generator=g)]
    assert all_finite(mixed) and all_finite([])
    for k, t in enumerate(tensors):
        for position in (0, t.numel() // 2, t.numel() - 1):
            spoiled = [x.clone() for x in mixed]
            spoiled[k].view(-1)[position] = bad
            assert not all_finite(spoiled), (k, position)
    huge = torch.full((3,), torch.finfo(dtype).max, dtype=dtype)  # finite at the type's limit: no overflow
    assert all_finite([huge, -huge])
    sparse = torch.tensor([[0.0, bad], [1.0, 0.0]], dtype=dtype)
    assert not all_finite([sparse.to_sparse()]) and not all_finite([sparse.to_sparse_csr()])
    assert all_finite([torch.eye(2, dtype=dtype).to_sparse(), torch.eye(2, dtype=dtype).to_sparse_csr()])


@pytest.mark.parametrize("fused", [False, True])  # the CPU's sums, and the GPU's one _foreach_norm call
def test_the_cheap_total_is_finite_exactly_when_every_element_is_or_the_total_overflowed(fused):
    from fl_lightning.run.robustness import _total

    g = torch.Generator().manual_seed(0)
    group = [torch.randn(s, generator=g) for s in [(70, 3), (5,), ()]]
    assert torch.isfinite(_total(group, fused))
    for bad in (float("nan"), float("inf"), -float("inf")):
        spoiled = [t.clone() for t in group]
        spoiled[0][69, 2] = bad
        assert not torch.isfinite(_total(spoiled, fused)), bad
    huge = [torch.full((4,), torch.finfo(torch.float32).max)]  # finite, but its total overflows: all_finite then
    assert not torch.isfinite(_total(huge, fused)) and all_finite(huge)  # asks the exact test, which clears it
    halves = [torch.full((8,), 60000.0, dtype=torch.float16)]  # a sum of 480,000: past float16, not past float32
    assert torch.isfinite(_total(halves, fused))


def test_a_finite_update_is_cleared_by_its_total_without_the_exact_test(monkeypatch):
    """The infinity norm (5 ms at 1.6 M float32 weights on a CPU, against 0.2 ms for the sums) runs only when the
    total is not finite: never for a finite update, once for an update with one NaN."""
    calls, norm = [], torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda tensors, ord=2: calls.append(ord) or norm(tensors, ord))
    weights = [torch.randn(1000, 100), torch.randn(100), torch.randn(10, 100, dtype=torch.float64)]
    assert all_finite(weights) and float("inf") not in calls
    weights[1][7] = float("nan")
    assert not all_finite(weights) and calls.count(float("inf")) == 1


def test_all_finite_takes_integer_complex_and_float8_tensors():
    assert all_finite([torch.arange(5), torch.tensor([True, False]), torch.tensor([3e38 + 3e38j])])
    assert not all_finite([torch.tensor([1 + 2j, complex(1.0, float("nan"))])])
    assert all_finite([torch.tensor([1 + 1j]).conj()]) and not all_finite(
        [torch.tensor([complex(1, float("inf"))]).conj()]
    )
    assert not all_finite([torch.tensor([1.0, float("inf")]).to(torch.float8_e5m2)])
    assert all_finite([torch.tensor([1.0, -2.0]).to(torch.float8_e4m3fn)])


def test_nonfinite_metrics_ignores_an_evaluation_that_covered_no_client():
    nan = float("nan")
    row = {"personal/test_acc": nan, "personal/clients_evaluated": 0.0, "global/test_loss": math.inf, "round": 3}
    assert nonfinite_metrics(row) == ["global/test_loss"]
    assert nonfinite_metrics({"personal/test_acc": nan, "personal/clients_evaluated": 2.0}) == ["personal/test_acc"]


def test_a_finite_loss_past_the_limit_counts_as_exploded():
    client = ClientSpec(0, "all", ("m",))
    update = ClientUpdate(client, 1, {}, {"target/kd_loss": 3.95e19, "target/loss": 2.3})
    assert nonfinite_parts(update) == ["metric target/kd_loss = 3.95e+19 (exploded)"]
