"""CCVR's math: per-class feature moments on a client, their pooling on the server, and virtual features drawn
from the pooled Gaussians (Luo et al., "No Fear of Heterogeneity: Classifier Calibration for Federated
Learning with Non-IID Data", NeurIPS 2021)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def class_moments(features: Tensor, labels: Tensor, num_classes: int) -> tuple[Tensor, Tensor, Tensor]:
    """Per class the count ``[C]``, the mean ``[C, D]`` and the unbiased covariance ``[C, D, D]`` (divided by
    ``N_c - 1``, the paper's; zero for a class seen once or never) of ``features`` ``[N, D]``, in float64."""
    f = features.double()
    onehot = F.one_hot(labels, num_classes).double()  # [N, C]
    counts = onehot.sum(0)
    means = onehot.T @ f / counts.clamp(min=1)[:, None]
    centred = f - means[labels]
    scatter = torch.einsum("nc,nd,ne->cde", onehot, centred, centred)
    covs = scatter / (counts - 1).clamp(min=1)[:, None, None]
    return counts, means, covs


def pooled_moments(counts: Tensor, means: Tensor, covs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The moments of the union of K clients' features from theirs, per class (CCVR's server step).

    ``counts`` ``[K, C]``, ``means`` ``[K, C, D]``, ``covs`` ``[K, C, D, D]`` (unbiased) give ``N_c = sum_k N_ck``,
    ``mu_c = sum_k N_ck / N_c mu_ck`` and ``Sigma_c = sum_k (N_ck - 1) / (N_c - 1) Sigma_ck + sum_k N_ck / (N_c - 1)
    mu_ck mu_ck^T - N_c / (N_c - 1) mu_c mu_c^T``: exactly the unbiased covariance of the pooled features. A
    class with fewer than 2 features gets a zero covariance.
    """
    n = counts.sum(0)  # [C]
    mu = torch.einsum("kc,kcd->cd", counts, means) / n.clamp(min=1)[:, None]
    denominator = (n - 1).clamp(min=1)[:, None, None]
    within = torch.einsum("kc,kcde->cde", (counts - 1).clamp(min=0), covs)
    between = torch.einsum("kc,kcd,kce->cde", counts, means, means)
    sigma = (within + between - n[:, None, None] * mu[:, :, None] * mu[:, None, :]) / denominator
    sigma = torch.where((n > 1)[:, None, None], sigma, torch.zeros_like(sigma))
    return n, mu, sigma


def virtual_features(
    counts: Tensor, means: Tensor, covs: Tensor, per_class: int, generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """``per_class`` draws from ``N(mu_c, Sigma_c)`` for every class with at least 2 features, and their labels.

    A draw is ``mu_c + L z``, ``z ~ N(0, I)`` from ``generator``, ``L = V sqrt(max(lambda, 0))`` from the eigen
    decomposition of ``Sigma_c``: the pooled covariance is positive semi-definite up to rounding (singular when
    a class has fewer features than dimensions), which a Cholesky factor would refuse. Float32 features.
    """
    rows, labels = [], []
    for c in torch.nonzero(counts > 1).flatten().tolist():
        eigenvalues, eigenvectors = torch.linalg.eigh(covs[c].double())
        factor = eigenvectors * eigenvalues.clamp(min=0).sqrt()
        z = torch.randn(per_class, means.shape[1], generator=generator, dtype=torch.float64).to(means.device)
        rows.append(means[c].double() + z @ factor.T)
        labels.append(torch.full((per_class,), c, dtype=torch.long))
    if not rows:
        return torch.zeros(0, means.shape[1]), torch.zeros(0, dtype=torch.long)
    return torch.cat(rows).float(), torch.cat(labels)
