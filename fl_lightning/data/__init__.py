"""Federated data: tensors in memory, partitioners and client index sets."""

from .digits import DigitsData
from .federated import ClientData, DataArrays, FederatedData
from .partition import DirichletPartitioner, IidPartitioner, NaturalIdPartitioner, PathologicalPartitioner, Partitioner

__all__ = [
    "ClientData",
    "DataArrays",
    "DigitsData",
    "DirichletPartitioner",
    "FederatedData",
    "IidPartitioner",
    "NaturalIdPartitioner",
    "Partitioner",
    "PathologicalPartitioner",
]
