import json
import os
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "rounds": 4,
    "eval_every": 2,
    "data": {"class_path": "fl_lightning.data.DigitsData",
             "init_args": {"partitioner": {"class_path": "fl_lightning.data.DirichletPartitioner",
                                           "init_args": {"alpha": 0.5, "min_partition_size": 10}}}},
    "models": {"global": {"builder": "digits_mlp", "args": {"hidden": 32}}},
    "population": {"num_clients": 8, "tiers": [{"name": "all", "roles": ["global"]}]},
    "sampler": {"class_path": "fl_lightning.sampling.UniformSampler", "init_args": {"fraction": 0.5}},
    "strategy": {"class_path": "fl_lightning.strategies.FedAvg"},
    "training": {"optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.9}},
                 "local_steps": 5, "batch_size": 16},
    "runtime": {"progress": False},
}


@pytest.fixture(autouse=True)
def _restore_torch_settings():
    """Runs change torch's global thread count / determinism; put them back after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(False)


def write_recipe(path: Path, **changes) -> Path:
    recipe = json.loads(json.dumps(TINY))
    recipe.update(changes)
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_cli(*argv: str) -> int:
    from fl_lightning.cli import main

    return main(list(argv))


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())
