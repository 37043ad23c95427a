"""What strategies share (strategies/base.py, client/context.py): the server state as one dataclass whose fields are
the checkpoint's keys, the helpers that replace copies between strategies, the recipe's training settings as
ClientContext properties, and the strategy's name in the set-up checks."""

import copy
import dataclasses

import pytest
import torch
from conftest import ROOT, method_env, run_cli
from torch import nn

from fl_lightning.client import ClientContext, LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientSpec, ClientUpdate, ModelWeights, TensorPayload, clone_state
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.knowledge.public_set import mean_upload, received_positions, subset_downlink
from fl_lightning.models import FeatureClassifier, ModelSpec
from fl_lightning.models.registry import register_model
from fl_lightning.strategies import DSFL, MOON, FedAvg, Velo
from fl_lightning.strategies.base import SentWeights, global_metrics
from fl_lightning.strategies.fd import FDState
from fl_lightning.strategies.fedadam import FedAdamState
from fl_lightning.strategies.fedavg import FedAvgState
from fl_lightning.strategies.fedgems import FedGEMSState
from fl_lightning.strategies.fedgh import FedGHState
from fl_lightning.strategies.fedgkt import FedGKTState
from fl_lightning.strategies.fedhe import FedHeState
from fl_lightning.strategies.fedkd import FedKDState
from fl_lightning.strategies.fedl2g import FedL2GState
from fl_lightning.strategies.fedmrl import FedMRLState
from fl_lightning.strategies.fedproto import FedProtoState
from fl_lightning.strategies.felo import FeloState
from fl_lightning.strategies.fml import FMLState
from fl_lightning.strategies.heterofl import HeteroFLState
from fl_lightning.strategies.lg_fedavg import LGFedAvgState
from fl_lightning.strategies.ondevice_kd import OnDeviceKDState
from fl_lightning.strategies.velo import VeloState

MLP = {"m": ModelSpec("digits_mlp", {"hidden": 8})}
ONE_ROLE = [Tier("all", ["m"])]


@register_model("test_frozen_features_mlp")
def frozen_features_mlp(num_classes: int = 10, in_channels: int = 1) -> FeatureClassifier:
    """A frozen feature extractor (as a pretrained backbone) under a trainable head."""
    features = nn.Sequential(nn.Flatten(), nn.Linear(64, 8), nn.ReLU()).requires_grad_(False)
    return FeatureClassifier(features, nn.Linear(8, num_classes), 8, num_classes)


# the keys of the strategy entry of checkpoints written before the state became a dataclass: a renamed field
# would make those checkpoints unreadable
CHECKPOINT_KEYS = [
    (FedAvgState, ["global_weights"]),  # also MOON's and FedDF's
    (FedAdamState, ["global_weights", "server_optimizers"]),  # also PeriodicCodist's and MergedCodist's
    (OnDeviceKDState, ["global_weights"]),
    (FedHeState, ["bank", "last_reset_round"]),
    (FDState, ["round_sums", "round_counts", "last_uploads"]),
    (FedProtoState, ["bank"]),
    (LGFedAvgState, ["global_weights"]),
    (FMLState, ["meme_weights"]),
    (FedKDState, ["mentee_weights", "last_update", "last_trained"]),
    (FedGEMSState, ["server_weights", "pool_logits", "pool_known"]),
    (FedGKTState, ["server_weights", "server_logits"]),
    (HeteroFLState, ["global_weights"]),
    (FeloState, ["global_weights", "logit_bank", "feature_bank"]),
    (
        VeloState,
        ["global_weights", "logit_bank", "feature_bank", "cvae", "stored_features", "stored_labels", "synthetic"],
    ),
    (FedGHState, ["header"]),
    (FedL2GState, ["vectors"]),
    (FedMRLState, ["small_weights"]),
]


@pytest.mark.parametrize("state, keys", CHECKPOINT_KEYS, ids=[s.__name__ for s, _ in CHECKPOINT_KEYS])
def test_a_states_fields_are_the_checkpoint_keys_of_before(state, keys):
    assert [f.name for f in dataclasses.fields(state)] == keys


