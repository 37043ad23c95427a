"""``flrun sweep``'s run: the study opened and checked, trials run in this process or in worker processes until
the study holds ``n_trials``, then the results written."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from ..distributed.capacity import check_memory
from ..federation.errors import ConfigError
from ..run.run_dir import holds_unmarked_run
from ..tracking.run_files import MARKER, marker_id
from .spec import SweepSpec
from .storage import _sampler, open_or_create_study, open_slots
from .storage_check import in_memory


def check_own_directory(root: Path, spec: SweepSpec) -> None:
    """Refuses a sweep directory that holds another study's results or a run (``flrun fit``'s folder): their trial
    directories and files (trials.csv, sweep.json, best_recipe.yaml) would be mixed up, and the run would no longer
    resume."""
    if marker_id(root) is not None or holds_unmarked_run(root):
        raise ConfigError(
            f"--output_dir {root} holds a run of flrun fit ({MARKER} or checkpoints/last.ckpt); a sweep's trials, "
            f"study and results written there would mix with it, so give study {spec.study_name!r} an output_dir of "
            "its own (the default is runs/sweeps/<study_name>)."
        )
    try:
        other = json.loads((root / "sweep.json").read_text()).get("study")
    except (OSError, ValueError, AttributeError):
        return
    if other is not None and other != spec.study_name:
        raise ConfigError(
            f"{root} holds the trials of sweep study {other!r}; give study {spec.study_name!r} an output_dir of "
            "its own."
        )


def run_sweep(
    spec: SweepSpec, n_jobs: int = 1, sweep_file: str | None = None, out=None, warnings: Sequence[str] = ()
) -> tuple[dict, int]:
    """Runs trials until the study holds ``n_trials`` (or ``timeout`` passes), printing progress; ``warnings``
    (from :func:`~fl_lightning.sweep.spec.check_against_recipe`) go to stderr once the study is open and checked.

    With ``n_jobs`` > 1 the trials run in that many worker processes that ask this one before each
    trial. Returns the results (also in ``sweep.json``) and the exit status: 0 when the study is full
    or the timeout ended it, 1 when trials are missing (workers kept dying) or every trial this command
    ran failed, 2 when a run lacked the sweep's metric (the sweep stops at once), 130 when interrupted.
    Refuses (ConfigError) a study whose recorded definition differs from ``spec``'s.
    """
    import sys

    from .results import Progress
    from .study import check_definition, definition, running

    if n_jobs < 1:
        raise ConfigError(f"--n_jobs must be at least 1, got {n_jobs}.")
    if n_jobs > 1 and not sweep_file:
        raise ConfigError("worker processes load the sweep file: give sweep_file with n_jobs > 1.")
    if n_jobs > 1 and in_memory(spec.storage):
        raise ConfigError(
            f"--storage {spec.storage} keeps the study in this process's memory, which the {n_jobs} worker processes "
            "of --n_jobs cannot see; give a database file (e.g. --storage sqlite:///runs/sweeps/study.db) or "
            "--n_jobs 1."
        )
    root = Path(spec.output_dir)
    check_own_directory(root, spec)
    current = definition(spec)
    root.mkdir(parents=True, exist_ok=True)
    study, created = open_or_create_study(spec)
    progress = Progress(spec, study, out or sys.stdout)
    with running(study):  # before the check: a second command starting now sees this one
        check_definition(study, spec, current, progress.note, created)
        if n_jobs > 1:  # the workers this machine cannot hold are refused before any starts
            check_memory(min(n_jobs, open_slots(study, spec.n_trials)), "--n_jobs", "worker processes")
        return _run_study(spec, study, n_jobs, sweep_file, progress, warnings)


def _run_study(spec: SweepSpec, study, n_jobs: int, sweep_file: str | None, progress, warnings) -> tuple[dict, int]:
    """Trials until the study is full (or the timeout ends it), then the results; see :func:`run_sweep`."""
    import time

    from ..distributed.gpu_share import visible_gpus
    from .results import write_results
    from .workers import coordinate, run_in_process, wait_for_stale

    root = Path(spec.output_dir)
    for warning in warnings:
        progress.note(f"warning: {warning}")
    epoch = len(study.get_trials(deepcopy=False))
    study.sampler = _sampler(spec, epoch, worker=0)
    gpus = visible_gpus() if n_jobs > 1 else []  # one process alone keeps the GPUs it was given
    progress.header(n_jobs, gpus)
    deadline = time.monotonic() + spec.timeout if spec.timeout else None
    status = 0
    for _ in range(3):  # further passes run trials that went stale (a killed process) while this one ran
        if n_jobs > 1:
            assert sweep_file, "run_sweep refuses n_jobs > 1 without it"
            status = coordinate(spec, study, n_jobs, sweep_file, epoch, deadline, progress, gpus)
        else:
            status = run_in_process(spec, study, deadline, progress)
        if status or progress.stopped or not wait_for_stale(spec, study, deadline, progress):
            break
    all_failed = bool(progress.ended) and all(state == "FAIL" for state in progress.ended)
    short = open_slots(study, spec.n_trials) > 0 and not (deadline and time.monotonic() > deadline)
    if status == 0 and progress.stopped:
        status = 2  # the sweep file's metric is wrong: a user error, found by the first trial
    elif status == 0 and (all_failed or short):
        status = 1
    result = write_results(study, spec, root)
    progress.final(result, status)
    return result, status
