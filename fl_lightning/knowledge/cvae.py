"""The conditional VAE of Velo (paper 003 eq. 2; layer layout from the official ``VAE_model.py``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class FeatureCVAE(nn.Module):
    """CVAE over feature vectors conditioned on the class label.

    Encoder: ``[s, embed(y)] -> Linear(hidden) -> BN -> ReLU -> Linear(2 * latent)`` giving mu and
    log sigma^2 (two dense layers). Decoder: ``[z, embed(y)] -> Linear(hidden) -> Linear(feature_dim)``
    (two dense layers, no activation between them, as in the official code).
    """

    def __init__(
        self,
        feature_dim: int,
        num_classes: int,
        hidden: int | None = None,
        latent: int | None = None,
        embed: int | None = None,
    ):
        super().__init__()
        hidden, latent, embed = hidden or feature_dim, latent or feature_dim, embed or max(1, feature_dim // 2)
        self.latent = latent
        self.label_embedding = nn.Embedding(num_classes, embed)
        self.encoder = nn.Sequential(
            nn.Linear(feature_dim + embed, hidden), nn.BatchNorm1d(hidden), nn.ReLU(), nn.Linear(hidden, 2 * latent)
        )
        self.decoder = nn.Sequential(nn.Linear(latent + embed, hidden), nn.Linear(hidden, feature_dim))

    def forward(self, s: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        e = self.label_embedding(y)
        mu, log_var = self.encoder(torch.cat([s, e], 1)).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * torch.exp(0.5 * log_var)  # reparameterisation
        return self.decoder(torch.cat([z, e], 1)), mu, log_var

    @torch.no_grad()
    def generate(self, y: Tensor) -> Tensor:
        """One synthetic feature per label, decoded from z ~ N(0, I)."""
        z = torch.randn(len(y), self.latent, device=y.device)
        return self.decoder(torch.cat([z, self.label_embedding(y)], 1))


def cvae_loss(reconstruction: Tensor, target: Tensor, mu: Tensor, log_var: Tensor, kl_weight: float = 1.0) -> Tensor:
    """Negative ELBO of eq. 2 as the official code computes it: mean squared reconstruction error plus
    ``kl_weight`` times the KL(q(z|s,y) || N(0, I)) summed over the batch and latent dimensions."""
    kl = -0.5 * torch.sum(1 + log_var - mu.pow(2) - log_var.exp())
    return F.mse_loss(reconstruction, target) + kl_weight * kl
