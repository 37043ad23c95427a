"""HeteroFL: width slicing, scattering and the overlapping average on hand-made tensors; the scaler, static
batch norm, masking, label-split aggregation and the bytes a sub-model sends."""

import pytest
import torch
from conftest import client_update, method_env, read_summary, run_cli, write_recipe
from torch import nn

from fl_lightning.data import DigitsData, DirichletPartitioner
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate, ModelWeights, TensorPayload
from fl_lightning.models import ModelSpec, digits_cnn, digits_mlp
from fl_lightning.models.slicing import batch_norm_statistics, not_a_slice, scatter_state, slice_state, sliced_width
from fl_lightning.strategies import HeteroFL
from fl_lightning.strategies.heterofl import SliceAverage

HALVES = {  # the global CNN with batch norm and its rate-1/2 slice, one tier each
    "a": ModelSpec("digits_cnn", {"rate": 1.0, "batch_norm": True}),
    "b": ModelSpec("digits_cnn", {"rate": 0.5, "batch_norm": True}),
}
FIXED_TIERS = [Tier("a", ["a"], count=2), Tier("b", ["b"])]


def test_slice_and_scatter_take_the_leading_block_of_every_dimension():
    state = {"w": torch.arange(24.0).view(4, 6), "b": torch.arange(4.0)}
    sub = slice_state(state, {"w": torch.Size([2, 3]), "b": torch.Size([2])})
    assert sub["w"].tolist() == [[0, 1, 2], [6, 7, 8]] and sub["b"].tolist() == [0, 1]
    back = scatter_state(state, {"w": -torch.ones(2, 3), "b": torch.tensor([-5.0, -6.0])})
    assert (
        back["w"][:2, :3].eq(-1).all()
        and back["w"][2:].eq(state["w"][2:]).all()
        and back["w"][:, 3:].eq(state["w"][:, 3:]).all()
    )
    assert back["b"].tolist() == [-5, -6, 2, 3] and state["b"].tolist() == [0, 1, 2, 3]  # the original is untouched


def test_overlapping_average_counts_only_the_clients_holding_an_entry():
    previous = {"w": torch.full((2, 2), 9.0), "head": torch.full((3, 2), 9.0)}
    average = SliceAverage(previous, row_keys={"head"})
    average.add({"w": torch.tensor([[2.0, 4.0], [6.0, 8.0]]), "head": torch.full((3, 2), 4.0)},
                classes=torch.tensor([True, True, False]))  # fmt: skip
    average.add(
        {"w": torch.tensor([[4.0]]), "head": torch.full((3, 1), 1.0)}, classes=torch.tensor([True, False, True])
    )
    result = average.result(previous)
    assert result["w"].tolist() == [[3.0, 4.0], [6.0, 8.0]]  # (2 + 4) / 2 where both hold it, else the one
    # head rows: class 0 held by both -> (4 + 1) / 2 in column 0, 4 in column 1; class 1 only by the first;
    # class 2 only by the second, in column 0; its column 1 is held by nobody and keeps 9
    assert result["head"].tolist() == [[2.5, 4.0], [4.0, 4.0], [1.0, 9.0]]
    without_split = SliceAverage(previous, row_keys={"head"})
    without_split.add({"head": torch.full((3, 2), 4.0)}, classes=None)
    without_split.add({"head": torch.full((3, 1), 1.0)}, classes=None)
    assert without_split.result(previous)["head"][:, 0].tolist() == [2.5, 2.5, 2.5]


def test_rate_r_builders_build_exactly_the_slices():
    # ceil(r * n): width 1 has conv channels 16, 32 and 64 dense units; rate 1/16 keeps 1, 2 and 4
    small = digits_cnn(rate=0.0625)
    assert [tuple(p.shape) for p in small.parameters()] == [
        (1, 1, 3, 3),
        (1,),
        (2, 1, 3, 3),
        (2,),
        (4, 32),
        (4,),
        (10, 4),
        (10,),
    ]
    assert sliced_width(4, 0.125) == 1 and sliced_width(30, 0.1) == 3 and sliced_width(7, 0.5) == 4
    full = digits_mlp(hidden=10, rate=1.0).state_dict()
    half = digits_mlp(hidden=10, rate=0.5).state_dict()
    assert {k: tuple(v.shape) for k, v in slice_state(full, {k: v.shape for k, v in half.items()}).items()} == {
        "features.1.weight": (5, 64), "features.1.bias": (5,), "head.weight": (10, 5), "head.bias": (10,)
    }  # fmt: skip
    with pytest.raises(ConfigError, match=r"model rate must be in \(0, 1\]"):
        digits_cnn(rate=1.5)


