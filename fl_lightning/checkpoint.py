"""Atomic checkpoint files: a run killed mid-write never loses its last good checkpoint."""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ConfigError


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(
            f"checkpoint {path} does not exist; pass --resume auto to resume from the run's output_dir "
            "or the path of an existing .ckpt file."
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as err:  # a truncated or foreign file
        raise ConfigError(
            f"checkpoint {path} cannot be read ({err}); it may be incomplete, use an earlier one."
        ) from None


def rng_state() -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
