"""Velo: Felo with a conditional VAE on the server (paper 003, Sec. 3.2, eq. 2, Algorithm 2)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import torch
from torch import Tensor

from ..federation.bounds import Ge, NonNegative, NonNegativeInt, Positive, PositiveInt
from ..knowledge.cvae import FeatureCVAE, cvae_loss
from .base import ServerContext
from .felo import Felo, FeloState


@dataclass
class VeloState(FeloState):
    """Felo's state, and the CVAE with what it trains on (``D`` the feature size, ``C`` classes)."""

    cvae: FeatureCVAE
    stored_features: Tensor  # [M, D] the received class features, the newest max_features of them
    stored_labels: Tensor  # [M] their classes
    synthetic: Tensor | None = None  # [C, D] features for the next round, once the CVAE has been trained


class Velo(Felo):
    """Felo whose server sends synthetic class features decoded by a CVAE instead of class averages.

    The server keeps the class features it receives (up to ``max_features``, oldest dropped first) and
    every ``cvae_interval`` rounds trains the CVAE on them for ``cvae_epochs`` epochs (batch
    ``cvae_batch_size``, a new Adam optimizer with ``cvae_lr`` on persistent CVAE weights, as the
    official code). Each round it decodes one ``z ~ N(0, I)`` per class into that class's feature for
    the next round (code); logits are averaged and sent as in Felo from the first round on. Until the
    CVAE is first trained no features are sent (nor counted); afterwards features go to the classes
    the CVAE has received features of. Table 4 varies ``cvae_interval`` (1-10).

    Args:
        cvae_interval: rounds between CVAE trainings.
        cvae_epochs, cvae_batch_size, cvae_lr: CVAE training.
        max_features: received class features kept for training.
        kl_weight: weight of the KL term (1 in eq. 2).
        cvae_hidden, cvae_latent: layer sizes (default: the feature dimension, as the code's 1024).
        (alpha, logit_loss, average_weights, warmup_rounds, forget, loss_average: as Felo)
    """

    state: VeloState

    def __init__(
        self,
        cvae_interval: PositiveInt = 1,
        cvae_epochs: NonNegativeInt = 10,
        cvae_batch_size: PositiveInt = 50,
        cvae_lr: Positive = 1e-3,
        # fewer stored features than two never trains the CVAE; 0 would keep them all
        max_features: Annotated[int, Ge(2)] = 5000,
        kl_weight: NonNegative = 1.0,
        cvae_hidden: PositiveInt | None = None,
        cvae_latent: PositiveInt | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)  # Felo's options
        self.cvae_interval, self.cvae_epochs, self.cvae_batch_size = cvae_interval, cvae_epochs, cvae_batch_size
        self.cvae_lr, self.max_features, self.kl_weight = cvae_lr, max_features, kl_weight
        self.cvae_hidden, self.cvae_latent = cvae_hidden, cvae_latent

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        cvae = FeatureCVAE(self.feature_dim, self.num_classes, self.cvae_hidden, self.cvae_latent)
        features, labels = torch.empty(0, self.feature_dim), torch.empty(0, dtype=torch.long)
        self.state = VeloState(**vars(self.state), cvae=cvae, stored_features=features, stored_labels=labels)

    def receive_features(self, features: Tensor, present: Tensor) -> None:
        """Keeps the received class features ``[C, D]`` of the ``present`` classes, the newest ``max_features``."""
        state, labels = self.state, torch.nonzero(present).flatten().cpu()
        received = features[present].detach().float().cpu()
        state.stored_features = torch.cat([state.stored_features, received])[-self.max_features :]
        state.stored_labels = torch.cat([state.stored_labels, labels])[-self.max_features :]

    def server_step(self, rnd: int) -> dict[str, float]:
        """Every ``cvae_interval`` rounds trains the CVAE; once it has trained, decodes the next round's features."""
        state, metrics = self.state, {}
        if rnd % self.cvae_interval == 0 and len(state.stored_labels) >= 2:
            metrics["server/cvae_loss"] = self.train_cvae()
        if state.synthetic is not None or "server/cvae_loss" in metrics:
            state.cvae.eval()
            state.synthetic = state.cvae.generate(torch.arange(self.num_classes))
        return metrics

    def train_cvae(self) -> float:
        """``cvae_epochs`` epochs on the stored features with a new Adam optimizer; the mean loss."""
        cvae, features, labels = self.state.cvae, self.state.stored_features, self.state.stored_labels
        optimizer = torch.optim.Adam(cvae.parameters(), lr=self.cvae_lr)
        cvae.train()
        n, total, batches = len(labels), 0.0, 0
        for _ in range(self.cvae_epochs):
            order = torch.randperm(n)
            for start in range(0, n, self.cvae_batch_size):
                idx = order[start : start + self.cvae_batch_size]
                if len(idx) < 2:  # BatchNorm needs two examples
                    continue
                reconstruction, mu, log_var = cvae(features[idx], labels[idx])
                loss = cvae_loss(reconstruction, features[idx], mu, log_var, self.kl_weight)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total, batches = total + loss.item(), batches + 1
        return total / max(batches, 1)

    def server_features(self) -> tuple[Tensor, Tensor] | None:
        """The CVAE's class features and the classes it has received features of; ``None`` before it trains."""
        if self.state.synthetic is None:
            return None
        seen = torch.bincount(self.state.stored_labels, minlength=self.num_classes) > 0
        return self.state.synthetic, seen
