"""Batch augmentation on tensors (no PIL, no per-image Python loop)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CropFlip:
    """Zero-pad by ``padding``, crop back to the input size at a random offset, flip horizontally with
    probability 0.5 (paper 001's CIFAR preprocessing), in two parts: ``draw`` takes the random numbers from
    a client's generator, ``apply`` transforms a batch. The batched executor draws per client and applies
    once to all clients' images; ``draw`` then ``apply`` equals the one-call form bit for bit.

    Attributes:
        per_example: a fresh offset and flip per image (torchvision); ``False`` draws one per batch
            (FedJAX's CIFAR-100 pipeline used by paper 002).
    """

    padding: int = 4
    flip: bool = True
    per_example: bool = True

    def draw(self, batch: int, generator: torch.Generator) -> Tensor:
        """``[batch, 3]`` (row offset, column offset, flip) on the generator's device."""
        n = batch if self.per_example else 1
        offsets = torch.randint(0, 2 * self.padding + 1, (2, n), generator=generator)
        flips = torch.rand(n, generator=generator) < 0.5 if self.flip else torch.zeros(n, dtype=torch.bool)
        return torch.stack([offsets[0], offsets[1], flips.long()], 1).expand(batch, 3)

    def apply(self, x: Tensor, draws: Tensor) -> Tensor:
        """``x`` ``[B, C, H, W]`` (already normalised, so the zero padding is the mean colour) cropped and
        flipped as ``draws`` ``[B, 3]`` say."""
        b, _, h, w = x.shape
        draws = to_device(draws, x.device)
        p = self.padding
        padded = torch.nn.functional.pad(x, (p, p, p, p))
        rows = draws[:, 0][:, None] + torch.arange(h, device=x.device)  # [B, H]
        cols = draws[:, 1][:, None] + torch.arange(w, device=x.device)  # [B, W]
        cols = torch.where(draws[:, 2].bool()[:, None], cols.flip(1), cols)  # flipping = reading columns backwards
        batch = torch.arange(b, device=x.device)[:, None, None]
        return padded[batch, :, rows[:, :, None], cols[:, None, :]].permute(0, 3, 1, 2).contiguous()

    def __call__(self, x: Tensor, generator: torch.Generator) -> Tensor:
        return self.apply(x, self.draw(len(x), generator))


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """``t`` (drawn on the CPU) on ``device``. To a GPU through pinned memory and without blocking: a copy
    from ordinary memory makes the host wait for the GPU's queue, once per training step here."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def random_crop_flip(
    x: Tensor, generator: torch.Generator, padding: int = 4, flip: bool = True, per_example: bool = True
) -> Tensor:
    """:class:`CropFlip` in one call."""
    return CropFlip(padding, flip, per_example)(x, generator)


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
