"""FedKTL: the ETF, the ArcFace logits and the MMD by hand, the server's alignment and generation with a small
random generator, what each side sends (and the ledger's bytes), evaluation against the ETF, and its checks."""

import json
import math

import pytest
import torch
import torch.nn.functional as F
import yaml
from conftest import TINY, client_update, method_env, metrics_rows, run_cli

from fl_lightning.federation.errors import ConfigError
from fl_lightning.federation.population import Tier
from fl_lightning.federation.types import ClientUpdate
from fl_lightning.knowledge.class_stats import ClassStatistics
from fl_lightning.knowledge.latent_alignment import (
    RBF_BANDWIDTHS,
    alignment_loss,
    arcface_logits,
    rbf_mmd,
    simplex_etf,
)
from fl_lightning.models import ModelSpec
from fl_lightning.strategies import FedKTL

C, D, L, NOISE = 10, 8, 6, 5  # classes, the clients' feature size, the generator's latent and noise sizes
GENERATOR = ModelSpec("random_image_generator", {"noise_dim": NOISE, "latent_dim": L, "hidden": 8})
MODELS = {"m": ModelSpec("digits_mlp", {"hidden": D}), "generator": GENERATOR}
FAST = {"server_epochs": 2, "server_batch_size": 4}


def _env(**options):
    strategy = FedKTL(**{**FAST, **options})
    return strategy, method_env(strategy, MODELS, [Tier("all", ["m"])])


def _upload(client, rows: dict[int, list[float]]) -> ClientUpdate:
    labels = sorted(rows)
    stats = ClassStatistics(
        "class_prototypes", {"prototypes": torch.tensor([rows[c] for c in labels])}, torch.tensor(labels).int()
    )
    return ClientUpdate(client, 1, {"class_prototypes": stats})


# ---------------------------------------------------------------------------------------------- the math
@pytest.mark.parametrize("classes", [2, 4, 10])
def test_the_etf_rows_are_unit_vectors_at_equal_angles(classes):
    etf = simplex_etf(classes, torch.Generator().manual_seed(0))
    cosines = etf @ etf.T
    off = ~torch.eye(classes, dtype=torch.bool)
    assert torch.allclose(cosines.diagonal(), torch.ones(classes), atol=1e-6)
    assert torch.allclose(cosines[off], torch.full((classes * (classes - 1),), -1 / (classes - 1)), atol=1e-6)


def test_arcface_adds_the_margin_to_the_labels_angle_only():
    etf = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    outputs = torch.tensor([[3.0, 3.0], [0.0, 2.0]])  # 45 degrees from both; on class 1's vector
    logits = arcface_logits(outputs, torch.tensor([0, 1]), etf, margin=0.5, scale=2.0)
    expected = [[2 * math.cos(math.pi / 4 + 0.5), 2 * math.cos(math.pi / 4)], [0.0, 2 * math.cos(0.5)]]
    assert torch.allclose(logits, torch.tensor(expected), atol=1e-5)


def test_the_rbf_mmd_by_hand():
    x, y = torch.tensor([[0.0], [0.0]]), torch.tensor([[1.0], [1.0]])
    # every x-x and y-y distance 0, every x-y squared distance 1: sum_a (1 + 1 - 2 exp(-1 / (2a)))
    expected = sum(2 - 2 * math.exp(-0.5 / a) for a in RBF_BANDWIDTHS)
    assert rbf_mmd(x, y).item() == pytest.approx(expected, rel=1e-6)
    assert rbf_mmd(x, x).item() == pytest.approx(0.0, abs=1e-7)
    centroids = torch.tensor([[0.0], [2.0]])  # MSE to them: (0 + 4) / 2 = 2
    assert alignment_loss(x, y, centroids, lam=0.5).item() == pytest.approx(expected + 1.0, rel=1e-6)


# ---------------------------------------------------------------------------------------------- the server
def test_the_server_aligns_the_uploads_and_generates_one_image_per_class_from_its_centroid():
    strategy, server = _env()
    c = server.clients
    up = [_upload(c[0], {0: [1.0] + [0.0] * 9, 3: [0.0] * 9 + [1.0]}), _upload(c[1], {0: [0.0, 1.0] + [0.0] * 8})]
    before = strategy.state.centroids.weight.detach().clone()
    metrics = strategy.aggregate(1, iter(up))
    assert metrics["server/alignment_loss"] > 0
    state = strategy.state
    sent = [u.uplink["class_prototypes"].vectors["prototypes"] for u in up]
    prototypes = torch.stack([sent[0][0], sent[1][0], sent[0][1]])  # class 0 twice, class 3 once
    with torch.no_grad():
        mapped = state.transformer.eval()(prototypes)
    # the uploaded classes' centroids: the mean of their transformed prototypes under the trained F
    assert torch.allclose(state.latents[0], mapped[:2].mean(0), atol=1e-6)
    assert torch.allclose(state.latents[3], mapped[2], atol=1e-6)
    assert torch.equal(state.latents[5], before[5])  # a class nobody uploaded keeps its centroid
    generator = server.model("generator").eval()
    with torch.no_grad():
        assert torch.allclose(state.images, generator.head(state.latents), atol=1e-6)
    assert state.images.shape == (C, 1, 8, 8)