def _velo_after_one_round(server_classes=(0, 1)):
    strategy = Velo(cvae_interval=1, cvae_epochs=1)
    server = method_env(strategy, MLP, ONE_ROLE)
    present = torch.zeros(10, dtype=torch.bool)
    present[list(server_classes)] = True
    vectors = {"features": torch.randn(10, 8), "logits": torch.randn(10, 10)}
    knowledge = ClassStatistics.padded("class_knowledge", vectors, present)
    weights = ModelWeights("m", {k: v + 1.0 for k, v in strategy.state.global_weights["m"].items()})
    strategy.aggregate(
        1, iter([ClientUpdate(server.clients[0], 5, {"class_knowledge": knowledge, "weights": weights})])
    )
    return strategy


def test_the_state_round_trips_through_state_dict_into_what_setup_built():
    torch.manual_seed(0)
    trained = _velo_after_one_round()
    saved = copy.deepcopy(trained.state_dict())
    assert list(saved) == [f.name for f in dataclasses.fields(VeloState)]
    assert isinstance(saved["cvae"], dict) and saved["synthetic"].shape == (10, 8)  # the CVAE trained in round 1

    fresh = Velo(cvae_interval=1, cvae_epochs=1)
    method_env(fresh, MLP, ONE_ROLE)
    cvae = fresh.state.cvae
    fresh.load_state_dict(saved)
    assert fresh.state.cvae is cvae  # loaded into the module setup built, not replaced by a dict
    for name, value in trained.state.cvae.state_dict().items():
        assert torch.equal(cvae.state_dict()[name], value)
    assert torch.equal(fresh.state.logit_bank.sums, trained.state.logit_bank.sums)
    assert torch.equal(fresh.state.stored_labels, torch.tensor([0, 1]))
    for name, value in trained.state.global_weights["m"].items():
        assert torch.equal(fresh.state.global_weights["m"][name], value)


def test_a_strategy_without_server_state_saves_nothing():
    strategy = DSFL()
    assert strategy.state is None and strategy.state_dict() == {}
    strategy.load_state_dict({})  # a checkpoint of such a method restores nothing, and nothing fails


def test_clone_state_is_a_detached_copy():
    model = torch.nn.Linear(2, 1)
    copied = clone_state(model.state_dict())
    with torch.no_grad():
        model.weight.add_(1.0)
    assert not torch.equal(copied["weight"], model.weight) and not copied["weight"].requires_grad


def test_global_metrics_name_each_roles_metrics_in_order():
    class Scores:
        def global_model(self, role, weights):
            return {"acc": weights["w"], "loss": 1.0}

    metrics = global_metrics(Scores(), {"small": {"w": 0.25}, "large": {"w": 0.75}})
    assert list(metrics.items()) == [
        ("small/test_acc", 0.25),
        ("small/test_loss", 1.0),
        ("large/test_acc", 0.75),
        ("large/test_loss", 1.0),
    ]


def test_sent_weights_leave_a_frozen_part_home():
    strategy = FedAvg()
    server = method_env(strategy, {"m": ModelSpec("test_frozen_features_mlp")}, ONE_ROLE)
    weights = strategy.state.global_weights["m"]
    sent = SentWeights(server, ["m"])("m", weights)
    assert sorted(weights) == ["features.1.bias", "features.1.weight", "head.bias", "head.weight"]
    assert sorted(sent.state) == ["head.bias", "head.weight"] and sent.state["head.bias"] is weights["head.bias"]
    copied = SentWeights(server, ["m"])("m", weights, copy=True)
    assert copied.state["head.bias"] is not weights["head.bias"]


