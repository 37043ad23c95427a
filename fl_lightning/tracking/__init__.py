"""Run files (always), the loggers (the CSV file always, W&B and TensorBoard when asked) and the progress bar."""

from .loggers import CsvLogger, RunLogger, TensorBoardLogger, WandbLogger, resolve_loggers
from .progress import RoundProgress
from .run_files import RunFiles, RunLock

__all__ = [
    "CsvLogger",
    "RoundProgress",
    "RunFiles",
    "RunLock",
    "RunLogger",
    "TensorBoardLogger",
    "WandbLogger",
    "resolve_loggers",
]
