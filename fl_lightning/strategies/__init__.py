"""Federated strategies, one algorithm per file."""

from .base import ServerContext, Strategy
from .fedavg import FedAvg
from .fedhe import FedHe

__all__ = ["FedAvg", "FedHe", "ServerContext", "Strategy"]
