"""Processes of ``flrun sweep``: the trial loop, worker processes and their coordinator.

With ``--n_jobs K`` the command starts K worker processes (processes, not threads: trials share no
torch state) and stays as their coordinator. A worker asks the coordinator over a pipe before every
trial; the coordinator, the only one that decides, says "go" while the study is short of ``n_trials``
(counting the trials it already allowed that have not shown up in the storage yet), so the study ends
with exactly ``n_trials``. The coordinator watches its workers: one that dies gets its running trial
failed and queued again and is replaced (a bounded number of times); the workers end with the
coordinator (Linux ``PR_SET_PDEATHSIG``, and a pipe that closes), and an interrupted worker fails and
re-queues its own trial, so a re-run of the command finishes the study.

On a machine with GPUs each worker sees one of them (``CUDA_VISIBLE_DEVICES``, the GPU with the fewest
workers when it starts): ``--n_jobs 8`` on four GPUs runs two trials on each instead of eight on the
first. The GPUs are those this command may use (its own ``CUDA_VISIBLE_DEVICES``, or every GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import selectors
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from ..distributed.gpu_share import end_with_parent, environment_for, least_used, raise_interrupt
from .spec import SweepSpec
from .storage import open_slots, open_study, requeue, tally
from .trial import PROCESS, run_trial, warm_up


class Interrupts:
    """SIGTERM (also sent when the parent dies) interrupts like Ctrl-C, so the running trial is failed and queued
    again. The interrupt is raised only inside a trial's run (``running``): one that arrives while Optuna records
    a trial in the storage would cut its bookkeeping (Optuna then fails with its own traceback), so it waits
    (``pending``) until the trial is recorded. Python drops an exception raised where it cannot propagate (a
    finalizer), so the signal may come again and is raised again after ``LOST_S``; once the re-queueing has begun
    (``cleaning``) further ones are ignored."""

    LOST_S = 1.5

    def __init__(self):
        self.cleaning = self.running = self.pending = False
        self.raised_at: float | None = None

    def __call__(self, signum, frame):
        if self.cleaning:
            return
        self.pending = True
        now = time.monotonic()
        if self.running and (self.raised_at is None or now - self.raised_at > self.LOST_S):
            self.raised_at = now
            raise KeyboardInterrupt

    @contextlib.contextmanager
    def trial(self):
        """The span of one trial's run, where an interrupt is raised at once."""
        self.running, self.raised_at = True, None
        if self.pending:
            raise KeyboardInterrupt
        try:
            yield
        finally:
            self.running = False


