"""Federated strategies, one algorithm per file."""

from .base import ServerContext, Strategy
from .ccvr import CCVR
from .codistillation import Codistillation
from .dsfl import DSFL
from .fd import FD
from .fedadam import FedAdam
from .fedavg import FedAvg
from .feddf import FedDF
from .fedetf import FedETF
from .fedgems import FedGEMS
from .fedgen import FedGen
from .fedgh import FedGH
from .fedgkt import FedGKT
from .fedhe import FedHe
from .fedhkd import FedHKD
from .fedkd import FedKD
from .fedktl import FedKTL
from .fedl2g import FedL2G
from .fedmd import FedMD
from .fedmrl import FedMRL
from .fednh import FedNH
from .fedntd import FedNTD
from .fedpac import FedPAC
from .fedpcl import FedPCL
from .fedproto import FedProto
from .fedsa import FedSA
from .fedtgp import FedTGP
from .felo import Felo
from .fml import FML
from .fpl import FPL
from .heterofl import HeteroFL
from .lg_fedavg import LGFedAvg
from .merged_codist import MergedCodist
from .moon import MOON
from .ondevice_kd import OnDeviceKD
from .periodic_codist import PeriodicCodist
from .standalone import Standalone
from .velo import Velo

__all__ = [
    "CCVR",
    "DSFL",
    "FD",
    "FML",
    "FPL",
    "MOON",
    "Codistillation",
    "FedAdam",
    "FedAvg",
    "FedDF",
    "FedETF",
    "FedGEMS",
    "FedGen",
    "FedGH",
    "FedGKT",
    "FedHe",
    "FedHKD",
    "FedKD",
    "FedKTL",
    "FedL2G",
    "FedMD",
    "FedMRL",
    "FedNH",
    "FedNTD",
    "FedPAC",
    "FedPCL",
    "FedProto",
    "FedSA",
    "FedTGP",
    "Felo",
    "HeteroFL",
    "LGFedAvg",
    "MergedCodist",
    "OnDeviceKD",
    "PeriodicCodist",
    "ServerContext",
    "Standalone",
    "Strategy",
    "Velo",
]
