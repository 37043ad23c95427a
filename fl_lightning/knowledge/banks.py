"""The server's per-class averages of what clients upload (FedHe, Felo / Velo, FedProto)."""

from __future__ import annotations

import torch
from torch import Tensor

from .class_stats import ClassStatistics


class ClassBank:
    """The server's store of per-class vectors (FedHe eq. 9-10, Felo's class averages).

    Storing every received vector and averaging them equals keeping a per-class sum and count, which
    is what is kept (float64). ``mean()`` is ``S_c / n_c`` and ``available`` marks classes with n_c > 0.
    """

    def __init__(self, num_classes: int, dim: int, device: torch.device | str = "cpu"):
        self.sums = torch.zeros(num_classes, dim, dtype=torch.float64, device=device)
        self.counts = torch.zeros(num_classes, dtype=torch.float64, device=device)

    def add(self, vectors: Tensor, present: Tensor, weights: Tensor | None = None) -> None:
        """Adds one upload: ``vectors`` ``[C, D]`` for the classes where ``present`` ``[C]`` is true."""
        w = present.to(torch.float64) if weights is None else weights.to(torch.float64) * present
        self.sums += vectors.to(torch.float64) * w[:, None]
        self.counts += w

    def add_statistics(self, stats: ClassStatistics, name: str) -> None:
        """Adds the ``name`` vectors of one client's upload, padded or compact."""
        device = self.sums.device  # the bank stays where it was made; uploads come from the clients' device
        rows, present = stats.vectors[name].to(device), stats.present.to(device)
        labels = stats.labels.to(device)[present].long()
        vectors = torch.zeros(self.sums.shape, dtype=rows.dtype, device=rows.device)
        vectors[labels] = rows[present]
        mask = torch.zeros(len(self.counts), dtype=torch.bool, device=rows.device)
        mask[labels] = True
        self.add(vectors, mask)

    @property
    def available(self) -> Tensor:
        return self.counts > 0

    def mean(self) -> Tensor:
        """``[C, D]`` float32 class averages; zeros where no class vector was received."""
        return (self.sums / self.counts.clamp(min=1e-12)[:, None]).float() * self.available[:, None]

    def collapse(self) -> None:
        """Keeps the averages but weighs them as one upload (FedHe's code resets every 10N iterations)."""
        self.sums = self.mean().double()
        self.counts = self.available.double()

    def state_dict(self) -> dict[str, Tensor]:
        return {"sums": self.sums, "counts": self.counts}

    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        self.sums, self.counts = state["sums"], state["counts"]
