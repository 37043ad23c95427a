"""An image generator in the model contract, for methods whose server generates images (FedKTL).

A generator role is a recipe ``models`` entry like any other: its builder returns a :class:`LatentGenerator`,
whose ``features`` map noise to the generator's latent space (StyleGAN's mapping network, z to w) and whose
``head`` maps latents to images the clients' models take (the synthesis network, with whatever resizing and
normalisation the clients' data have). A pretrained generator (StyleGAN-XL, StyleGAN3, a diffusion decoder) is
wrapped so by the user's own builder; the bundled :func:`random_image_generator` is a small randomly initialised
stand-in whose images are noise, for tests and the digits recipe.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..federation.errors import ConfigError
from .base import FeatureClassifier
from .registry import register_model


class LatentGenerator(FeatureClassifier):
    """``features``: noise ``[B, noise_dim]`` drawn from N(0, I) to latents ``[B, latent_dim]``; ``head``: latents
    to images ``[B, *image_shape]``. It predicts no classes (``num_classes`` is None) and is never trained.

    Args:
        mapping: noise to latents.
        synthesis: latents to images.
        noise_dim: the size of the noise the mapping takes.
        latent_dim: the size of the latents.
    """

    def __init__(self, mapping: nn.Module, synthesis: nn.Module, noise_dim: int, latent_dim: int):
        super().__init__(mapping, synthesis, latent_dim, None)  # type: ignore[arg-type]  # no classes
        self.noise_dim = noise_dim
        self.requires_grad_(False)

    def train(self, mode: bool = True):
        return super().train(False)  # a fixed generator: batch-norm statistics and dropout as built

    def generate(self, noise: Tensor) -> Tensor:
        """Images from noise: ``head(features(noise))``."""
        return self(noise)


@register_model("random_image_generator")
def random_image_generator(
    noise_dim: int = 16,
    latent_dim: int = 32,
    hidden: int = 64,
    image_size: int = 8,
    in_channels: int = 1,
) -> LatentGenerator:
    """A small randomly initialised generator (no pretrained weights): its images are noise.

    Mapping: ``Linear(noise_dim, latent_dim)``, LeakyReLU(0.2), ``Linear(latent_dim, latent_dim)``; synthesis:
    ``Linear(latent_dim, hidden)``, ReLU, ``Linear(hidden, in_channels * image_size^2)`` to
    ``[in_channels, image_size, image_size]`` images.

    Args:
        noise_dim, latent_dim, hidden: the layer sizes.
        image_size: the images' height and width (the clients' inputs: 8 for digits, 32 for CIFAR).
        in_channels: given by the run (the data's channels).
    """
    for name, value in {"noise_dim": noise_dim, "latent_dim": latent_dim, "hidden": hidden}.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"random_image_generator {name} must be a positive integer, got {value!r}.")
    if not isinstance(image_size, int) or image_size < 1:
        raise ConfigError(f"random_image_generator image_size must be a positive integer, got {image_size!r}.")
    mapping = nn.Sequential(nn.Linear(noise_dim, latent_dim), nn.LeakyReLU(0.2), nn.Linear(latent_dim, latent_dim))
    synthesis = nn.Sequential(
        nn.Linear(latent_dim, hidden),
        nn.ReLU(),
        nn.Linear(hidden, in_channels * image_size * image_size),
        nn.Unflatten(1, (in_channels, image_size, image_size)),
    )
    return LatentGenerator(mapping, synthesis, noise_dim, latent_dim)
