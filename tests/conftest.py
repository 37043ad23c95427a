import csv
import json
import os
import signal
from pathlib import Path

import pytest
import torch
import yaml

os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# the test-only builders below (constant_logits_model) are named by dotted path in recipes: trust this module
os.environ.setdefault("FLRUN_TRUSTED_MODULES", "conftest")

ROOT = Path(__file__).resolve().parents[1]
# the commands' default output folder: a user's runs (the README's quickstart fills it before the tests run)
WORKING_RUNS = ROOT / "runs"

TINY = {
    "rounds": 4,
    "eval_every": 2,
    "data": {
        "class_path": "fl_lightning.data.DigitsData",
        "init_args": {
            "partitioner": {
                "class_path": "fl_lightning.data.DirichletPartitioner",
                "init_args": {"alpha": 0.5, "min_partition_size": 10},
            }
        },
    },
    "models": {"global": {"builder": "digits_mlp", "args": {"hidden": 32}}},
    "population": {"num_clients": 8, "tiers": [{"name": "all", "roles": ["global"]}]},
    "sampler": {"class_path": "fl_lightning.federation.sampling.UniformSampler", "init_args": {"fraction": 0.5}},
    "strategy": {"class_path": "fl_lightning.strategies.FedAvg"},
    "training": {
        "optimizer": {"class_path": "torch.optim.SGD", "init_args": {"lr": 0.1, "momentum": 0.9}},
        "local_steps": 5,
        "batch_size": 16,
    },
    "runtime": {"progress": False},
}


def runs_snapshot(root: Path = WORKING_RUNS) -> dict[str, tuple[int, int]] | None:
    """Every path under ``root`` with its modification time and size; None when ``root`` does not exist."""
    if not root.exists():
        return None
    entries = {".": (root.stat().st_mtime_ns, 0)}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            try:
                stat = os.lstat(path)
            except FileNotFoundError:  # removed while walked
                continue
            entries[os.path.relpath(path, root)] = (stat.st_mtime_ns, stat.st_size)
    return entries


def runs_changes(before, after) -> list[str]:
    """What differs between two :func:`runs_snapshot`s, as short phrases."""
    if before == after:
        return []
    if before is None or after is None:
        return ["the folder was " + ("created" if before is None else "removed")]
    added = sorted(set(after) - set(before))
    removed = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k] and k != ".")
    return [
        f"{what} {paths[:3]}" for what, paths in (("added", added), ("removed", removed), ("changed", changed)) if paths
    ]


@pytest.fixture(autouse=True)
def _working_directory_runs_untouched(request):
    """No test may write the working directory's runs/: the README's quickstart fills it before the tests run,
    and a test that used it would fail there or overwrite a user's run. Runs go under tmp_path."""
    before = runs_snapshot()
    yield
    changes = runs_changes(before, runs_snapshot())
    if changes:
        pytest.fail(
            f"{request.node.nodeid} wrote the working directory's runs/ ({'; '.join(changes)}); give its runs an "
            "output_dir under tmp_path.",
            pytrace=False,
        )


def pytest_sessionstart(session):
    session.config._runs_at_start = runs_snapshot()  # compared when the session ends


def pytest_sessionfinish(session, exitstatus):
    """Module- and session-scoped fixtures run outside the per-test check: the session as a whole is checked."""
    changes = runs_changes(getattr(session.config, "_runs_at_start", None), runs_snapshot())
    if changes and hasattr(session.config, "_runs_at_start"):
        print(f"\nthe tests wrote the working directory's runs/ ({'; '.join(changes)}); use tmp_path.")
        session.exitstatus = 1


@pytest.fixture(autouse=True)
def _restore_torch_settings():
    """Runs change torch's global thread count / determinism; put them back after each test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def terminal_sigint():
    """Ctrl-C raises KeyboardInterrupt in this process, as in a user's terminal: a pytest-xdist worker process
    ignores SIGINT, and a run keeps an ignored SIGINT ignored (as Python does for a background job)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def marked_beyond(first: int, cases: list, mark=pytest.mark.slow) -> list:
    """Cases of a parametrized end-to-end comparison: the first ``first`` in the default suite, the others under
    ``mark`` (the slow suite, which CI runs, or the full tier). Each case is a few seconds of runs of one more
    method through the same code path; the default suite keeps the path covered and stays within minutes."""
    marked = []
    for i, case in enumerate(cases):
        values = case if isinstance(case, tuple) else (case,)
        marked.append(case if i < first else pytest.param(*values, marks=mark))
    return marked


