"""Model payloads carry what a deployment sends: trainable parameters and the buffers of trainable parts."""

import pytest
import torch
from conftest import fit_recipe, read_summary, write_recipe
from torch import nn

from fl_lightning.federation.types import (
    ClientSpec,
    ClientTask,
    ClientUpdate,
    ModelWeights,
    TensorPayload,
    exchanged_keys,
    load_exchanged,
)
from fl_lightning.models import FeatureClassifier
from fl_lightning.models.registry import register_model
from fl_lightning.run.checkpoint import load_checkpoint

FROZEN_IN, FROZEN_OUT, HIDDEN, CLASSES = 64, 32, 16, 10


@register_model("test_frozen_first_mlp")
def frozen_first_mlp(num_classes: int = CLASSES, in_channels: int = 1) -> FeatureClassifier:
    """A frozen first layer (as a pretrained backbone), then a trainable layer with batch norm and a head."""
    first = nn.Linear(FROZEN_IN, FROZEN_OUT).requires_grad_(False)
    features = nn.Sequential(
        nn.Flatten(), first, nn.ReLU(), nn.Linear(FROZEN_OUT, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU()
    )
    return FeatureClassifier(features, nn.Linear(HIDDEN, num_classes), HIDDEN, num_classes)


# fp32 bytes of what trains: Linear(32, 16), the batch norm's weight, bias, running mean and var, the head;
# plus the batch norm's int64 step counter. The frozen Linear(64, 32) is 4 * (64 * 32 + 32) = 8,320 bytes.
TRAINABLE_BYTES = 4 * (FROZEN_OUT * HIDDEN + HIDDEN + 4 * HIDDEN + HIDDEN * CLASSES + CLASSES) + 8
FROZEN_BYTES = 4 * (FROZEN_IN * FROZEN_OUT + FROZEN_OUT)


def test_exchanged_keys_leave_out_frozen_parts_and_keep_the_buffers_of_trainable_ones():
    model = nn.Sequential(
        nn.Linear(4, 3),
        nn.BatchNorm1d(3),
        nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3, affine=False)),  # the block's statistics have no params
        nn.Linear(3, 2),
    )
    model[0].requires_grad_(False)
    stats = ["running_mean", "running_var", "num_batches_tracked"]
    assert exchanged_keys(model) == (
        ["1.weight", "1.bias"] + [f"1.{s}" for s in stats] + ["2.0.weight", "2.0.bias"] + [f"2.1.{s}" for s in stats]
    ) + ["3.weight", "3.bias"]
    model[2].requires_grad_(False)  # a frozen block: its parameters and its batch norm's statistics stay home
    assert exchanged_keys(model) == ["1.weight", "1.bias"] + [f"1.{s}" for s in stats] + ["3.weight", "3.bias"]
    nothing_frozen = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    assert exchanged_keys(nothing_frozen) == list(nothing_frozen.state_dict())


def test_load_exchanged_keeps_the_frozen_part_and_refuses_foreign_keys():
    model = frozen_first_mlp()
    frozen = model.features[1].weight.clone()
    sent = {k: torch.zeros_like(v) for k, v in model.state_dict().items() if k in exchanged_keys(model)}
    load_exchanged(model, sent)
    assert torch.equal(model.features[1].weight, frozen) and not model.head.weight.any()
    with pytest.raises(KeyError, match="the model does not"):
        load_exchanged(model, {"nonsense.weight": torch.zeros(1)})


def _fit(tmp_path, name, **changes):
    out = fit_recipe(tmp_path / name, write_recipe(tmp_path / f"{name}.yaml", **changes))
    summary = read_summary(out)
    return summary, load_checkpoint(out / "checkpoints" / "last.ckpt")["strategy"].get("global_weights")


def _send_everything(monkeypatch):
    """Strategies cut what they send with base.SentWeights: made to send every key, frozen ones included."""
    monkeypatch.setattr("fl_lightning.strategies.base.exchanged_keys", lambda model: list(model.state_dict()))


def test_fedavg_ledger_counts_trainable_bytes_only_and_training_is_unchanged(tmp_path, monkeypatch):
    # TINY: 8 clients, half sampled (4) each round, 4 rounds; every sampled client gets and sends the model
    recipe = {"models": {"global": {"builder": "test_frozen_first_mlp"}}}
    summary, weights = _fit(tmp_path, "trainable", **recipe)
    transfers = 4 * 4
    assert summary["comm"]["downlink_bytes"] == summary["comm"]["uplink_bytes"] == transfers * TRAINABLE_BYTES
    _send_everything(monkeypatch)
    full_summary, full_weights = _fit(tmp_path, "everything", **recipe)
    assert full_summary["comm"]["uplink_bytes"] == transfers * (TRAINABLE_BYTES + FROZEN_BYTES)
    assert full_summary["final"] == summary["final"]
    assert weights["global"].keys() == full_weights["global"].keys()
    assert all(torch.equal(weights["global"][k], full_weights["global"][k]) for k in weights["global"])


