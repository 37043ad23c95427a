"""Per-client state: written per change, spilled beyond a memory budget, exact across kills and resumes."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, marked_beyond, read_summary, run_cli, write_recipe

from fl_lightning.federation.errors import ConfigError
from fl_lightning.run.checkpoint import load_checkpoint, save_checkpoint
from fl_lightning.run.client_store import ClientStateStore, load_client_states

STATE_BYTES = 4 * 1000  # one client's state below: 1,000 float32 numbers


def _state(value: float) -> dict:
    return {"weights": {"w": torch.full((1000,), value)}, "round": int(value)}


def _train(store: ClientStateStore, client_id: int, value: float) -> None:
    state = store.open(client_id)
    state.update(_state(value))
    store.close(client_id, state)


def _checkpoint(store: ClientStateStore, path: Path) -> None:
    save_checkpoint(path, {"client_states": store.manifest()})
    store.saved()


def _files(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir()} if directory.is_dir() else set()


def _named(checkpoint: Path) -> set[str]:
    """The client files a checkpoint names."""
    manifest = load_checkpoint(checkpoint)["client_states"]
    triples = zip(manifest["ids"].tolist(), manifest["writers"].tolist(), manifest["numbers"].tolist())
    return {f"{c}-{w:016x}-{n}.pt" for c, w, n in triples}


def test_a_checkpoint_writes_only_the_clients_that_changed_and_names_the_rest(tmp_path):
    ckpt = tmp_path / "checkpoints/last.ckpt"
    store = ClientStateStore(tmp_path / "checkpoints/clients")
    for client_id in range(20):
        _train(store, client_id, client_id)
    _checkpoint(store, ckpt)
    first = store.bytes_written
    assert 20 * STATE_BYTES < first < 20 * (STATE_BYTES + 8000)  # every state once (plus torch.save's zip framing)
    size = ckpt.stat().st_size
    for client_id in (3, 7):
        _train(store, client_id, 100 + client_id)
    _checkpoint(store, ckpt)
    assert store.bytes_written - first == first // 10  # 2 of 20 clients changed: 2 files, not 20
    assert ckpt.stat().st_size == size  # the manifest lists the same 20 clients: 56 bytes each
    states = load_client_states(load_checkpoint(ckpt))
    assert sorted(states) == list(range(20))
    assert torch.equal(states[7]["weights"]["w"], torch.full((1000,), 107.0)) and states[7]["round"] == 107
    assert torch.equal(states[8]["weights"]["w"], torch.full((1000,), 8.0))


def test_superseded_files_go_once_neither_last_nor_previous_names_them(tmp_path):
    ckpt = tmp_path / "checkpoints/last.ckpt"
    directory = tmp_path / "checkpoints/clients"
    store = ClientStateStore(directory)
    _train(store, 1, 1.0)
    _train(store, 2, 2.0)
    _checkpoint(store, ckpt)
    original = _named(ckpt)
    for value in (10.0, 20.0, 30.0):
        _train(store, 1, value)
        _checkpoint(store, ckpt)
        named = _named(ckpt) | _named(ckpt.with_name("previous.ckpt"))
        assert _files(directory) == named  # exactly what the two kept checkpoints name
    assert not original & _files(directory) - _named(ckpt)  # client 1's first file is gone
    _train(store, 2, 0.0)
    store.close(2, {})  # an emptied state removes the client
    _checkpoint(store, ckpt)
    assert 2 not in store and load_client_states(load_checkpoint(ckpt)).keys() == {1}


def test_beyond_the_budget_states_wait_in_files_and_come_back_exactly(tmp_path):
    directory = tmp_path / "checkpoints/clients"
    store = ClientStateStore(directory, memory_budget_mb=2.5 * STATE_BYTES / 2**20)
    for client_id in range(5):
        _train(store, client_id, client_id + 0.5)
    assert len(store._memory) == 2 and len(_files(directory)) == 3  # the 3 least recent were written
    assert torch.equal(store.get(0)["weights"]["w"], torch.full((1000,), 0.5))
    _train(store, 0, 9.0)  # spilled again before any checkpoint: its earlier file is named by none, so it goes
    assert len(_files(directory)) == 4 and sorted(store) == [0, 1, 2, 3, 4]
    ckpt = tmp_path / "checkpoints/last.ckpt"
    _checkpoint(store, ckpt)
    states = load_client_states(load_checkpoint(ckpt))
    assert [float(states[i]["weights"]["w"][0]) for i in range(5)] == [9.0, 1.5, 2.5, 3.5, 4.5]
    assert _files(directory) == _named(ckpt)


def test_a_state_read_on_an_accelerator_puts_accelerator_tensors_on_this_ranks_device(tmp_path, monkeypatch):
    """Under several ranks on GPUs rank 0 writes every client's file from its cuda:0; rank 1 reading one must
    get the tensors on its cuda:1, and a tensor saved from CPU (an Adam step count) back on CPU. The mapping is
    checked on the storages torch.load hands it (no GPU here); a CPU file still round-trips through it."""
    from fl_lightning.run import client_store

    moved = []
    monkeypatch.setattr(client_store, "default_restore_location", lambda s, where: moved.append(where) or s)
    store = ClientStateStore(tmp_path / "clients", memory_budget_mb=0, device="cuda:1")
    storage = torch.ones(2).untyped_storage()
    assert store.map_location(storage, "cpu") is storage and moved == []
    assert store.map_location(storage, "cuda:0") is storage and moved == ["cuda:1"]
    _train(store, 7, 2.5)  # budget 0: written to a file at once, read back through the mapping
    assert torch.equal(store.get(7)["weights"]["w"], torch.full((1000,), 2.5)) and moved == ["cuda:1"]


def test_a_damaged_or_missing_client_file_is_refused_in_one_sentence(tmp_path):
    ckpt = tmp_path / "checkpoints/last.ckpt"
    store = ClientStateStore(tmp_path / "checkpoints/clients", memory_budget_mb=0)
    _train(store, 4, 4.0)
    _train(store, 5, 5.0)
    _checkpoint(store, ckpt)
    four, five = sorted(_named(ckpt))
    path = tmp_path / "checkpoints/clients" / four
    good = path.read_bytes()
    data = bytearray(good)
    data[-200] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ConfigError, match=r"client state file .*4-.* is damaged .* resume from .*previous\.ckpt"):
        store.get(4)
    (tmp_path / "checkpoints/clients" / five).unlink()
    fresh = ClientStateStore(tmp_path / "checkpoints/clients")
    # a resume checks every file it names at once, not when the client is next read
    with pytest.raises(ConfigError, match=r"4-.* is damaged"):
        fresh.restore(load_checkpoint(ckpt)["client_states"], str(ckpt))
    path.write_bytes(good)
    with pytest.raises(ConfigError, match=r"5-.* named by the checkpoint, is missing"):
        fresh.restore(load_checkpoint(ckpt)["client_states"], str(ckpt))


def test_state_that_would_not_load_safely_is_refused_before_its_file_is_written(tmp_path):
    store = ClientStateStore(tmp_path / "clients", memory_budget_mb=0)
    with pytest.raises(TypeError, match=r"client 3's state\['weights'\] is a builtins.object"):
        store.close(3, {"weights": object()})
    assert _files(tmp_path / "clients") == set()


def test_a_checkpoint_of_the_older_format_holding_every_state_is_taken_whole(tmp_path):
    store = ClientStateStore(tmp_path / "checkpoints/clients")
    store.restore({3: _state(3.0), 8: _state(8.0)})
    assert sorted(store) == [3, 8] and store.get(8)["round"] == 8
    _checkpoint(store, tmp_path / "checkpoints/last.ckpt")
    assert len(_files(tmp_path / "checkpoints/clients")) == 2  # written to files at the first checkpoint


# ---------------------------------------------------------------------------------- whole runs

POPULATION = 1000


def _fedhe_recipe(path: Path, **changes) -> Path:
    """FedHe with per-client Adam over 1,000 clients drawing 20 digits each; 10 clients a round."""
    partitioner = {"class_path": "fl_lightning.data.SampledPartitioner", "init_args": {"examples_per_client": 20}}
    return write_recipe(
        path,
        rounds=4,
        eval_every=4,
        data={"class_path": "fl_lightning.data.DigitsData", "init_args": {"partitioner": partitioner}},
        models={"mlp": {"builder": "digits_mlp", "args": {"hidden": 16}}},
        population={"num_clients": POPULATION, "tiers": [{"name": "mlp", "roles": ["mlp"]}]},
        sampler={"class_path": "fl_lightning.federation.sampling.UniformSampler", "init_args": {"num_per_round": 10}},
        strategy={"class_path": "fl_lightning.strategies.FedHe"},
        training={
            "optimizer": {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.003}},
            "optimizer_state": "per_client",
            "local_steps": 2,
            "batch_size": 10,
        },
        evaluation={"untrained": "skip"},
        **changes,
    )


# Runs fl_lightning's CLI and SIGKILLs itself in the middle of writing client file number N (half of it written).
_DIES_WHILE_WRITING = """
import os, signal, sys
from fl_lightning.run import client_store
from fl_lightning.cli.commands import main