def test_scaler_divides_by_the_rate_in_training_only():
    model = digits_mlp(in_features=2, hidden=2, rate=0.5)  # one hidden unit
    with torch.no_grad():
        model.features[1].weight.copy_(torch.tensor([[1.0, 1.0]]))
        model.features[1].bias.zero_()
        model.head.weight.fill_(1.0)
        model.head.bias.zero_()
    x = torch.tensor([[1.0, 2.0]])  # hidden pre-activation 3
    assert model.train()(x)[0, 0].item() == 6.0 and model.eval()(x)[0, 0].item() == 3.0  # 3 / 0.5, then 3
    assert digits_mlp(in_features=2, hidden=2).train()._forward_hooks == {}  # rate 1 adds nothing


def test_batch_norm_statistics_are_the_mean_over_batches():
    model = nn.Sequential(nn.BatchNorm1d(1))
    params = {"0.weight": torch.ones(1), "0.bias": torch.zeros(1)}
    state = batch_norm_statistics(model, params, [torch.tensor([[1.0], [3.0]]), torch.tensor([[5.0], [7.0]])])
    # batch means 2 and 6, unbiased batch variances 2 and 2: the plain means over the two batches
    assert state["0.running_mean"].item() == 4.0 and state["0.running_var"].item() == 2.0
    assert model.training and model[0].momentum == 0.1  # restored


def test_a_half_width_client_sends_its_slice_without_batch_norm_statistics():
    strategy = HeteroFL(mode="fixed")
    server = method_env(strategy, HALVES, FIXED_TIERS)
    client = server.clients[2]
    assert client.roles == ("b",)
    task = strategy.configure_round(1, [client])[0]
    # rate 1/2: conv 8*9+8 = 80, norm 16, conv 16*8*9+16 = 1168, norm 32, dense 32*256+32 = 8224,
    # head 10*32+10 = 330: 9850 numbers, against 38,378 at rate 1 (0.257, about r^2)
    assert task.downlink["b"].nbytes == 9850 * 4
    assert sum(v.numel() for v in strategy.state.global_weights.values()) == 38378
    update = client_update(strategy, server, task)
    assert update.uplink["b"].nbytes == 9850 * 4 and update.uplink["label_split"].nbytes == 10
    assert not any("running" in k or "num_batches" in k for k in update.uplink["b"].state)


def test_masked_classes_leave_their_output_rows_alone():
    data = DigitsData(partitioner=DirichletPartitioner(alpha=0.1, min_partition_size=10))
    models = {"a": ModelSpec("digits_mlp", {"hidden": 16})}
    rows = {}
    for mask in (True, False):
        strategy = HeteroFL(mode="fixed", mask=mask)
        server = method_env(strategy, models, [Tier("all", ["a"])], data=data)
        client = next(
            c
            for c in server.clients
            if bool((torch.bincount(data.y[data.clients[c.id].train], minlength=10) == 0).any())
        )
        update = client_update(strategy, server, strategy.configure_round(1, [client])[0])
        absent = ~update.uplink["label_split"].tensors["classes"]
        assert torch.equal(absent, torch.bincount(data.y[data.clients[client.id].train], minlength=10) == 0)
        rows[mask] = (
            update.uplink["a"].state["head.weight"][absent],
            strategy.state.global_weights["head.weight"][absent],
        )
    assert torch.equal(*rows[True])  # a constant 0 logit gets no gradient
    assert not torch.equal(*rows[False])


