"""Federated strategies, one algorithm per file."""

from .base import ServerContext, Strategy
from .fedavg import FedAvg

__all__ = ["FedAvg", "ServerContext", "Strategy"]
