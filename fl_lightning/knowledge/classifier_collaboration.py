"""FedPAC's classifier collaboration: each client's feature statistics and the combination of classifier heads that
minimises the estimated test loss, a quadratic program on the simplex.

Xu, Tong and Huang, "Personalized Federated Learning with Feature Alignment and Classifier Collaboration", ICLR
2023: client i's new head is ``sum_j alpha_ij head_j``, with ``alpha_i`` minimising ``alpha^T P_i alpha``
over the simplex, ``P_i = diag(V) + D_i``: ``V_j`` the variance term of client j's features, ``D_i[j1, j2] = sum_c
(h_i[c] - h_j1[c]) . (h_i[c] - h_j2[c])`` the bias term, ``h_j[c] = pi_jc mu_jc`` (class share times class mean).
"""

from __future__ import annotations

import torch
from torch import Tensor


class FeatureStatistics:
    """Streams a client's features per class: ``V`` and ``h`` of the official code's ``statistics_extraction``.

    ``h[c] = pi_c mu_c`` and ``V = sum_c (pi_c E_c||f||^2 - pi_c^2 ||mu_c||^2) / N``, with ``pi_c = n_c / N`` the
    class's share of the N examples and ``mu_c`` its mean feature (the official code and PFLlib divide V by N once
    more; so here).
    """

    def __init__(self, num_classes: int, dim: int, device: torch.device | str = "cpu"):
        self.sums = torch.zeros(num_classes, dim, dtype=torch.float64, device=device)
        self.squares = torch.zeros(num_classes, dtype=torch.float64, device=device)
        self.counts = torch.zeros(num_classes, dtype=torch.float64, device=device)

    @torch.no_grad()
    def add(self, features: Tensor, labels: Tensor) -> None:
        """Adds a batch: ``features`` ``[B, D]`` of classes ``labels`` ``[B]``."""
        f = features.detach().double()
        self.sums.index_add_(0, labels, f)
        self.squares.index_add_(0, labels, f.pow(2).sum(1))
        self.counts.index_add_(0, labels, torch.ones_like(labels, dtype=torch.float64))

    def result(self) -> tuple[float, Tensor]:
        """``(V, h)``: the variance term and ``[C, D]`` float32 ``h`` (zero rows for absent classes)."""
        total = self.counts.sum()
        shares = self.counts / total
        means = self.sums / self.counts.clamp(min=1)[:, None]
        variance = (shares * self.squares / self.counts.clamp(min=1) - shares.pow(2) * means.pow(2).sum(1)).sum()
        return float(variance / total), (shares[:, None] * means).float()


def collaboration_matrix(i: int, variances: Tensor, h: Tensor) -> Tensor:
    """``P_i = diag(V) + D_i`` ``[K, K]`` (float64) for client i among K clients.

    Args:
        variances: ``[K]`` each client's V.
        h: ``[K, C, D]`` each client's ``h``.
    """
    gaps = (h[i][None] - h).flatten(1).double()  # [K, C*D]: row j is h_i - h_j
    return torch.diag(variances.double()) + gaps @ gaps.T


def project_to_simplex(v: Tensor) -> Tensor:
    """The Euclidean projection of ``v`` ``[K]`` onto ``{a >= 0, sum a = 1}`` (sort and threshold)."""
    ordered = torch.sort(v, descending=True).values
    cumulative = ordered.cumsum(0) - 1.0
    ranks = torch.arange(1, len(v) + 1, dtype=v.dtype, device=v.device)
    kept = int((ordered - cumulative / ranks > 0).sum())  # the condition holds for a prefix of the sorted values
    return (v - cumulative[kept - 1] / kept).clamp(min=0)


def simplex_quadratic(p: Tensor, iterations: int = 20000, tolerance: float = 1e-12) -> Tensor:
    """``argmin alpha^T P alpha`` over the simplex, for a positive semi-definite ``P`` ``[K, K]``: accelerated projected
    gradient descent (FISTA) from the uniform weights with step ``1 / (2 lambda_max)``, until no weight moves by more
    than ``tolerance`` (float64; the official code calls cvxpy).
    """
    p = p.double()
    alpha = torch.full((len(p),), 1.0 / len(p), dtype=torch.float64, device=p.device)
    largest = float(torch.linalg.eigvalsh(p).max())
    if largest <= 0:
        return alpha
    step, point, momentum = 1.0 / (2.0 * largest), alpha, 1.0
    for _ in range(iterations):
        moved = project_to_simplex(point - step * 2.0 * (p @ point))
        if float((moved - alpha).abs().max()) <= tolerance:
            return moved
        following = (1.0 + (1.0 + 4.0 * momentum**2) ** 0.5) / 2.0
        point = moved + (momentum - 1.0) / following * (moved - alpha)
        alpha, momentum = moved, following
    return alpha


def head_weights(alpha: Tensor, threshold: float) -> Tensor:
    """The combination's weights: entries below ``threshold`` set to 0, the rest renormalised to sum 1 (the
    official code's 1e-3 and its division by their sum)."""
    kept = torch.where(alpha > threshold, alpha, torch.zeros_like(alpha))
    return kept / kept.sum() if kept.sum() > 0 else alpha
