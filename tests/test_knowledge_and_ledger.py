"""Weighted averages of weights (by hand, in float64, by blocks of one flat buffer, refused on mismatched
architectures), payload sizes in bytes, and the ledger's counts per round, direction and payload."""

import pytest
import torch
from torch import nn

from fl_lightning.federation.ledger import CommunicationLedger
from fl_lightning.federation.types import ModelWeights, TensorPayload, tensor_bytes
from fl_lightning.knowledge import WeightedAverage, weighted_average


def test_weighted_average_matches_hand_computation():
    a = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(10)}
    b = {"w": torch.tensor([4.0, 8.0]), "n": torch.tensor(20)}
    out = weighted_average([a, b], [1.0, 2.0])
    # (1*1 + 2*4)/3 = 3, (1*2 + 2*8)/3 = 6; integer buffer (10 + 40)/3 = 16.67 -> 17
    assert torch.allclose(out["w"], torch.tensor([3.0, 6.0]))
    assert out["n"].dtype == torch.int64 and out["n"].item() == 17


def test_weighted_average_of_mixed_tensors_equals_the_float64_sum_tensor_by_tensor():
    """Tensors of several dtypes and shapes (summed in one flat buffer per dtype) give, bit for bit, the
    per-tensor float64 sums, in the state dict's key order and shapes; complex tensors keep their imaginary part."""
    g = torch.Generator().manual_seed(0)

    def state():
        return {
            "w": torch.randn(4, 3, generator=g),
            "count": torch.randint(0, 1000, (), generator=g),
            "half": torch.randn(5, generator=g).bfloat16(),
            "scalar": torch.randn((), generator=g),
            "b": torch.randn(3, generator=g),
            "double": torch.randn(6, generator=g, dtype=torch.float64),  # compared at float64 precision
        }

    states, weights = [state() for _ in range(3)], [3.0, 0.7, 11.0]
    out = weighted_average(states, weights)
    assert list(out) == ["w", "count", "half", "scalar", "b", "double"]
    for key, first in states[0].items():
        total = first.to(torch.float64) * weights[0]
        for s, w in zip(states[1:], weights[1:]):
            total.add_(s[key].to(torch.float64), alpha=w)  # as add_ computes it (fused multiply-add on CPUs)
        mean = total / sum(weights)
        expected = (mean if first.dtype.is_floating_point else mean.round()).to(first.dtype)
        assert out[key].dtype == first.dtype and out[key].shape == first.shape
        assert torch.equal(out[key], expected), key
    # a later state with another dtype for one key: summed on its own, promoted exactly as before
    mixed = [
        {"n": torch.tensor(70_000), "m": torch.tensor(1)},
        {"n": torch.tensor(70_000), "m": torch.tensor(3.0).half()},
    ]
    assert weighted_average(mixed, [1.0, 1.0]) == {"n": torch.tensor(70_000), "m": torch.tensor(2)}
    doubles = weighted_average(
        [{"a": torch.ones(2, dtype=torch.float64), "b": torch.ones(3, dtype=torch.float64)}], [1.0]
    )
    assert doubles["a"].untyped_storage().data_ptr() != doubles["b"].untyped_storage().data_ptr()
    complex_mean = weighted_average([{"z": torch.tensor([1 + 2j])}, {"z": torch.tensor([3 + 4j])}], [1.0, 1.0])
    assert torch.equal(complex_mean["z"], torch.tensor([2 + 3j]))


def test_a_flat_sum_is_cut_into_blocks_holding_pieces_of_the_tensors():
    from fl_lightning.knowledge.averaging import blocks

    # tensors of 3, 5 and 2 elements in blocks of 4: [a a a b] [b b b b] [c c]
    assert blocks([3, 5, 2], block=4) == [
        (0, 4, [(0, 0, 0, 3), (1, 0, 3, 1)]),
        (4, 4, [(1, 1, 0, 4)]),
        (8, 2, [(2, 0, 0, 2)]),
    ]
    assert blocks([4], block=4) == [(0, 4, [(0, 0, 0, 4)])] and blocks([], block=4) == []


def test_the_average_by_blocks_is_bit_for_bit_one_add_over_the_whole_flat_buffer():
    """A CPU adds each state a cache-sized block at a time; tensors that straddle blocks, a block of many small
    tensors and a last short block give, bit for bit, the sums of one float64 add over the concatenation."""
    from fl_lightning.knowledge.averaging import BLOCK

    g = torch.Generator().manual_seed(0)
    sizes = [BLOCK + 3, 5, 1, BLOCK - 9, 2 * BLOCK + 77, 10]

    def state(scale):
        return {f"t{i}": torch.randn(n, generator=g) * scale for i, n in enumerate(sizes)}

    states, weights = [state(10.0**k) for k in (-3, 0, 3, 1)], [50.0, 0.3, 7.0, 1e-3]
    flat = [torch.cat(list(s.values())) for s in states]
    total = flat[0].double() * weights[0]
    for x, w in zip(flat[1:], weights[1:]):
        total.add_(x, alpha=w)  # the average before it was cut into blocks
    average = WeightedAverage()
    for x, w in zip(states, weights):
        average.add(x, w)
    assert torch.equal(average._sum[torch.device("cpu"), torch.float32], total)  # the float64 sums themselves
    expected = (total / sum(weights)).float().split(sizes)
    assert all(torch.equal(average.result()[f"t{i}"], e) for i, e in enumerate(expected))


def test_weighted_average_rejects_mismatched_architectures_and_bad_weights():
    avg = WeightedAverage()
    avg.add({"w": torch.zeros(2)}, 1.0)
    with pytest.raises(ValueError, match="different keys"):
        avg.add({"v": torch.zeros(2)}, 1.0)
    with pytest.raises(ValueError, match=r"cannot average 'w': shape \(1, 2\) differs from the first state's \(2,\)"):
        avg.add({"w": torch.zeros(1, 2)}, 1.0)  # as many numbers, another shape: refused, not flattened
    with pytest.raises(ValueError, match="positive"):
        avg.add({"w": torch.zeros(2)}, 0.0)


def test_payload_bytes_are_numel_times_element_size():
    layer = nn.Linear(3, 2)  # 6 weights + 2 biases, float32
    assert ModelWeights("m", layer.state_dict()).nbytes == 8 * 4
    assert TensorPayload("logits", {"z": torch.zeros(10, 11, dtype=torch.float64)}).nbytes == 110 * 8
    assert tensor_bytes(torch.zeros(3, dtype=torch.int64)) == 24


def test_ledger_counts_per_round_direction_and_payload():
    ledger = CommunicationLedger()
    w = ModelWeights("m", {"w": torch.zeros(5)})  # 20 bytes
    ledger.record(1, "downlink", {"m": w})
    ledger.record(1, "downlink", {"m": w})
    ledger.record(1, "uplink", {"m": w, "z": TensorPayload("logits", {"z": torch.zeros(2)})})
    ledger.record(2, "uplink", {"m": w})
    assert ledger.per_round[1] == {"downlink": 40, "uplink": 28}
    assert ledger.uplink_bytes == 48 and ledger.downlink_bytes == 40
    assert ledger.summary()["by_payload"]["uplink"] == {"m": 40, "z": 8}
    restored = CommunicationLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.summary() == ledger.summary()
