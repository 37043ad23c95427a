"""Processes and resources: a run at a time per process, ranks the machine can hold, child processes that end with
the command that started them, and one definition per sweep study.

Tests that start real processes poll for what they wait on with generous deadlines (the machine may be busy), and
each kills only the processes it started.
"""

from __future__ import annotations

import threading

import pytest
from conftest import read_summary, write_recipe

import fl_lightning
from fl_lightning.federation.errors import ConfigError
from fl_lightning.tracking import RunLogger


# ---------------------------------------------------------------------------------------------- one run per process
class _HeldAtFirstRound(RunLogger):
    """Holds its run at the end of round 1 until ``release`` is set (so a second run starts meanwhile)."""

    def __init__(self):
        self.reached, self.release = threading.Event(), threading.Event()

    def log_metrics(self, metrics, step):
        self.reached.set()
        assert self.release.wait(timeout=600)


def test_a_second_fit_while_one_runs_in_another_thread_is_refused_and_the_first_keeps_its_numbers(tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", rounds=3, eval_every=1)
    fl_lightning.fit(config=str(recipe), output_dir=str(tmp_path / "alone"))
    held, outcome = _HeldAtFirstRound(), {}

    def first():
        outcome["summary"] = fl_lightning.fit(config=str(recipe), output_dir=str(tmp_path / "first"), logger=[held])

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert held.reached.wait(timeout=600), "the first run never finished a round"
        with pytest.raises(ConfigError, match="another fit is running in this process") as refused:
            fl_lightning.fit(config=str(recipe), seed=1, output_dir=str(tmp_path / "second"))
    finally:
        held.release.set()
        thread.join(timeout=600)
    assert "one after another, or in separate processes" in str(refused.value)
    assert not (tmp_path / "second").exists()  # refused before anything was written
    assert outcome["summary"]["final"] == read_summary(tmp_path / "alone")["final"]
    fl_lightning.fit(config=str(recipe), seed=1, output_dir=str(tmp_path / "second"))  # the lock went with the run
