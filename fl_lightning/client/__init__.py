"""Client side: the LightningModule wrapper, the Fabric loop and the per-client context."""

from .context import ClientContext, derive_seed
from .loop import LocalLoop, LocalTraining, ModelSlot, batch_stream

__all__ = ["ClientContext", "ClientModule", "LocalLoop", "LocalTraining", "ModelSlot", "batch_stream", "derive_seed"]


def __getattr__(name: str):
    # ClientModule imports lightning (seconds); import it when first used, not when the CLI builds its parser
    if name == "ClientModule":
        from .module import ClientModule

        return ClientModule
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