def test_each_direction_sends_what_the_method_needs():
    strategy, server = _env()
    client = server.clients[0]
    task = strategy.configure_round(1, [client])[0]
    assert set(task.downlink) == {"etf", "projection"}  # no image before the first aggregation
    assert task.downlink["etf"].nbytes == C * C * 4 and task.downlink["projection"].nbytes == (D * L + L) * 4
    update = client_update(strategy, server, task)
    sent = update.uplink["class_prototypes"]
    classes = sorted(set(server.data.y[server.data.clients[0].train].tolist()))
    assert sent.labels.tolist() == classes and sent.nbytes == len(classes) * (C + 1) * 4
    assert torch.allclose(sent.vectors["prototypes"].norm(dim=1), torch.ones(len(classes)))
    strategy.aggregate(1, iter([update]))
    generated = strategy.configure_round(2, [client])[0].downlink["generated"]
    assert generated.nbytes == C * (64 + L) * 4  # an 8x8 image and its latent per class


def test_the_upload_is_the_normalised_mean_of_the_normalised_outputs():
    strategy, server = _env()
    client, state = server.clients[0], {}
    update = client_update(strategy, server, strategy.configure_round(1, [client])[0], state)
    model = server.model("m").eval()
    model.load_state_dict(state["weights"])
    idx = server.data.clients[0].train
    with torch.no_grad():
        outputs, y = F.normalize(model(server.data.x[idx]), dim=1), server.data.y[idx]
    sent = update.uplink["class_prototypes"]
    expected = F.normalize(torch.stack([outputs[y == k].mean(0) for k in sent.labels.tolist()]), dim=1)
    assert torch.allclose(sent.vectors["prototypes"], expected, atol=1e-5)


def test_the_latent_term_enters_the_loss_and_the_projection_stays_the_servers():
    losses = {}
    for mu in (0.0, 1000.0):
        strategy, server = _env(mu=mu)
        client = server.clients[0]
        first = [client_update(strategy, server, t) for t in strategy.configure_round(1, [client])]
        strategy.aggregate(1, iter(first))
        projection = {k: v.clone() for k, v in strategy.state.projection.items()}
        losses[mu] = client_update(strategy, server, strategy.configure_round(2, [client])[0]).metrics["m/loss"]
        assert all(torch.equal(strategy.state.projection[k], v) for k, v in projection.items())
    assert losses[1000.0] > losses[0.0] + 1.0


def test_evaluation_picks_the_class_vector_nearest_in_cosine():
    strategy, server = _env()
    client = server.clients[0]
    role, weights = strategy.personal_weights(client, {})
    own = server.initial_weights("m", client.id)
    model = server.model(role).eval()
    x = server.data.x[:20]
    with torch.no_grad():
        model.load_state_dict(own)
        cosine = F.normalize(model(x), dim=1) @ strategy.state.etf.T
        model.load_state_dict(weights)
        assert torch.equal(model(x).argmax(1), cosine.argmax(1))


# ---------------------------------------------------------------------------------------------- its checks
def test_a_generator_that_is_not_one_or_makes_other_images_is_refused():
    with pytest.raises(ConfigError, match="must be a LatentGenerator"):
        method_env(FedKTL(), {**MODELS, "generator": ModelSpec("digits_mlp")}, [Tier("all", ["m"])])
    small = ModelSpec("random_image_generator", {"image_size": 4})
    with pytest.raises(ConfigError, match=r"images \[1, 4, 4\], but the clients' examples are \[1, 8, 8\]"):
        method_env(FedKTL(), {**MODELS, "generator": small}, [Tier("all", ["m"])])
    with pytest.raises(ConfigError, match="server's own model"):
        method_env(FedKTL(), MODELS, [Tier("all", ["generator"])])


def test_client_models_need_one_feature_size_and_the_data_s_classes():
    models = {**MODELS, "n": ModelSpec("digits_mlp", {"hidden": D + 1})}
    with pytest.raises(ConfigError, match="same D"):
        method_env(FedKTL(), models, [Tier("a", ["m"], count=2), Tier("b", ["n"])])
    with pytest.raises(ConfigError, match="FedKTL server_batch_size must be >= 2, got 1."):
        FedKTL(server_batch_size=1)


def test_the_ledger_counts_what_each_round_sends(tmp_path):
    recipe = dict(TINY, rounds=2, eval_every=1)
    recipe["training"] = {**TINY["training"], "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.01}}}
    recipe.update(
        models={
            "global": {"builder": "digits_mlp", "args": {"hidden": D}},
            "generator": {"builder": GENERATOR.builder, "args": GENERATOR.args},
        },
        sampler={"class_path": "fl_lightning.federation.sampling.UniformSampler", "init_args": {"fraction": 1.0}},
        strategy={"class_path": "fl_lightning.strategies.FedKTL", "init_args": {**FAST, "split": "global"}},
    )
    recipe["population"] = {"num_clients": 4, "tiers": [{"name": "all", "roles": ["global"]}]}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    assert run_cli("fit", "--config", str(tmp_path / "r.yaml"), "--output_dir", str(tmp_path / "run")) == 0
    clients = json.loads((tmp_path / "run" / "partition.json").read_text())["clients"]
    rows = sum(sum(1 for n in client["class_counts"] if n) for client in clients)
    metrics = metrics_rows(tmp_path / "run")
    assert [int(r["comm/round_uplink_bytes"]) for r in metrics] == [rows * (C + 1) * 4] * 2
    fixed = C * C + D * L + L  # the ETF and the projection, every round
    down = [4 * fixed * 4, 4 * (fixed + C * (64 + L)) * 4]  # from round 2 the images and latents too
    assert [int(r["comm/round_downlink_bytes"]) for r in metrics] == down
    # the local training compute counts the clients' role only: the server's generator is no client's training
    compute = json.loads((tmp_path / "run" / "summary.json").read_text())["compute"]
    assert list(compute["step_flops"]) == ["global"] and "not_counted" not in compute
    assert compute["train_flops"] == int(metrics[-1]["compute/train_flops"]) > 0
