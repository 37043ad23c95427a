"""HtFLlib's heterogeneous extractors: sizes computed by hand, the classifier replaced by the parameter-free
pooling to ``feature_dim``, and the heads HtFLlib puts on top."""

import pytest
import torch
from torch import nn

from fl_lightning.federation.errors import ConfigError
from fl_lightning.models import ModelSpec


def _params(model):
    return sum(p.numel() for p in model.parameters())


def _build(name, **args):
    return ModelSpec(name, args).build(num_classes=args.pop("num_classes", 10))


def _pool_input(pool: nn.Module) -> dict:
    """What ``pool`` receives on the next forward pass, under ``"in"``."""
    seen = {}

    def hook(module, args, out):
        seen["in"] = args[0]

    pool.register_forward_hook(hook)
    return seen


def test_fedavg_cnn_has_the_sizes_of_htfllibs_dim_1600_network_and_the_posters_fml_traffic():
    # conv 5x5 3->32 and 32->64 with biases, Linear(64 x 5 x 5 = 1600, 512), head Linear(512, C)
    body = (3 * 32 * 25 + 32) + (32 * 64 * 25 + 64) + (1600 * 512 + 512)
    assert _params(_build("htfl_cnn")) == body + 512 * 10 + 10 == 878_538
    cifar100 = _build("htfl_cnn", num_classes=100)
    assert _params(cifar100) == body + 512 * 100 + 100
    # the FedKTL poster's traffic on CIFAR-100 with 20 clients: FML sends the meme (client 0's FedAvgCNN) each way,
    # 18.50M numbers a round; LG-FedAvg the head, 1.03M
    assert abs(20 * _params(cifar100) - 18.50e6) < 0.01e6
    assert abs(20 * _params(cifar100.head) - 1.03e6) < 0.01e6


def test_shallow_resnet4_counts_and_repeats_its_64_pooled_units_up_to_512():
    model = _build("htfl_resnet4")
    stem = 3 * 64 * 49 + 2 * 64  # 7x7 conv without bias, batch norm
    block = 2 * (64 * 64 * 9 + 2 * 64)  # two 3x3 convs with their batch norms
    assert _params(model) == stem + block + 512 * 10 + 10
    pooled = _pool_input(model.features.fc)
    model.eval()
    features = model.features(torch.randn(2, 3, 32, 32))
    assert pooled["in"].shape == (2, 64) and features.shape == (2, 512)
    assert torch.equal(features, pooled["in"].repeat_interleave(8, dim=1))  # each unit repeated 512 / 64 times


@pytest.mark.parametrize(
    "name, width", [("htfl_resnet50", 2048), ("htfl_mobilenet_v2", 1280), ("htfl_googlenet", 1024)]
)
def test_wider_networks_average_their_pooled_units_to_feature_dim(name, width):
    model = _build(name)
    model.eval()
    pool = model.features.get_submodule("classifier.1" if "mobilenet" in name else "fc")
    assert isinstance(pool, nn.AdaptiveAvgPool1d) and not list(pool.parameters())
    seen = _pool_input(pool)
    x = torch.randn(2, 3, 32, 32)
    features = model.features(x)
    assert seen["in"].shape == (2, width) and features.shape == (2, 512)
    # AdaptiveAvgPool1d: output j averages inputs floor(j W / 512) .. ceil((j + 1) W / 512) - 1
    expected = torch.stack(
        [seen["in"][:, (j * width) // 512 : -(-(j + 1) * width // 512)].mean(1) for j in range(512)], dim=1
    )
    assert torch.allclose(features, expected, atol=1e-6)
    assert torch.equal(model(x), model.head(features)) and model.head.in_features == 512


def test_feature_dim_and_the_htc4_heads():
    model = _build("htfl_resnet18", feature_dim=256, head_hidden=[128])
    assert model.feature_dim == 256 and model.features(torch.randn(2, 3, 32, 32)).shape == (2, 256)
    assert [type(m) for m in model.head] == [nn.Linear, nn.ReLU, nn.Linear]  # no ReLU on the logits
    assert (model.head[0].in_features, model.head[0].out_features, model.head[2].out_features) == (256, 128, 10)
    with pytest.raises(ConfigError, match="feature_dim must be a positive whole number, got 0"):
        _build("htfl_resnet18", feature_dim=0)
    with pytest.raises(ConfigError, match="head_hidden must list positive layer sizes"):
        _build("htfl_cnn", head_hidden=[0])
    with pytest.raises(ConfigError, match="htfl_googlenet takes RGB images"):
        ModelSpec("htfl_googlenet").build(num_classes=10, in_channels=1)


@pytest.mark.slow
def test_the_vits_take_32_pixel_images_and_map_768_units_through_htfllibs_tanh_head():
    model = _build("htfl_vit_b32", num_classes=100)
    assert [type(m) for m in model.head] == [nn.Linear, nn.Tanh, nn.Linear]
    assert (model.head[0].in_features, model.head[0].out_features) == (512, 768)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 100)
