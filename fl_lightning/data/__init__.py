"""Federated data: tensors in memory, partitioners and client index sets, the papers' benchmarks, and data sets
read from a user's own files (an .npz, a CSV or Parquet
table, a folder of images per class, a Hugging Face data set)."""

from .digits import DigitsData
from .federated import ClientData, DataArrays, FederatedData
from .femnist import FemnistData
from .hub import HubData
from .image_folder import ImageFolderData
from .imdb import ImdbData
from .npz import NpzData
from .partition import (
    DirichletPartitioner,
    IidPartitioner,
    NaturalIdPartitioner,
    Partitioner,
    PathologicalPartitioner,
    SampledPartitioner,
)
from .speech import SpeechCommandsData
from .table import TableData
from .tff import FedCifar100Data, StackOverflowData
from .vision import Cifar10Data, Cifar100Data, Cinic10Data, MnistData

__all__ = [
    "Cifar10Data",
    "Cifar100Data",
    "Cinic10Data",
    "ClientData",
    "DataArrays",
    "DigitsData",
    "DirichletPartitioner",
    "FedCifar100Data",
    "FederatedData",
    "FemnistData",
    "HubData",
    "IidPartitioner",
    "ImageFolderData",
    "ImdbData",
    "MnistData",
    "NaturalIdPartitioner",
    "NpzData",
    "Partitioner",
    "PathologicalPartitioner",
    "SampledPartitioner",
    "SpeechCommandsData",
    "StackOverflowData",
    "TableData",
]
