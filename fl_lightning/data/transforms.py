"""Batch augmentation on tensors (no PIL, no per-image Python loop)."""

from __future__ import annotations

import torch
from torch import Tensor


def random_crop_flip(
    x: Tensor, generator: torch.Generator, padding: int = 4, flip: bool = True, per_example: bool = True
) -> Tensor:
    """Zero-pad by ``padding``, crop back to the input size at a random offset, flip horizontally with
    probability 0.5 (paper 001's CIFAR preprocessing).

    Args:
        x: ``[B, C, H, W]`` images (already normalised, so the zero padding is the mean colour).
        per_example: a fresh offset and flip per image (torchvision); ``False`` draws one per batch
            (FedJAX's CIFAR-100 pipeline used by paper 002).
    """
    b, _, h, w = x.shape
    n = b if per_example else 1
    offsets = torch.randint(0, 2 * padding + 1, (2, n), generator=generator).to(x.device)
    flips = (
        torch.rand(n, generator=generator).to(x.device) < 0.5
        if flip
        else torch.zeros(n, dtype=torch.bool, device=x.device)
    )
    if not per_example:
        offsets, flips = offsets.expand(2, b), flips.expand(b)
    padded = torch.nn.functional.pad(x, (padding, padding, padding, padding))
    rows = offsets[0][:, None] + torch.arange(h, device=x.device)  # [B, H]
    cols = offsets[1][:, None] + torch.arange(w, device=x.device)  # [B, W]
    cols = torch.where(flips[:, None], cols.flip(1), cols)  # flipping = reading columns backwards
    batch = torch.arange(b, device=x.device)[:, None, None]
    return padded[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()


def random_flips(x: Tensor, generator: torch.Generator, horizontal: bool = True, vertical: bool = True) -> Tensor:
    """Flips each image horizontally and, independently, vertically, each with probability 0.5.

    Args:
        x: ``[B, C, H, W]`` images.
        generator: the random stream of the draws (two per image, horizontal first).
    """
    b = x.shape[0]
    draws = torch.rand(2, b, generator=generator).to(x.device) < 0.5
    draws[0] &= horizontal
    draws[1] &= vertical
    out = torch.where(draws[0][:, None, None, None], x.flip(3), x)
    return torch.where(draws[1][:, None, None, None], out.flip(2), out)
