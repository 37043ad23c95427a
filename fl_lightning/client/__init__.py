"""Client side: the module wrapper of a model role (or of a user's own LightningModule), the Fabric loop with
one model instance per role, the per-client context a strategy's ``client_update`` sees, models trained
together, evaluation of global and personal models, and two ways of running many clients' fits faster:
``batched`` (clients of one architecture as one vmapped computation) and ``graphs`` (the sequential loop's
steps replayed as CUDA graphs).

May import ``data``, ``models``, ``distributed`` and ``federation``; never ``strategies`` or ``run``.
"""

from .batches import batch_stream
from .context import ClientContext, derive_seed
from .loop import LocalLoop, LocalTraining
from .module import ClientModule
from .steps import ModelSlot, vmappable

__all__ = [
    "ClientContext",
    "ClientModule",
    "LocalLoop",
    "LocalTraining",
    "ModelSlot",
    "batch_stream",
    "derive_seed",
    "vmappable",
]
