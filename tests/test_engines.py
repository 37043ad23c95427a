"""The documented ways past one machine, on the real engines: ``srun`` ranks and an ``sbatch --array`` chain on a
real (local, one-node) Slurm cluster, and two torchrun agents standing for two machines with a c10d rendezvous
on 127.0.0.1. Each gives the numbers of one process; a killed agent ends the other with the documented message,
and the run resumes. Slurm tests are skipped, with the reason, where Slurm cannot start (``local_slurm.py``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, metrics_rows, read_summary, write_recipe

from fl_lightning.distributed import launch

pytestmark = pytest.mark.slow
FLRUN = str(Path(sys.executable).parent / "flrun")
ROUNDS = 30  # long enough (seconds) for an agent to be killed mid-run


def _assert_same_numbers(one: Path, other: Path) -> None:
    """Every metrics.csv row and the summary's results of ``other`` equal one process's ``one``."""
    assert metrics_rows(one) == metrics_rows(other)
    first, second = read_summary(one), read_summary(other)
    for key in ("final", "best", "comm", "rounds", "diverged"):
        assert first[key] == second[key], key


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    """The stand-in recipe for the how-to's R: FedAvg on digits, a few rounds, checkpoints every round."""
    folder = tmp_path_factory.mktemp("recipe")
    return write_recipe(folder / "r.yaml", rounds=ROUNDS, eval_every=10, checkpoint_every=1)


@pytest.fixture(scope="module")
def one_process(recipe, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("one") / "run"
    done = subprocess.run([FLRUN, "fit", "--config", str(recipe), "--output_dir", str(run)], capture_output=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return run


def test_srun_with_two_tasks_gives_the_numbers_of_one_process(slurm, recipe, one_process, tmp_path):
    """The how-to's ``srun flrun fit ... --resume auto``: two tasks of one step are the two ranks."""
    done = slurm.run(f"srun -n 2 {FLRUN} fit --config {recipe} --output_dir run --resume auto", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _assert_same_numbers(one_process, tmp_path / "run")


def test_an_sbatch_array_chain_with_stop_after_and_resume_auto_equals_one_run(slurm, recipe, one_process, tmp_path):
    """``sbatch --array 1-3%1 job.sh``, each job ``srun flrun fit ... --resume auto --stop_after 10k``: three jobs
    one after another, each ten rounds further, end with the numbers of the uninterrupted run."""
    job = tmp_path / "job.sh"
    job.write_text(
        "#!/bin/bash\n#SBATCH --ntasks 2 --output job-%a.out\n"
        f"srun {FLRUN} fit --config {recipe} --output_dir run --resume auto "
        "--stop_after $((SLURM_ARRAY_TASK_ID * 10))\n"
    )
    done = slurm.run("sbatch --wait --array 1-3%1 job.sh", cwd=tmp_path)
    outputs = {p.name: p.read_text()[-1500:] for p in tmp_path.glob("job-*.out")}
    assert done.returncode == 0, (done.stderr[-2000:], outputs)
    assert sorted(outputs) == ["job-1.out", "job-2.out", "job-3.out"]
    _assert_same_numbers(one_process, tmp_path / "run")


def _torchrun_agents(recipe: Path, machines: list[Path], run: Path, port: int, extra: tuple[str, ...] = ()) -> list:
    """The how-to's several-machines command, one agent per folder (a machine), one process per agent; ``run``
    on the file system both share (the how-to: rank 0 writes it, every rank reads the checkpoint to resume)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1"]
    command += ["--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--local-ranks-filter", "0"]
    command += ["-m", "fl_lightning", "fit", "--config", str(recipe), "--output_dir", str(run), *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return [
        subprocess.Popen(
            [*command[:5], "--node_rank", str(i), *command[5:]],
            cwd=folder,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for i, folder in enumerate(machines)
    ]


def _kill_machine(pid: int) -> None:
    """Kills an agent and every process under it at once, as a machine that goes down (torchrun starts its
    workers in their own sessions, so the agent's process group alone would leave its rank running)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # a process that ended meanwhile
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, grew = {pid}, True
    while grew:
        below = {child for child, parent in parents.items() if parent in tree} - tree
        tree, grew = tree | below, bool(below)
    for member in tree:
        os.kill(member, signal.SIGKILL)


def test_two_torchrun_agents_give_one_process_s_numbers_end_together_and_resume(recipe, one_process, tmp_path):
    machines = [tmp_path / "machine0", tmp_path / "machine1"]
    for folder in machines:
        folder.mkdir()
    shared = tmp_path / "shared"
    agents = _torchrun_agents(recipe, machines, shared / "first", launch.free_port())
    outputs = [agent.communicate(timeout=600) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], [err[-2000:] for _, err in outputs]
    _assert_same_numbers(one_process, shared / "first")
    assert [list(folder.iterdir()) for folder in machines] == [[], []]  # nothing written beside the shared run

    # one machine goes down mid-run: the other stops with the documented message; then both resume
    agents = _torchrun_agents(recipe, machines, shared / "run", launch.free_port())
    deadline = time.monotonic() + 300
    while not (shared / "run/checkpoints/last.ckpt").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    _kill_machine(agents[1].pid)
    start = time.monotonic()
    out, err = agents[0].communicate(timeout=120)
    agents[1].wait()
    assert agents[0].returncode != 0 and time.monotonic() - start < 60  # within the documented 30 s, and a margin
    assert "rank 0 of 2 lost contact with the other ranks" in err and "--resume auto to continue" in err, err[-2000:]
    assert (shared / "run/checkpoints/last.ckpt").exists() and not (shared / "run/summary.json").exists()
    agents = _torchrun_agents(recipe, machines, shared / "run", launch.free_port(), ("--resume", "auto"))
    outputs = [agent.communicate(timeout=600) for agent in agents]
    assert [a.returncode for a in agents] == [0, 0], [err[-2000:] for _, err in outputs]
    _assert_same_numbers(one_process, shared / "run")
