"""Run files (always), W&B and TensorBoard loggers (when asked) and the progress bar."""

from .loggers import RunLogger, TensorBoardLogger, WandbLogger, resolve_loggers
from .progress import RoundProgress
from .run_files import RunFiles, RunLock

__all__ = ["RoundProgress", "RunFiles", "RunLock", "RunLogger", "TensorBoardLogger", "WandbLogger", "resolve_loggers"]
