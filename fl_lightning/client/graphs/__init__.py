"""The sequential loop's local steps replayed as CUDA graphs (``runtime.cuda_graphs``, experimental):
``replay`` decides when a step may be replayed and runs it, ``capture`` records one step (and holds the
CUDA backend), ``optimizers`` the optimizers a replay supports, ``keys`` what a replay depends on, and
``trace`` checks op by op what a graph would get wrong (the CPU stand-in for CUDA graphs).
"""

from .capture import CudaGraphs
from .optimizers import prepare_optimizer
from .replay import StepGraphs, backend_for

__all__ = ["CudaGraphs", "StepGraphs", "backend_for", "prepare_optimizer"]