def test_aggregate_averages_each_entry_over_its_holders_and_rows_over_their_classes():
    strategy = HeteroFL(mode="fixed")
    server = method_env(strategy, HALVES, FIXED_TIERS)
    before = {k: v.clone() for k, v in strategy.state.global_weights.items()}
    full = {k: torch.full_like(v, 4.0) for k, v in before.items()}
    half = {k: torch.full(s, 2.0) for k, s in strategy.shapes["b"].items()}
    has = torch.zeros(10, dtype=torch.bool)
    has[:3] = True  # the half-width client has classes 0-2 only

    def upload(client, role, state, classes):
        return ClientUpdate(
            client,
            1,
            {role: ModelWeights(role, state), "label_split": TensorPayload("label_split", {"classes": classes})},
        )

    strategy.aggregate(
        1,
        iter(
            [
                upload(server.clients[0], "a", full, torch.ones(10, dtype=torch.bool)),
                upload(server.clients[2], "b", half, has),
            ]
        ),
    )
    new = strategy.state.global_weights
    assert new["features.0.weight"][:8].eq(3.0).all() and new["features.0.weight"][8:].eq(4.0).all()
    assert new["features.3.weight"][:16, :8].eq(3.0).all() and new["features.3.weight"][:16, 8:].eq(4.0).all()
    assert new["head.weight"][:3, :32].eq(3.0).all() and new["head.weight"][3:].eq(4.0).all()
    assert new["head.bias"].tolist() == [3.0] * 3 + [4.0] * 7
    strategy.aggregate(2, iter([upload(server.clients[2], "b", half, has)]))  # entries nobody holds keep theirs
    assert strategy.state.global_weights["features.0.weight"][8:].eq(4.0).all()


def test_missing_needs_are_refused_in_one_sentence():
    with pytest.raises(ConfigError, match="HeteroFL needs width-sliceable models"):
        method_env(HeteroFL(mode="fixed"), {"m": ModelSpec("conftest.constant_logits_model")}, [Tier("all", ["m"])])
    with pytest.raises(ConfigError, match="exactly one role at rate 1"):
        method_env(HeteroFL(mode="fixed"), {"b": HALVES["b"]}, [Tier("all", ["b"])])
    mixed = {"a": HALVES["a"], "b": ModelSpec("digits_mlp", {"rate": 0.5})}
    with pytest.raises(ConfigError, match="is not a slice of the global role"):
        method_env(HeteroFL(mode="fixed"), mixed, FIXED_TIERS)
    with pytest.raises(ConfigError, match="every tier must list every rate role"):
        method_env(HeteroFL(mode="dynamic"), HALVES, FIXED_TIERS)


def test_dynamic_rates_are_drawn_per_round_from_the_shares():
    strategy = HeteroFL(mode="dynamic", proportions={"a": 1.0, "b": 3.0})
    server = method_env(strategy, HALVES, [Tier("all", ["a", "b"])], num_clients=8)
    draws = [strategy.round_roles(rnd) for rnd in range(1, 51)]
    assert draws[0] == strategy.round_roles(1) and len(set(map(tuple, draws))) > 1
    share_b = sum(r == "b" for roles in draws for r in roles) / 400
    assert 0.65 < share_b < 0.85  # 3 / 4 expected
    tasks = strategy.configure_round(1, server.clients)
    assert [next(iter(t.downlink)) for t in tasks] == draws[0]


def test_all_clients_at_full_width_without_split_or_mask_is_unweighted_fedavg(tmp_path):
    common = {"population": {"num_clients": 8, "tiers": [{"name": "all", "roles": ["global"]}]}}
    heterofl = {
        "class_path": "fl_lightning.strategies.HeteroFL",
        "init_args": {"mode": "fixed", "label_split": False, "mask": False},
    }
    fedavg = {"class_path": "fl_lightning.strategies.FedAvg", "init_args": {"weighted": False}}
    for name, strategy in (("heterofl", heterofl), ("fedavg", fedavg)):
        recipe = write_recipe(tmp_path / f"{name}.yaml", strategy=strategy, **common)
        assert run_cli("fit", "--config", str(recipe), "--output_dir", str(tmp_path / name)) == 0
    assert read_summary(tmp_path / "heterofl")["final"] == read_summary(tmp_path / "fedavg")["final"]


def _basic_resnet_count(layers, widths, classes=10, in_channels=3):
    """Parameters of a CIFAR ResNet of basic blocks by hand: stem conv + norm, each block's two 3x3 convs and
    two norms (2 numbers a channel), a 1x1 conv + norm on the first block's shortcut when its shape changes,
    the dense head."""
    total, previous = 9 * in_channels * widths[0] + 2 * widths[0], widths[0]
    for stage, (blocks, out) in enumerate(zip(layers, widths)):
        for block in range(blocks):
            total += 9 * previous * out + 9 * out * out + 4 * out
            if block == 0 and (stage > 0 or previous != out):
                total += previous * out + 2 * out
            previous = out
    return total + previous * classes + classes


