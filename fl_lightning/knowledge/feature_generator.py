"""FedGen's conditional generator of feature-level samples and the losses that train it.

Zhu, Hong and Zhou, "Data-Free Knowledge Distillation for Heterogeneous Federated Learning", ICML 2021
(layer layout and losses from the official ``generator.py`` and ``serverpFedGen.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from ..federation.padding import real_labels
from .distillation import kl_to_targets

LabelDraw = Literal["uniform", "counts"]


class FeatureGenerator(nn.Module):
    """``G(eps, y)``: ``[eps, onehot(y)] -> Linear(hidden) -> BN -> ReLU -> Linear(feature_dim)``.

    The noise ``eps`` is uniform on ``[0, 1)`` (``torch.rand``, as both codes draw it although their comment
    says Gaussian); it is an argument so that a draw is the caller's, from the caller's generator.

    Args:
        num_classes: C, the size of the one-hot label.
        feature_dim: D, the size of the representation a model's head reads.
        noise_dim: size of ``eps`` (32 for MNIST in the official configuration).
        hidden_dim: width of the hidden layer (256 for MNIST).
    """

    def __init__(self, num_classes: int, feature_dim: int, noise_dim: int = 32, hidden_dim: int = 256):
        super().__init__()
        self.num_classes, self.noise_dim = num_classes, noise_dim
        self.hidden = nn.Sequential(
            nn.Linear(noise_dim + num_classes, hidden_dim), nn.BatchNorm1d(hidden_dim), nn.ReLU()
        )
        self.out = nn.Linear(hidden_dim, feature_dim)

    def forward(self, noise: Tensor, labels: Tensor) -> Tensor:
        """Features ``[B, D]`` for ``noise`` ``[B, noise_dim]`` and ``labels`` ``[B]``."""
        onehot = F.one_hot(labels, self.num_classes).to(noise.dtype)
        return self.out(self.hidden(torch.cat([noise, onehot], 1)))


def label_distribution(counts: Tensor, draw: LabelDraw) -> Tensor:
    """``[C]`` probabilities of the labels that generated samples carry, from the label counts ``[C]``.

    ``uniform``: every label some client holds, equally (the official code's ``qualified_labels``);
    ``counts``: in proportion to the counts (HtFLlib draws from the list of every training label).
    """
    held = (counts > 0).to(torch.float64)
    weights = held if draw == "uniform" else counts.to(torch.float64)
    return weights / weights.sum()


def label_shares(counts: Tensor) -> Tensor:
    """``[K, C]``: each client's share of every label, ``n_{k,c} / sum_k n_{k,c}`` (0 for a label nobody holds).

    The official server weighs head k's loss on a sample of label y by this share (``get_label_weights``).
    """
    totals = counts.sum(0, keepdim=True)
    return torch.where(totals > 0, counts / totals.clamp(min=1), torch.zeros_like(counts, dtype=torch.float64))


def heads_logits(template: nn.Module, heads: dict[str, Tensor], features: Tensor) -> Tensor:
    """``[K, B, C]``: K heads of ``template``'s structure, their tensors stacked ``[K, ...]`` in ``heads`` (named as
    in the template's state dict), each on the same ``features`` ``[B, D]``, in one vmapped call."""

    def one(head: dict[str, Tensor], z: Tensor) -> Tensor:
        return functional_call(template, head, (z,))

    return torch.func.vmap(one, in_dims=(0, None))(heads, features)


def label_weighted_teacher_loss(logits: Tensor, labels: Tensor, shares: Tensor) -> Tensor:
    """The official server's teacher loss: ``sum_k mean_i(w_{k, y_i} CE(logits_{k,i}, y_i))``.

    Args:
        logits: ``[K, B, C]`` every uploaded head's logits of the generated features.
        labels: ``[B]`` the labels the features were generated for.
        shares: ``[K, C]`` each head's weight per label (:func:`label_shares`).
    """
    losses = torch.stack([F.cross_entropy(z, labels, reduction="none") for z in logits])  # [K, B]
    return (losses * shares[:, labels].to(losses.dtype)).mean(1).sum()


def ensemble_teacher_loss(logits: Tensor, labels: Tensor, weights: Tensor) -> Tensor:
    """HtFLlib's teacher loss: the cross-entropy of the weighted sum of the heads' logits,
    ``CE(sum_k w_k logits_k, y)``, ``w_k`` head k's share of the training examples (the paper's
    ensemble of the users' heads, weighted by examples).

    Args:
        logits: ``[K, B, C]``; labels: ``[B]``; weights: ``[K]``.
    """
    return F.cross_entropy((logits * weights.to(logits.dtype)[:, None, None]).sum(0), labels)


def diversity_loss(noise: Tensor, features: Tensor) -> Tensor:
    """The official generator's diversity term: ``exp(-mean_{i,j} d2(eps_i, eps_j) * d1(G_i, G_j))``.

    ``d2`` is the mean squared difference of two noise vectors, ``d1`` the mean absolute difference of two
    generated features, over every ordered pair of the batch (the diagonal included, where both are 0). It
    falls as outputs of different noise move apart, so minimising it keeps the generator from collapsing.
    """
    noise_distance = (noise[None] - noise[:, None]).pow(2).mean(2)  # [B, B]
    feature_distance = (features[None] - features[:, None]).abs().mean(2)
    return torch.exp(-(noise_distance * feature_distance).mean())


def regularised_loss(
    logits: Tensor,
    labels: Tensor,
    generated_logits: Tensor,
    generated_labels: Tensor,
    alpha: float,
    beta: float = 0.0,
    label_logits: Tensor | None = None,
) -> Tensor:
    """A FedGen client's loss: ``CE(f(x), y) + alpha CE(h(G(y_hat)), y_hat) + beta KL(softmax(h(G(y))) || f(x))``.

    The official ``userpFedGen.train``: the second term distils the generated features' labels into the
    head; the third (``label_logits``, the head on features generated for the batch's own labels, a
    fixed target) pulls the prediction on real data to the head's on generated data. Means leave out a
    padded batch's padded rows (``federation.padding``).

    Args:
        logits: ``[B, C]`` the model on the real batch; labels: ``[B]``.
        generated_logits: ``[G, C]`` the head on generated features; generated_labels: ``[G]``.
        alpha, beta: the round's weights of the two terms.
        label_logits: ``[B, C]`` the head on features generated for ``labels`` (needed when ``beta``).
    """
    loss = F.cross_entropy(logits, real_labels(labels))
    loss = loss + alpha * F.cross_entropy(generated_logits, real_labels(generated_labels))
    if label_logits is not None:
        loss = loss + beta * kl_to_targets(logits, F.softmax(label_logits.detach().float(), 1))
    return loss


def with_generated_features(
    batches: Iterable[tuple[Tensor, Tensor]],
    generate: Callable[[Tensor, Tensor], Tensor],
    distribution: Tensor,
    noise_dim: int,
    generator: torch.Generator,
    for_labels: bool,
) -> Iterator[tuple[Tensor, ...]]:
    """Each batch ``(x, y)`` with one generated feature per example: ``(x, y, G(eps, y_hat), y_hat)``, and
    ``G(eps', y)`` for the batch's own labels after them when ``for_labels``.

    ``y_hat`` is drawn from ``distribution`` ``[C]`` and the noise from ``generator``, batch by batch as the
    batches are asked for, so the generated samples travel in the batch and the step stays pure.
    """
    for x, y in batches:
        n = len(y)
        drawn = torch.multinomial(distribution, n, replacement=True, generator=generator).to(y.device)
        extra = (generate(_noise(n, noise_dim, generator, y.device), drawn), drawn)
        if for_labels:
            extra += (generate(_noise(n, noise_dim, generator, y.device), y),)
        yield (x, y, *extra)


def _noise(n: int, noise_dim: int, generator: torch.Generator, device: torch.device) -> Tensor:
    return torch.rand(n, noise_dim, generator=generator).to(device)