@contextlib.contextmanager
def interruptible():
    interrupts = Interrupts()
    previous = {s: signal.signal(s, interrupts) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield interrupts
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def work(spec: SweepSpec, study, may_start, notify, interrupts: Interrupts | None = None) -> None:
    """Runs one trial at a time while ``may_start()`` allows; ``notify(event, trial_number)`` hears of
    each trial's start and end. Raises KeyboardInterrupt when interrupted (the running trial queued again)."""
    interrupts = interrupts or Interrupts()
    while not interrupts.pending and may_start():
        current: list = []

        def objective(trial, current=current):
            current.append(trial)
            with interrupts.trial():
                return run_trial(spec, trial, notify)

        try:
            study.optimize(objective, n_trials=1, catch=(Exception,), gc_after_trial=True)
        except KeyboardInterrupt:
            interrupts.cleaning = True
            if current:
                requeue(study, spec, current[0]._trial_id, "interrupted; its parameters are queued again")
            raise
        if current:
            notify("finished", current[0].number)
    if interrupts.pending:  # it came while Optuna recorded a trial, or between two trials
        interrupts.cleaning = True
        raise KeyboardInterrupt


def _deadline_passed(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


def _may_start(spec: SweepSpec, study, deadline: float | None) -> bool:
    return not _deadline_passed(deadline) and open_slots(study, spec.n_trials) > 0


def run_in_process(spec: SweepSpec, study, deadline: float | None, progress) -> int:
    with interruptible() as interrupts:
        try:
            work(spec, study, lambda: not progress.stopped and _may_start(spec, study, deadline), progress, interrupts)
        except KeyboardInterrupt:
            progress.note("interrupted: the running trial is queued again; re-run the same command to finish.")
            return 130
    return 0


def wait_for_stale(spec: SweepSpec, study, deadline: float | None, progress) -> bool:
    """Trials still RUNNING when this command's processes are done belong to another command or to a
    killed process. Waits up to one grace period for the dead ones' heartbeats to expire; True when
    that queued trials again (another pass then runs them)."""
    import optuna

    if _deadline_passed(deadline) or not tally(study.get_trials(deepcopy=False))["RUNNING"]:
        return False
    progress.note(
        f"trials still running elsewhere or in a killed process: waiting up to {spec.grace_period} s "
        "for their heartbeats."
    )
    end = time.monotonic() + spec.grace_period + spec.heartbeat_interval
    while time.monotonic() < end:
        optuna.storages.fail_stale_trials(study)
        counts = tally(study.get_trials(deepcopy=False))
        if counts["WAITING"] and open_slots(study, spec.n_trials) > 0:
            return True
        if not counts["RUNNING"]:
            return False
        time.sleep(1.0)
    return False


class _Worker:
    def __init__(self, serial: int, process: subprocess.Popen, inbox: int, outbox: int, gpu: str | None = None):
        self.serial, self.process, self.inbox, self.outbox, self.gpu = serial, process, inbox, outbox, gpu
        self.buffer = b""
        self.asking = self.granted = False
        self.trial: int | None = None

    def send(self, word: str) -> None:
        try:
            os.write(self.outbox, f"{word}\n".encode())
        except OSError:  # the worker is gone; reaping handles it
            pass

    def close(self) -> None:
        for fd in (self.inbox, self.outbox):
            with contextlib.suppress(OSError):
                os.close(fd)


class Coordinator:
    """Starts, feeds and watches the worker processes of one command."""

    def __init__(
        self,
        spec: SweepSpec,
        study,
        n_jobs: int,
        sweep_file: str,
        epoch: int,
        deadline,
        progress,
        gpus: Sequence[str] = (),
    ):
        self.spec, self.study, self.n_jobs, self.sweep_file = spec, study, n_jobs, sweep_file
        self.gpus = list(gpus)  # CUDA_VISIBLE_DEVICES entries shared out among the workers; none: unchanged
        self.epoch, self.deadline, self.progress = epoch, deadline, progress
        self.workers: list[_Worker] = []
        self.selector = selectors.DefaultSelector()
        self.serials = 0
        self.spawn_budget = 3 * n_jobs  # the first n_jobs plus two replacements each
        self.deaths = 0

    def spawn(self) -> None:
        to_parent_r, to_parent_w = os.pipe()
        to_worker_r, to_worker_w = os.pipe()
        info = {"serial": self.serials, "epoch": self.epoch, "fds": [to_worker_r, to_parent_w], "parent": os.getpid()}
        command = [sys.executable, "-m", "fl_lightning", "sweep", "--config", self.sweep_file]
        command += ["--worker", json.dumps(info), "--output_dir", self.spec.output_dir]
        command += ["--study_name", self.spec.study_name, "--", *self.spec.fit_args]
        gpu = least_used(self.gpus, (worker.gpu for worker in self.workers))
        env = environment_for(gpu)
        env["FLRUN_SWEEP_STORAGE"] = self.spec.storage or ""  # a password stays out of `ps`
        process = subprocess.Popen(command, pass_fds=(to_worker_r, to_parent_w), env=env, stdin=subprocess.DEVNULL)
        os.close(to_worker_r)
        os.close(to_parent_w)
        worker = _Worker(self.serials, process, to_parent_r, to_worker_w, gpu)
        self.selector.register(to_parent_r, selectors.EVENT_READ, worker)
        self.workers.append(worker)
        self.serials += 1
        self.spawn_budget -= 1

    def run(self) -> int:
        try:
            self.top_up()
            while self.workers:
                for key, _ in self.selector.select(timeout=0.5):
                    self.read(key.data)
                self.answer()
                self.reap()
                self.top_up()
        except KeyboardInterrupt:
            self.stop()
            self.progress.note("interrupted: running trials are queued again; re-run the same command to finish.")
            return 130
        return 0

    def read(self, worker: _Worker) -> None:
        try:
            chunk = os.read(worker.inbox, 4096)
        except OSError:
            chunk = b""
        if not chunk:
            self.selector.unregister(worker.inbox)
            return
        worker.buffer += chunk
        *lines, worker.buffer = worker.buffer.split(b"\n")
        for line in lines:
            word, _, number = line.decode().partition(" ")
            if word == "ask":
                worker.asking = True
            elif word == "started":
                worker.granted, worker.trial = False, int(number)
                self.progress("started", int(number))
            elif word == "finished":
                worker.trial = None
                self.progress("finished", int(number))

    def answer(self) -> None:
        """ "go" while the study is short of n_trials counting allowed trials not yet started; "stop" once
        it is full and nothing allowed is outstanding (until then the answer waits)."""
        for worker in [w for w in self.workers if w.asking]:
            pending = sum(w.granted for w in self.workers)
            slots = open_slots(self.study, self.spec.n_trials) - pending
            ending = _deadline_passed(self.deadline) or self.progress.stopped  # a wrong metric stops every worker
            if slots > 0 and not ending:
                worker.send("go")
                worker.asking, worker.granted = False, True
            elif pending == 0 or ending:
                worker.send("stop")
                worker.asking = False

    def reap(self) -> None:
        for worker in [w for w in self.workers if w.process.poll() is not None]:
            # messages it sent before it ended (a forked data loader may still hold the pipe: never block)
            while worker.inbox in self.selector.get_map() and select.select([worker.inbox], [], [], 0.2)[0]:
                self.read(worker)
            if worker.inbox in self.selector.get_map():
                self.selector.unregister(worker.inbox)
            self.workers.remove(worker)
            worker.close()
            code = worker.process.returncode
            if code == 0:
                continue
            self.deaths += 1
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with status {code}"
            lost = self.requeue_trials_of(worker, f"its worker process {how}")
            self.progress.note(
                f"worker {worker.serial} (pid {worker.process.pid}) {how}"
                + (f" during trial {', '.join(map(str, lost))}, which is queued again." if lost else ".")
            )

    def requeue_trials_of(self, worker: _Worker, reason: str) -> list[int]:
        process = PROCESS.rsplit(":", 1)[0] + f":{worker.process.pid}"
        running = [
            t
            for t in self.study.get_trials(deepcopy=False)
            if t.state.name == "RUNNING" and t.user_attrs.get("process") == process
        ]
        return [n for t in running if (n := requeue(self.study, self.spec, t._trial_id, reason)) is not None]

    def top_up(self) -> None:
        """Starts workers while trials are unclaimed (at the start, and to replace dead workers)."""
        if _deadline_passed(self.deadline) or self.progress.stopped:
            return
        claimed = sum(w.granted or w.asking for w in self.workers)
        unclaimed = open_slots(self.study, self.spec.n_trials) - claimed
        while unclaimed > 0 and len(self.workers) < self.n_jobs and self.spawn_budget > 0:
            self.spawn()
            unclaimed -= 1
        if not self.workers and unclaimed > 0 and self.spawn_budget <= 0:
            self.progress.note(f"{self.deaths} worker processes died; not starting more (see the messages above).")

    def stop(self) -> None:
        """Ends the workers: SIGTERM every 2 s (each fails and re-queues its trial), SIGKILL after 30 s."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        end = time.monotonic() + 30
        while time.monotonic() < end and any(w.process.poll() is None for w in self.workers):
            for worker in self.workers:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.workers[0].process.wait(timeout=2)
        for worker in self.workers:
            if worker.process.poll() is None:
                worker.process.kill()
                worker.process.wait()
                self.requeue_trials_of(worker, "interrupted; its parameters are queued again")
            worker.close()
        self.workers = []


def coordinate(
    spec: SweepSpec, study, n_jobs: int, sweep_file: str, epoch: int, deadline, progress, gpus: Sequence[str] = ()
) -> int:
    previous = signal.signal(signal.SIGTERM, raise_interrupt)  # `kill PID` ends the workers too
    try:
        return Coordinator(spec, study, n_jobs, sweep_file, epoch, deadline, progress, gpus).run()
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Channel:
    """A worker's side of the pipes to its coordinator."""

    def __init__(self, inbox: int, outbox: int):
        self.inbox, self.outbox = os.fdopen(inbox, "rb", buffering=0), outbox

    def send(self, event: str, number: int | None = None) -> None:
        os.write(self.outbox, (event if number is None else f"{event} {number}").encode() + b"\n")

    def may_start(self) -> bool:
        try:
            self.send("ask")
        except BrokenPipeError:  # the coordinator is gone
            return False
        answer = b""
        while not answer.endswith(b"\n"):
            chunk = self.inbox.read(1)
            if not chunk:
                return False
            answer += chunk
        return answer.strip() == b"go"


def _follow_parent(parent: int, interrupts: Interrupts) -> None:
    """Interrupts this worker (again and again, until it is cleaning up) once its coordinator is gone:
    the death signal comes once and may be lost."""
    main = threading.main_thread().ident
    while not interrupts.cleaning:
        if os.getppid() != parent:
            signal.pthread_kill(main, signal.SIGTERM)
            time.sleep(2.0)
        else:
            time.sleep(1.0)


def _drop_lost_interrupts(unraisable) -> None:
    """An interrupt raised inside a finalizer is lost (``_follow_parent`` sends it again): not a traceback on the
    terminal of a user whose sweep was killed; anything else is printed as Python prints it."""
    if not isinstance(unraisable.exc_value, KeyboardInterrupt):
        sys.__unraisablehook__(unraisable)


def run_worker(spec: SweepSpec, info: dict) -> int:
    """A worker process: trials while its coordinator allows, with its own sampler seed."""
    end_with_parent()  # SIGTERM when the coordinator dies (checked next that it is still there)
    if os.getppid() != info["parent"]:  # the coordinator died before this process could follow it
        return 0
    sys.unraisablehook = _drop_lost_interrupts
    channel = _Channel(*info["fds"])
    with interruptible() as interrupts:
        threading.Thread(target=_follow_parent, args=(info["parent"], interrupts), daemon=True).start()
        try:
            warm_up(spec)  # before the first trial starts its clock
            study = open_study(spec, epoch=info["epoch"], worker=info["serial"])
            work(spec, study, channel.may_start, channel.send, interrupts)
        except KeyboardInterrupt:
            return 130
    return 0
