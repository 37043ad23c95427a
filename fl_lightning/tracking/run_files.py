"""The run directory: config.yaml, metrics.csv, summary.json, partition.json and checkpoints/."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Any


class RunFiles:
    """Paths and writers of one run's output directory."""

    def __init__(self, output_dir: str | Path):
        self.root = Path(output_dir)
        self.root.mkdir(parents=True, exist_ok=True)
        self.config = self.root / "config.yaml"
        self.metrics = self.root / "metrics.csv"
        self.summary = self.root / "summary.json"
        self.partition = self.root / "partition.json"
        self.checkpoints = self.root / "checkpoints"
        self.last_checkpoint = self.checkpoints / "last.ckpt"

    def write_metrics(self, rows: list[dict[str, Any]]) -> None:
        """Rewrites metrics.csv from the history (one row per evaluation round); columns are the union."""
        columns: dict[str, None] = {"round": None}
        for row in rows:
            columns.update(dict.fromkeys(row))
        tmp = self.metrics.with_suffix(".csv.tmp")
        with tmp.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(columns))
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(self.metrics)

    def write_json(self, path: Path, data: dict[str, Any]) -> None:
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(_finite(data), indent=2, sort_keys=False) + "\n")
        tmp.replace(path)


def _finite(value: Any) -> Any:
    """JSON has no NaN / inf: write them as null rather than as invalid JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value
