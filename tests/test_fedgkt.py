"""FedGKT: the bidirectional KD losses by hand, the server logits aligned with each client's examples,
the sizes sent (N_k (D + C + 1) up, N_k C down) and the errors."""

import math

import pytest
import torch
from conftest import ROOT, client_update, method_env, read_summary, run_cli

from fl_lightning.client import LocalTraining
from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedGKT
from fl_lightning.strategies.fedgkt import bidirectional_losses

D = 8  # the client model's feature size (digits_mlp hidden 8)
MODELS = {"m": ModelSpec("digits_mlp", {"hidden": D}), "server": ModelSpec("digits_mlp", {"in_features": D})}


def _env(strategy, models=MODELS, tiers=None):
    training = LocalTraining(optimizer=lambda p: torch.optim.SGD(p, lr=0.1), local_steps=2, batch_size=8)
    return method_env(strategy, models, tiers or [Tier("all", ["m"])], training=training)


def test_bidirectional_losses_by_hand():
    z_client, z_server, y = torch.tensor([[0.0, 0.0]]), torch.tensor([[math.log(3.0), 0.0]]), torch.tensor([0])
    client, server = bidirectional_losses(z_client, z_server, y, alpha=1.0, temperature=1.0)
    # client: CE = ln 2 = 0.693147; KL((0.75, 0.25) || (0.5, 0.5)) = 0.75 ln 1.5 + 0.25 ln 0.5 = 0.130812
    assert client.item() == pytest.approx(0.693147 + 0.130812, abs=1e-5)
    # server: CE = -ln 0.75 = 0.287682; KL((0.5, 0.5) || (0.75, 0.25)) = 0.5 ln(2/3) + 0.5 ln 2 = 0.143841
    assert server.item() == pytest.approx(0.287682 + 0.143841, abs=1e-5)
    client, _ = bidirectional_losses(z_client, z_server, y, alpha=0.5, temperature=2.0)
    # T = 2: teacher softmax(ln 3 / 2, 0) = (0.633975, 0.366025), KL to uniform 0.036339, x T^2 = 4, x alpha 0.5
    assert client.item() == pytest.approx(0.693147 + 0.5 * 4 * 0.036339, abs=1e-5)


def test_sizes_sent_and_server_logits_aligned_with_the_clients_examples():
    strategy = FedGKT(server_epochs=1)
    server = _env(strategy)
    client = server.clients[1]
    n = len(server.data.clients[1].train)
    task = strategy.configure_round(1, [client])[0]
    assert task.downlink == {}  # nothing to send before the server has trained
    state = {}
    update = client_update(strategy, server, task, state)
    sent = update.uplink["features"]
    assert sent.nbytes == n * (D + 10 + 1) * 4  # features, logits and an int32 label per example
    assert torch.equal(sent.tensors["labels"].long(), server.data.y[server.data.clients[1].train])
    strategy.aggregate(1, iter([update]))
    down = strategy.configure_round(2, [client])[0].downlink["server_logits"]
    assert down.nbytes == n * 10 * 4
    # example i's teacher is the server's output on example i's features, in the client's order
    expected = server.predict("server", strategy.state.server_weights, sent.tensors["features"])
    assert torch.allclose(down.tensors["logits"], expected)
    assert strategy.configure_round(2, [server.clients[0]])[0].downlink == {}  # client 0 never uploaded
    client_update(strategy, server, strategy.configure_round(2, [client])[0], state)  # distills from them