def _bottleneck_resnet_count(layers, widths, classes=10, in_channels=3):
    """The same for bottleneck blocks (1x1, 3x3, 1x1 convs; 4 x planes out; ResNet50)."""
    total, previous = 9 * in_channels * widths[0] + 2 * widths[0], widths[0]
    for blocks, planes in zip(layers, widths):
        for block in range(blocks):
            total += previous * planes + 9 * planes * planes + planes * 4 * planes + 2 * (planes + planes + 4 * planes)
            if block == 0:  # every stage's first block changes the shape (64 -> 256 channels in stage 1)
                total += previous * 4 * planes + 2 * 4 * planes
            previous = 4 * planes
    return total + previous * classes + classes


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.25, 0.125, 0.0625])
def test_sliced_cifar_resnets_have_the_parameters_of_their_width_formula(rate):
    from fl_lightning.models import registered_models

    models = registered_models()
    widths = [sliced_width(w, rate) for w in (64, 128, 256, 512)]  # 4, 8, 16, 32 channels at rate 1/16
    for depth, layers in ((10, [1, 1, 1, 1]), (26, [3, 3, 3, 3]), (34, [3, 4, 6, 3])):
        model = models[f"cifar_resnet{depth}"](rate=rate)
        assert sum(p.numel() for p in model.parameters()) == _basic_resnet_count(layers, widths), depth
    resnet50 = models["cifar_resnet50"](rate=rate)
    assert sum(p.numel() for p in resnet50.parameters()) == _bottleneck_resnet_count([3, 4, 6, 3], widths)
    assert sum(p.numel() for p in models["cifar_resnet26"](rate=1.0).parameters()) == 17_444_682  # unchanged
    # resnet20: a projection on every stage's first block; widths ceil(r * 16, 32, 64), the stem cut too
    small = [sliced_width(w, rate) for w in (16, 32, 64)]
    count = 27 * small[0] + 2 * small[0]
    previous = small[0]
    for out in small:
        count += (
            9 * previous * out + 9 * out * out + 4 * out + previous * out + 2 * out + 2 * (18 * out * out + 4 * out)
        )
        previous = out
    assert sum(p.numel() for p in models["resnet20"](rate=rate).parameters()) == count + 10 * previous + 10


@pytest.mark.parametrize("builder", ["cifar_resnet26", "cifar_resnet50", "resnet20"])
def test_a_sliced_resnet_is_the_global_resnet_with_the_other_channels_at_zero(builder):
    from fl_lightning.models import registered_models

    torch.manual_seed(0)
    build = registered_models()[builder]
    full, sub = build(rate=1.0), build(rate=0.25)
    with torch.no_grad():  # non-trivial batch-norm statistics and affine parameters to carry over
        for norm in [m for m in full.modules() if isinstance(m, nn.BatchNorm2d)]:
            norm.running_mean.uniform_(-0.5, 0.5)
            norm.running_var.uniform_(0.5, 2.0)
            norm.weight.uniform_(0.5, 1.5)
            norm.bias.uniform_(-0.2, 0.2)
    state = full.state_dict()
    shapes = {k: v.shape for k, v in sub.state_dict().items()}
    assert not_a_slice({k: v.shape for k, v in state.items()}, shapes) is None
    sliced = slice_state(state, shapes)
    sub.load_state_dict(sliced)
    # round trip: writing the slice back over the global state changes nothing
    assert all(torch.equal(v, state[k]) for k, v in scatter_state(state, sliced).items())
    # the global network whose entries outside the slice are zero computes what the slice computes (eval mode,
    # where the scaler is off): the slice holds the first channels of every layer and nothing else
    empty = {k: torch.ones_like(v) if k.endswith("running_var") else torch.zeros_like(v) for k, v in state.items()}
    full.load_state_dict(scatter_state(empty, sliced))
    x = torch.randn(2, 3, 32, 32)
    assert torch.allclose(full.eval()(x), sub.eval()(x), atol=1e-5)
    scaled = [m for m in sub.modules() if isinstance(m, nn.Conv2d) and m._forward_hooks]
    assert len(scaled) == sum(isinstance(m, nn.Conv2d) for m in sub.modules())  # every conv has the scaler
    assert not any(m._forward_hooks for m in full.modules())  # rate 1 adds none