def write_recipe(path: Path, **changes) -> Path:
    recipe = json.loads(json.dumps(TINY))
    recipe.update(changes)
    path.write_text(yaml.safe_dump(recipe))
    return path


def run_cli(*argv: str) -> int:
    from fl_lightning.cli.commands import main

    return main(list(argv))


def read_summary(output_dir: Path) -> dict:
    return json.loads((output_dir / "summary.json").read_text())


def metrics_rows(output_dir: Path, *, timings: bool = False) -> list[dict[str, str]]:
    """The rows of a run's metrics.csv, each a dict of column -> text, without the wall-clock columns (``time/``:
    elapsed seconds differ between any two runs) unless ``timings``."""
    with open(output_dir / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    if timings:
        return rows
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


def fit_recipe(output_dir: Path, recipe: str | Path, *argv: str) -> Path:
    """Runs ``flrun fit`` on ``recipe`` (a file, or the name of one under recipes/) into ``output_dir``, with the
    progress display off and ``argv`` added; asserts that it succeeds and returns ``output_dir``."""
    config = Path(recipe) if isinstance(recipe, Path) else ROOT / "recipes" / f"{recipe.removesuffix('.yaml')}.yaml"
    argv = ("--config", str(config), "--output_dir", str(output_dir), "--runtime.progress", "false", *argv)
    code = run_cli("fit", *argv)
    assert code == 0, f"flrun fit {' '.join(argv)} exited with {code}"
    return output_dir


def assert_same(a, b, where: str = "") -> None:
    """Nested states equal bit for bit: tensors of the same dtype, shape and values; dicts with the same keys;
    lists and tuples of the same length; plain values equal."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


# what a stopped and resumed run's last checkpoint holds as the uninterrupted run's does (its elapsed time aside)
RESUMED_STATE = (
    "rounds_done",
    "strategy",
    "shared_optimizers",
    "ledger",
    "events",
    "ranks",
    "best",
    "last_eval",
    "rng",
)


def assert_resumed_equals(resumed_dir: Path, uninterrupted_dir: Path) -> None:
    """A run stopped and resumed into ``resumed_dir`` equals the uninterrupted one: every metrics.csv row, value for
    value (the wall-clock columns aside); summary.json's final and best metrics, traffic, faults and local trainings;
    and the last checkpoint's server state (the models the strategy holds), optimizers, client states, traffic
    ledger, generators and history (without elapsed seconds)."""
    from fl_lightning.run.checkpoint import load_checkpoint
    from fl_lightning.run.client_store import load_client_states

    resumed, whole = metrics_rows(resumed_dir), metrics_rows(uninterrupted_dir)
    assert len(resumed) == len(whole) > 0
    for got, want in zip(resumed, whole):
        assert got == want, f"round {want.get('round')}: {set(got.items()) ^ set(want.items())}"
    first, second = read_summary(uninterrupted_dir), read_summary(resumed_dir)
    for key in ("final", "best", "best_round", "comm", "faults", "ranks", "rounds", "complete", "per_client_acc"):
        assert first.get(key) == second.get(key), key
    a = load_checkpoint(uninterrupted_dir / "checkpoints" / "last.ckpt")
    b = load_checkpoint(resumed_dir / "checkpoints" / "last.ckpt")
    for key in (*RESUMED_STATE, "schedule", "train_flops"):
        assert_same(a.get(key), b.get(key), key)

    def history(state):
        return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in state["history"]]

    assert_same(history(a), history(b), "history")
    assert_same(load_client_states(a), load_client_states(b), "client states")


def check_resume(tmp_path: Path, recipe: str | Path, *argv: str, stop_after: int = 1) -> Path:
    """Fits ``recipe`` uninterrupted into ``tmp_path/full`` and, into ``tmp_path/cut``, stopped after round
    ``stop_after`` (--stop_after) then resumed (--resume auto); asserts the two are equal
    (:func:`assert_resumed_equals`) and returns the uninterrupted run's folder."""
    full = fit_recipe(tmp_path / "full", recipe, *argv)
    fit_recipe(tmp_path / "cut", recipe, *argv, "--stop_after", str(stop_after))
    assert read_summary(tmp_path / "cut")["rounds"] == stop_after  # really stopped early
    fit_recipe(tmp_path / "cut", recipe, *argv, "--resume", "auto")
    assert_resumed_equals(tmp_path / "cut", full)
    return full


def constant_logits_model(num_classes: int = 10, in_channels: int = 1):
    """A model whose logits are its head bias for every input (zero weights), for hand-computed checks."""
    from torch import nn

    from fl_lightning.models import FeatureClassifier

    features = nn.Sequential(nn.Flatten(), nn.Linear(64, 4))
    head = nn.Linear(4, num_classes)
    for layer in (features[1], head):
        nn.init.zeros_(layer.weight)
        nn.init.zeros_(layer.bias)
    with torch.no_grad():
        head.bias.copy_(torch.arange(num_classes, dtype=torch.float32))
    return FeatureClassifier(features, head, 4, num_classes)


def method_env(strategy, models, tiers, num_clients=4, training=None, data=None, seed=0, rounds=1):
    """Sets up a strategy on digits without the orchestrator, for unit tests of its hooks."""
    from fl_lightning.client import LocalLoop, LocalTraining
    from fl_lightning.data import DigitsData
    from fl_lightning.distributed.fabric import fabric_class
    from fl_lightning.federation.population import Population
    from fl_lightning.strategies import ServerContext
    from fl_lightning.strategies.base import roles_to_build

    data = data or DigitsData()
    population = Population(num_clients=num_clients, tiers=tiers)
    clients = population.build(seed)
    data.setup(num_clients, seed)
    loop = LocalLoop(fabric_class()(accelerator="cpu", devices=1), training or LocalTraining(), rounds)
    roles = roles_to_build(population.roles(), strategy)
    loop.build_slots(models, roles, seed, num_classes=10, in_channels=1)
    server = ServerContext(clients, roles, data, rounds, seed, loop)
    strategy.setup(server)
    return server


def _phase(strategy, name):
    from fl_lightning.strategies.base import phase_table

    phases = {phase.name: phase for phase in phase_table(strategy)}
    assert name in phases, f"{strategy.name} has phases {list(phases)}, not {name!r}"
    return phases[name]


def phase_tasks(strategy, rnd, clients, phase="train"):
    """The tasks of ``phase`` as the orchestrator makes them: configured, then stamped with the phase's name."""
    tasks = _phase(strategy, phase).configure(rnd, clients)
    for task in tasks:
        task.phase = phase
    return tasks


def aggregate_phase(strategy, rnd, updates, phase="train"):
    """The server's aggregation of ``phase`` on ``updates`` (a list), as the orchestrator calls it."""
    aggregate = _phase(strategy, phase).aggregate
    assert aggregate is not None, f"{strategy.name}'s phase {phase!r} has no aggregation"
    return aggregate(rnd, iter(updates))


def client_update(strategy, server, task, state=None):
    """A client's work on ``task`` by its phase's hook, as the orchestrator dispatches it."""
    from fl_lightning.client import ClientContext

    ctx = ClientContext(task.client, task.round, server._loop, server.data, state if state is not None else {}, 0)
    return _phase(strategy, task.phase).client_update(task, ctx)


@pytest.fixture(scope="session")
def slurm():
    """A real one-node Slurm cluster on 127.0.0.1 (``local_slurm.py``), or the test skipped saying why it cannot
    start here."""
    from local_slurm import LocalSlurm, why_not

    reason = why_not()
    if reason is not None:
        pytest.skip(reason)
    with LocalSlurm() as cluster:
        yield cluster