def test_fedgkt_resnet8_sends_its_stem_feature_maps_and_the_server_resnet_continues_from_them():
    models = {
        "m": ModelSpec("fedgkt_client_resnet8", {"in_channels": 1}),
        "server": ModelSpec("fedgkt_server_resnet", {"depth": 20}),
    }
    strategy = FedGKT(server_epochs=1)
    server = _env(strategy, models=models)
    client, idx = server.clients[1], server.data.clients[1].train
    update = client_update(strategy, server, strategy.configure_round(1, [client])[0], {})
    sent = update.uplink["features"].tensors
    # every example's 16 x 8 x 8 map after the stem (digits are 8 x 8), its 10 logits and an int32 label
    assert sent["features"].shape == (len(idx), 16, 8, 8)
    assert update.uplink["features"].nbytes == len(idx) * (16 * 8 * 8 + 10 + 1) * 4
    model = server.model("m")  # the trained client's weights are still loaded: its own split pieces agree
    model.eval()
    with torch.no_grad():
        x = server.data.x[idx]
        assert torch.allclose(sent["features"], model.extract(x), atol=1e-6)
        assert torch.allclose(sent["logits"], model(x), atol=1e-5)
        assert torch.allclose(model.classify(model.extract(x)), model.head(model.features(x)), atol=1e-6)
    strategy.aggregate(1, iter([update]))
    down = strategy.configure_round(2, [client])[0].downlink["server_logits"].tensors["logits"]
    assert down.shape == (len(idx), 10)
    assert torch.allclose(down, server.predict("server", strategy.state.server_weights, sent["features"]))


def test_bad_settings_are_refused_in_one_sentence():
    wrong = {"m": MODELS["m"], "server": ModelSpec("digits_mlp", {"in_features": 64})}
    with pytest.raises(ConfigError, match=r"does not accept role 'm''s features of shape \(8,\); .*\{in_features: 8\}"):
        _env(FedGKT(), models=wrong)
    maps = {
        "m": ModelSpec("fedgkt_client_resnet8", {"in_channels": 1}),
        "server": ModelSpec("fedgkt_server_resnet", {"feature_channels": 8}),
    }
    with pytest.raises(
        ConfigError, match=r"shape \(16, 8, 8\); .*fedgkt_server_resnet with args \{feature_channels: 16\}"
    ):
        _env(FedGKT(), models=maps)
    with pytest.raises(ConfigError, match="server_role 'server' is the server's own model, but tiers give it"):
        _env(FedGKT(), tiers=[Tier("all", ["server"])])
    with pytest.raises(ConfigError, match="FedGKT temperature must be > 0, got 0."):
        FedGKT(temperature=0)


def test_a_short_run_learns_and_counts_every_example(tmp_path):
    """Learning measured against the same run untrained: client learning rate 0 and no server epochs. Two rounds of
    20 local steps (the recipe's 10 left 0.217 against 0.099, a margin of 0.118 for the 0.1 asked): 0.358."""
    recipe = ["--config", str(ROOT / "recipes" / "digits_fedgkt.yaml"), "--rounds", "2", "--eval_every", "2"]
    recipe += ["--training.local_steps", "20", "--runtime.progress", "false"]
    assert run_cli("fit", *recipe, "--output_dir", str(tmp_path / "g")) == 0
    frozen = ["--training.optimizer.init_args.lr", "0", "--strategy.init_args.server_epochs", "0"]
    assert run_cli("fit", *recipe, *frozen, "--output_dir", str(tmp_path / "untrained")) == 0
    summary = read_summary(tmp_path / "g")
    untrained = read_summary(tmp_path / "untrained")
    accuracy, baseline = summary["final"]["server/test_acc"], untrained["final"]["server/test_acc"]
    assert summary["monitor"] == "server/test_acc" and accuracy > baseline + 0.1, (accuracy, baseline)
    train = sum(c["train"] for c in json_partition(tmp_path / "g"))
    # all clients in both rounds: N (32 + 10 + 1) up each round, N x 10 down in round 2 only
    assert summary["comm"]["uplink_bytes"] == 2 * train * 43 * 4
    assert summary["comm"]["downlink_bytes"] == train * 10 * 4


def json_partition(run_dir):
    import json

    return json.loads((run_dir / "partition.json").read_text())["clients"]