real, count, limit = client_store.write_synced, [0], int(sys.argv[1])

def write_synced(path, write):
    count[0] += 1
    if count[0] == limit:
        with open(path, "wb") as f:
            f.write(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)
    real(path, write)

client_store.write_synced = write_synced
sys.exit(main(sys.argv[2:]))
"""


def _states_equal(a: dict, b: dict) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    root = tmp_path_factory.mktemp("full")
    recipe = _fedhe_recipe(root / "r.yaml")
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(root / "run")) == 0
    checkpoint = load_checkpoint(root / "run/checkpoints/last.ckpt")
    return read_summary(root / "run"), load_client_states(checkpoint)


@pytest.mark.slow  # kills and resumes a 1,000-client run
@pytest.mark.parametrize(
    "budget, dies_at",
    [
        ("1024", 25),  # files are written at checkpoints: killed while round 3's checkpoint writes its clients
        ("0", 25),  # every state is written when its client finishes: killed in the middle of round 3
    ],
)
def test_a_run_killed_while_writing_client_state_resumes_bit_identical(tmp_path, uninterrupted, budget, dies_at):
    recipe = _fedhe_recipe(tmp_path / "r.yaml")
    run = tmp_path / "run"
    argv = ["fit", "--config", str(recipe), "--output_dir", str(run), "--runtime.client_state_memory_mb", budget]
    script = tmp_path / "dies.py"
    script.write_text(_DIES_WHILE_WRITING)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")])}
    killed = subprocess.run(
        [sys.executable, str(script), str(dies_at), *argv], env=env, capture_output=True, check=False
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    assert load_checkpoint(run / "checkpoints/last.ckpt")["rounds_done"] == 2
    assert b"half a file" in [p.read_bytes() for p in (run / "checkpoints/clients").iterdir()]

    assert run_cli(*argv, "--resume", "auto") == 0
    summary, states = uninterrupted
    assert read_summary(run)["final"] == summary["final"]
    assert summary["final"]["personal/clients_evaluated"] == len(states) <= 40
    resumed = load_client_states(load_checkpoint(run / "checkpoints/last.ckpt"))
    assert resumed.keys() == states.keys() and all(_states_equal(resumed[c], states[c]) for c in states)
    kept = _named(run / "checkpoints/last.ckpt") | _named(run / "checkpoints/previous.ckpt")
    assert _files(run / "checkpoints/clients") == kept  # the half-written file and other leftovers are gone


def test_a_damaged_client_file_is_refused_at_resume_while_previous_ckpt_can_still_resume(
    tmp_path, uninterrupted, capsys
):
    recipe = _fedhe_recipe(tmp_path / "r.yaml")
    run = tmp_path / "run"
    for rounds_done in (1, 2):
        argv = ["--output_dir", str(run), "--stop_after", str(rounds_done)] + (["--resume", "auto"] * (rounds_done > 1))
        assert run_cli("fit", "--config", str(recipe), *argv) == 0
    checkpoints = run / "checkpoints"
    # a file of a client trained in round 2 only: the round-1 checkpoint (previous.ckpt) does not need it
    damaged = checkpoints / "clients" / min(_named(checkpoints / "last.ckpt") - _named(checkpoints / "previous.ckpt"))
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    kept = {name: (checkpoints / name).read_bytes() for name in ("last.ckpt", "previous.ckpt")}
    # refused before a round is trained: a checkpoint written now would name the damaged file, and replace previous.ckpt
    capsys.readouterr()
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(run), "--resume", "auto") == 2
    err = capsys.readouterr().err
    assert f"client state file {damaged} is damaged" in err and f"resume from {checkpoints / 'previous.ckpt'}" in err
    assert {name: (checkpoints / name).read_bytes() for name in kept} == kept
    previous = ["--resume", str(checkpoints / "previous.ckpt"), "--output_dir", str(tmp_path / "from_previous")]
    assert run_cli("fit", "--config", str(recipe), *previous) == 0
    assert read_summary(tmp_path / "from_previous")["final"] == uninterrupted[0]["final"]


def test_the_checkpoint_grows_by_its_manifest_only_and_a_resume_elsewhere_links_the_files(tmp_path, uninterrupted):
    recipe = _fedhe_recipe(tmp_path / "r.yaml")
    run = tmp_path / "run"
    sizes = []
    for rounds_done in (1, 3):
        argv = ["--output_dir", str(run), "--stop_after", str(rounds_done)] + (["--resume", "auto"] * (rounds_done > 1))
        assert run_cli("fit", "--config", str(recipe), *argv) == 0
        sizes.append((run / "checkpoints/last.ckpt").stat().st_size)
    # 20 more clients trained (0.1 MB of weights and Adam moments on disk) add their 56-byte manifest rows
    assert 0 < sizes[1] - sizes[0] <= 20 * 56 + 2048
    moved = tmp_path / "elsewhere"
    resume = ["--resume", str(run / "checkpoints/last.ckpt"), "--runtime.client_state_memory_mb", "0"]
    assert run_cli("fit", "--config", str(recipe), "--output_dir", str(moved), *resume) == 0
    assert read_summary(moved)["final"] == uninterrupted[0]["final"]


@pytest.mark.parametrize("recipe", marked_beyond(1, ["digits_dsfl", "digits_moon"]))  # phase state; a previous model
def test_states_read_back_from_files_give_the_numbers_of_states_kept_in_memory(tmp_path, recipe):
    common = ["--config", str(ROOT / "recipes" / f"{recipe}.yaml"), "--rounds", "2", "--eval_every", "2"]
    common += ["--runtime.progress", "false"]
    assert run_cli("fit", *common, "--output_dir", str(tmp_path / "memory")) == 0
    argv = ["--output_dir", str(tmp_path / "files"), "--runtime.client_state_memory_mb", "0"]
    assert run_cli("fit", *common, *argv) == 0  # every state written and dropped as its client finishes
    assert read_summary(tmp_path / "files")["final"] == read_summary(tmp_path / "memory")["final"]
    checkpoints = [load_checkpoint(tmp_path / run / "checkpoints/last.ckpt") for run in ("memory", "files")]
    memory, files = (load_client_states(c) for c in checkpoints)
    assert memory and memory.keys() == files.keys() and all(_states_equal(memory[c], files[c]) for c in memory)
