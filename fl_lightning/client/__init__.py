"""Client side: the module wrapper of a model role, the Fabric loop and the per-client context."""

from .context import ClientContext, derive_seed
from .loop import LocalLoop, LocalTraining, ModelSlot, batch_stream
from .module import ClientModule

__all__ = ["ClientContext", "ClientModule", "LocalLoop", "LocalTraining", "ModelSlot", "batch_stream", "derive_seed"]
