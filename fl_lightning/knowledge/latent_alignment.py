"""FedKTL's math: the fixed simplex ETF its clients classify against with an ArcFace margin, and the server's
alignment of the clients' class prototypes with a generator's latent space (an RBF-kernel MMD and a feature
transformer).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..federation.padding import class_index, real_labels

RBF_BANDWIDTHS = (10.0, 15.0, 20.0, 50.0)  # the FedKTL code's ``MMD(..., 'rbf')``
SINE_FLOOR = 1e-6  # sin(theta) kept above it: its slope in cos(theta) is infinite at theta = 0 and pi


def simplex_etf(num_classes: int, generator: torch.Generator | None = None) -> Tensor:
    """``[C, C]``: the rows are C unit class vectors with pairwise cosine ``-1 / (C - 1)`` (a simplex
    equiangular tight frame), ``sqrt(C / (C - 1)) P (I - 11^T / C)`` for a random orthogonal ``P`` (QR of a
    uniform matrix, in float64), its columns normalised and laid out as rows.

    Example: for C = 2 the rows are two opposite unit vectors.
    """
    if num_classes < 2:
        raise ValueError(f"a simplex ETF needs at least 2 classes, got {num_classes}")
    q, _ = torch.linalg.qr(torch.rand(num_classes, num_classes, generator=generator, dtype=torch.float64))
    centred = torch.eye(num_classes, dtype=torch.float64) - 1.0 / num_classes
    frame = math.sqrt(num_classes / (num_classes - 1)) * q @ centred  # [C (dims), C (classes)]
    return F.normalize(frame.T, dim=1).float()


def arcface_logits(outputs: Tensor, labels: Tensor, etf: Tensor, margin: float, scale: float) -> Tensor:
    """``s cos(theta_c)``, with ``s cos(theta_y + m)`` for the label's class: ``theta_c`` the angle between a row
    of ``outputs`` ``[B, C]`` and class vector ``etf[c]`` (rows of unit length, ``[C, C]``).

    ``cos(theta + m)`` is computed as ``cos(theta) cos(m) - sin(theta) sin(m)`` with ``sin(theta)`` kept at least
    1e-6: the code's ``cos(acos(c) + m)`` has an infinite gradient where an output lies on a class vector
    (``c = 1``). Like the code, no correction for ``theta_y + m > pi`` (ArcFace's "easy margin" variants).
    """
    cosine = F.normalize(outputs, dim=1) @ etf.T  # [B, C]
    sine = ((1 - cosine) * (1 + cosine)).clamp(min=SINE_FLOOR**2).sqrt()
    target = cosine * math.cos(margin) - sine * math.sin(margin)
    one_hot = class_index(labels)[:, None] == torch.arange(etf.shape[0], device=labels.device)  # [B, C]
    return scale * torch.where(one_hot, target, cosine)


def arcface_loss(outputs: Tensor, labels: Tensor, etf: Tensor, margin: float, scale: float) -> Tensor:
    """The cross-entropy of :func:`arcface_logits` (the padded rows of a lockstep batch left out)."""
    return F.cross_entropy(arcface_logits(outputs, labels, etf, margin, scale), real_labels(labels))


def rbf_mmd(x: Tensor, y: Tensor, bandwidths: tuple[float, ...] = RBF_BANDWIDTHS) -> Tensor:
    """The biased MMD estimate between samples ``x`` and ``y`` (both ``[N, L]``), summed over RBF kernels
    ``exp(-||a - b||^2 / (2 a))`` of each bandwidth ``a``: ``mean(K_xx + K_yy - 2 K_xy)``."""
    d_xx, d_yy, d_xy = _squared_distances(x, x), _squared_distances(y, y), _squared_distances(x, y)
    total = torch.zeros_like(d_xy)
    for a in bandwidths:
        total = total + torch.exp(-0.5 * d_xx / a) + torch.exp(-0.5 * d_yy / a) - 2 * torch.exp(-0.5 * d_xy / a)
    return total.mean()


def _squared_distances(a: Tensor, b: Tensor) -> Tensor:
    """``[N, M]`` squared distances as ``|a|^2 + |b|^2 - 2 a.b`` (smooth where two points coincide, unlike a
    norm's gradient)."""
    return (a * a).sum(1)[:, None] + (b * b).sum(1)[None, :] - 2 * a @ b.T


def feature_transformer(num_classes: int, latent_dim: int) -> nn.Sequential:
    """The server's ``F``: ``Linear(C, C)``, ``BatchNorm1d(C)``, ``ReLU``, ``Linear(C, latent_dim)``, from the
    clients' C-dimensional class prototypes to the generator's latent space."""
    return nn.Sequential(
        nn.Linear(num_classes, num_classes),
        nn.BatchNorm1d(num_classes),
        nn.ReLU(),
        nn.Linear(num_classes, latent_dim),
    )


def alignment_loss(transformed: Tensor, latents: Tensor, centroids: Tensor, lam: float) -> Tensor:
    """``MMD(F(P), w) + lam * MSE(F(P), centroid_y)``: the transformed prototypes ``[N, L]`` drawn towards the
    generator's latents ``w`` ``[N, L]`` (as a distribution) and towards their class's centroid ``[N, L]``."""
    return rbf_mmd(transformed, latents) + lam * F.mse_loss(transformed, centroids)