def test_ondevice_kd_ledger_counts_trainable_bytes_only_and_training_is_unchanged(tmp_path, monkeypatch):
    recipe = {
        "data": {"class_path": "fl_lightning.data.DigitsData", "init_args": {"unlabeled_fraction": 0.5}},
        "models": {"aux": {"builder": "test_frozen_first_mlp"}, "target": {"builder": "test_frozen_first_mlp"}},
        "population": {
            "num_clients": 8,
            "tiers": [{"name": "strong", "roles": ["aux", "target"], "count": 2}, {"name": "weak", "roles": ["aux"]}],
        },
        "strategy": {"class_path": "fl_lightning.strategies.OnDeviceKD", "init_args": {"kd_weight": 1.0}},
        "rounds": 2,
        "eval_every": 2,
    }
    summary, weights = _fit(tmp_path, "trainable", **recipe)
    # per round: 4 sampled clients get and return the auxiliary model; both strong clients then get the
    # auxiliary and the target models and return the target
    per_round_down, per_round_up = (4 + 2 * 2) * TRAINABLE_BYTES, (4 + 2) * TRAINABLE_BYTES
    assert summary["comm"]["downlink_bytes"] == 2 * per_round_down
    assert summary["comm"]["uplink_bytes"] == 2 * per_round_up
    _send_everything(monkeypatch)
    full_summary, full_weights = _fit(tmp_path, "everything", **recipe)
    assert full_summary["comm"]["uplink_bytes"] == 2 * (4 + 2) * (TRAINABLE_BYTES + FROZEN_BYTES)
    assert full_summary["final"] == summary["final"]
    for role in ("aux", "target"):
        assert all(torch.equal(weights[role][k], full_weights[role][k]) for k in full_weights[role])


# MOON's projection head on the frozen-first MLP: Linear(16, 16), Linear(16, 8), and a Linear(8, 10) head in
# place of Linear(16, 10); all of it trains
PROJECTION = 8
MOON_TRAINABLE_BYTES = (
    TRAINABLE_BYTES
    + 4 * (HIDDEN * HIDDEN + HIDDEN + HIDDEN * PROJECTION + PROJECTION + PROJECTION * CLASSES + CLASSES)
    - 4 * (HIDDEN * CLASSES + CLASSES)
)
LOCAL_SPLIT = {"class_path": "fl_lightning.data.DigitsData", "init_args": {"local_split": [0.8, 0.1, 0.1]}}
FROZEN_MLP = {"builder": "test_frozen_first_mlp"}


def _pair(*roles):
    return {"num_clients": 8, "tiers": [{"name": "all", "roles": list(roles)}]}


# strategy, recipe changes, payload name, bytes of one downlink and of one upload of that payload
OTHER_WEIGHT_SENDERS = {
    "Felo": ({}, "weights", TRAINABLE_BYTES, TRAINABLE_BYTES),
    "Velo": ({}, "weights", TRAINABLE_BYTES, TRAINABLE_BYTES),
    "FedDF": (
        {"data": {"class_path": "fl_lightning.data.DigitsData", "init_args": {"server_fraction": 0.2}}},
        "global",
        TRAINABLE_BYTES,
        TRAINABLE_BYTES,
    ),
    "MOON": (
        {"models": {"global": {**FROZEN_MLP, "projection_dim": PROJECTION}}},
        "global",
        MOON_TRAINABLE_BYTES,
        MOON_TRAINABLE_BYTES,
    ),
    "FML": (
        {
            "data": LOCAL_SPLIT,
            "models": {"private": FROZEN_MLP, "meme": FROZEN_MLP},
            "population": _pair("private", "meme"),
        },
        "meme",
        TRAINABLE_BYTES,
        TRAINABLE_BYTES,
    ),
    # the upload is the mentee's update of its floating-point tensors: no int64 batch-norm step counter
    "FedKD": (
        {
            "data": LOCAL_SPLIT,
            "models": {"mentor": FROZEN_MLP, "mentee": FROZEN_MLP},
            "population": _pair("mentor", "mentee"),
        },
        ("mentee", "mentee_update"),
        TRAINABLE_BYTES,
        TRAINABLE_BYTES - 8,
    ),
}


@pytest.mark.parametrize("name", list(OTHER_WEIGHT_SENDERS))
def test_every_weight_sending_strategy_counts_trainable_bytes_only(tmp_path, name):
    changes, payload, down, up = OTHER_WEIGHT_SENDERS[name]
    recipe = {
        "models": {"global": FROZEN_MLP},
        "strategy": {"class_path": f"fl_lightning.strategies.{name}"},
        "rounds": 2,
        "eval_every": 2,
        **changes,
    }
    summary, _ = _fit(tmp_path, name, **recipe)
    down_name, up_name = payload if isinstance(payload, tuple) else (payload, payload)
    by_payload = summary["comm"]["by_payload"]
    transfers = 2 * 4  # 2 rounds, 4 of the 8 clients sampled in each
    assert by_payload["downlink"][down_name] == transfers * down
    assert by_payload["uplink"][up_name] == transfers * up


def test_a_payload_is_read_as_the_kind_the_strategy_expects():
    client = ClientSpec(0, "weak", ("global",))
    weights = ModelWeights("global", {"w": torch.ones(2)})
    task = ClientTask(client, 1, {"global": weights})
    assert task.received("global", ModelWeights) is weights
    update = ClientUpdate(client, 5, {"logits": TensorPayload("logits", {"z": torch.zeros(3)})})
    assert update.sent("logits", TensorPayload).tensors["z"].shape == (3,)
    # a strategy that reads another kind than it sent fails at the read, naming the payload and both kinds
    with pytest.raises(TypeError, match="payload 'logits' is a TensorPayload, expected a ModelWeights"):
        update.sent("logits", ModelWeights)
    with pytest.raises(KeyError):
        task.received("aux", ModelWeights)