def test_client_context_gives_the_recipes_step_counts():
    epochs = LocalTraining(local_epochs=2, batch_size=16, eval_batch_size=100)
    server = method_env(FedAvg(), MLP, ONE_ROLE, training=epochs)
    ctx = ClientContext(server.clients[0], 1, server._loop, server.data, {}, 0)
    n = ctx.num_examples()
    assert (ctx.batch_size, ctx.eval_batch_size) == (16, 100)
    assert ctx.epoch_steps(100) == 7 and ctx.epoch_steps(96) == 6  # the last batch may be partial
    assert ctx.local_steps() == 2 * -(-n // 16) and ctx.local_steps(33) == 2 * 3
    steps = LocalTraining(local_steps=5, batch_size=16)
    server = method_env(FedAvg(), MLP, ONE_ROLE, training=steps)
    assert ClientContext(server.clients[0], 1, server._loop, server.data, {}, 0).local_steps(1000) == 5


def test_client_context_batches_draw_from_the_indices_given():
    server = method_env(FedAvg(), MLP, ONE_ROLE, training=LocalTraining(batch_size=4))
    ctx = ClientContext(server.clients[0], 1, server._loop, server.data, {}, 0)
    part = ctx.indices.train[:6]
    drawn = torch.cat([x for x, _ in ctx.batches(indices=part, steps=2)])  # one pass: a batch of 4, one of 2
    assert sorted(map(tuple, drawn.flatten(1).tolist())) == sorted(map(tuple, server.data.x[part].flatten(1).tolist()))


def test_client_context_gives_the_rounds_learning_rate():
    """The recipe's rate times the schedule's factor of the round: what a fit steps with, for a step a strategy
    takes itself (FedL2G's differentiable step)."""
    from fl_lightning.federation.schedules import StepLR

    training = LocalTraining(lr_schedule=StepLR([2], gamma=0.5))  # SGD at 0.05 by default; halved after round 2
    server = method_env(FedAvg(), MLP, ONE_ROLE, training=training, rounds=4)
    rates = [ClientContext(server.clients[0], r, server._loop, server.data, {}, 0).learning_rate("m") for r in (1, 3)]
    assert rates == [0.05, 0.025]


def test_the_set_up_checks_name_the_strategy_itself():
    with pytest.raises(ConfigError, match=r"^MOON roles \['x'\] are not trained by any tier"):
        method_env(MOON(roles=["x"]), MLP, ONE_ROLE)
    two = {"a": MLP["m"], "b": MLP["m"]}
    with pytest.raises(ConfigError, match="^DS-FL gives every client exactly one model"):
        method_env(DSFL(), two, [Tier("ab", ["a", "b"])])


def test_fedgh_refuses_clients_without_a_local_test_split_before_training(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["--config", str(ROOT / "recipes/digits_fedgh.yaml"), "--data.init_args.local_split", "[1.0, 0.0, 0.0]"]
    assert run_cli("fit", *argv, "--output_dir", str(out)) == 2
    assert "FedGH evaluates each client on its local test split" in capsys.readouterr().err
    assert not out.exists()


def test_personal_models_evaluate_a_clients_own_role():
    """FML's own model is the client's private role, whatever the tier lists first."""
    from fl_lightning.strategies import FML

    strategy = FML()
    models = {"p": ModelSpec("digits_mlp", {"hidden": 8}), "meme": ModelSpec("digits_mlp", {"hidden": 4})}
    method_env(strategy, models, [Tier("all", ["meme", "p"])])
    client = ClientSpec(0, "all", ("meme", "p"))
    role, weights = strategy.personal_weights(client, {})
    assert role == "p" and weights["features.1.weight"].shape == (8, 64)
    stored = {"weights": {"features.1.weight": torch.ones(8, 64)}}
    assert strategy.personal_weights(client, stored) == ("p", stored["weights"])


def test_a_public_subset_travels_as_positions_and_uploads_average_in_arrival_order():
    positions = torch.tensor([1, 4], dtype=torch.int32)
    down = subset_downlink("public_positions", positions)
    assert down["public_positions"].nbytes == 8 and torch.equal(received_positions(down, "public_positions"), positions)
    assert subset_downlink("public_positions", None) == {} and received_positions({}, "public_positions") is None

    a, b = ClientSpec(0, "all", ("m",)), ClientSpec(1, "all", ("m",))
    sent = [(b, torch.tensor([[1.0, 2.0]])), (a, torch.tensor([[2.0, 5.0]]))]
    updates = [ClientUpdate(c, 1, {"public_logits": TensorPayload("public_logits", {"logits": z})}) for c, z in sent]
    mean, senders = mean_upload(iter(updates), "public_logits", "logits")
    assert torch.equal(mean, torch.tensor([[1.5, 3.5]])) and mean.dtype == torch.float32 and senders == [b, a]
    assert mean_upload(iter([]), "public_logits", "logits") == (None, [])
