"""Pure, tested building blocks that strategies compose (averaging, banks, distillation losses)."""

from .averaging import WeightedAverage, weighted_average

__all__ = ["WeightedAverage", "weighted_average"]
