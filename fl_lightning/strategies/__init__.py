"""Federated strategies, one algorithm per file."""

from .base import ServerContext, Strategy
from .fedadam import FedAdam
from .fedavg import FedAvg
from .fedhe import FedHe
from .merged_codist import MergedCodist
from .ondevice_kd import OnDeviceKD
from .periodic_codist import PeriodicCodist

__all__ = ["FedAdam", "FedAvg", "FedHe", "MergedCodist", "OnDeviceKD", "PeriodicCodist", "ServerContext", "Strategy"]
