"""A real Slurm cluster of one node on this machine, for the tests that run the how-to's Slurm commands.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (which ``.ci/run`` installs, as it installs
PostgreSQL): a munge daemon with its own socket and key copy, the controller and the node daemon on free ports
of 127.0.0.1 (``CommunicationParameters=NoCtldInAddrAny,NoInAddrAny``: nothing listens on another address),
no cgroups (``proctrack/linuxproc``, ``task/none``), everything under one temporary folder and gone with it.
The node is called ``localhost``, so a job's first node, which ``flrun fit`` takes as the ranks' rendezvous,
is the loopback address too. Clients find the cluster through ``SLURM_CONF`` in :attr:`LocalSlurm.env`.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo")
CONF = """\
ClusterName=fltests
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge.sock
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmdSpoolDir={root}/spool
StateSaveLocation={root}/state
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
SlurmUser=root
SlurmdUser=root
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=tests Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def why_not() -> str | None:
    """Why a local Slurm cannot start here, or None when it can."""
    missing = [name for name in DAEMONS if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]
    if missing:
        return f"needs Debian's slurmctld, slurmd, slurm-client and munge (.ci/run installs them); missing {missing}"
    if os.geteuid() != 0:
        return "needs root to run slurmd (it starts jobs as their users); .ci/run runs as root"
    if not Path("/etc/munge/munge.key").exists():
        return "needs munge's key /etc/munge/munge.key (Debian's munge package makes it)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    """Starts the cluster on ``__enter__`` (waits until the node is idle) and stops it on ``__exit__``."""

    def __init__(self, cpus: int = 2):
        self.cpus = cpus
        self.root = Path(tempfile.mkdtemp(prefix="flslurm-", dir="/tmp"))
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}
        self.processes: list[subprocess.Popen] = []

    def __enter__(self) -> LocalSlurm:
        root = self.root
        (root / "spool").mkdir()
        (root / "state").mkdir()
        conf = CONF.format(root=root, ctld_port=_free_port(), slurmd_port=_free_port(), cpus=self.cpus)
        (root / "slurm.conf").write_text(conf)
        shutil.copy("/etc/munge/munge.key", root / "munge.key")
        os.chmod(root / "munge.key", 0o400)
        munge = [_daemon("munged"), "--force", f"--socket={root}/munge.sock", f"--key-file={root}/munge.key"]
        munge += [f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munge.seed"]
        subprocess.run(munge, check=True, capture_output=True)  # it daemonizes itself; its pid file stops it
        try:
            for command in ([_daemon("slurmctld"), "-D", "-i"], [_daemon("slurmd"), "-D", "-N", "localhost"]):
                log = open(root / f"{Path(command[0]).name}.out", "w")
                self.processes.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=log))
            self._wait_idle()
        except BaseException:
            self.__exit__()
            raise
        return self

    def _wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = subprocess.run(
                ["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True, check=False
            ).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        logs = {p.name: p.read_text()[-1500:] for p in self.root.glob("*.out")}
        raise RuntimeError(f"the local Slurm node did not become idle within {timeout:.0f} s: {logs}")

    def __exit__(self, *exc: object) -> None:
        for process in reversed(self.processes):
            process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        pid_file = self.root / "munged.pid"
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text().strip()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass
        shutil.rmtree(self.root, ignore_errors=True)

    def run(self, command: str, cwd: Path, timeout: float = 600) -> subprocess.CompletedProcess:
        """``command`` in a shell that reaches this cluster, from ``cwd``; output captured."""
        return subprocess.run(
            command, shell=True, cwd=cwd, env=self.env, capture_output=True, text=True, timeout=timeout, check=False
        )
