"""Where ``flrun flower`` runs the apps: Flower's simulation engine (:func:`run_simulated`), or a loopback
deployment of a SuperLink and SuperNodes as processes on 127.0.0.1 that the run is submitted to with ``flwr run``
(:func:`run_loopback`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ..federation.errors import ConfigError
from .apps import SCRATCH_ENV, client_app, server_app


def run_simulated(fit_args: list[str], supernodes: int) -> dict[str, Any]:
    """Runs ``flrun fit <fit_args>`` as Flower apps on the simulation engine with ``supernodes`` SuperNodes (each a
    worker process); returns the run's summary."""
    summaries: list[dict[str, Any]] = []
    folder = tempfile.mkdtemp(prefix="flrun-flower-")
    os.environ[SCRATCH_ENV] = folder  # the workers' run folders: gone with it, whoever ends the workers
    try:
        _simulate(fit_args, supernodes, summaries)
    finally:
        os.environ.pop(SCRATCH_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)
    if not summaries:
        raise RuntimeError("the ServerApp ended without finishing the run; Flower's log above says why.")
    return summaries[0]


def _simulate(fit_args: list[str], supernodes: int, summaries: list[dict[str, Any]]) -> None:
    from flwr.simulation import run_simulation

    run_simulation(
        server_app=server_app(fit_args, supernodes, summaries),
        client_app=client_app(),
        num_supernodes=supernodes,
        # one worker per SuperNode, each on one CPU; no dashboard (it would listen on a port)
        backend_config={
            "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            "init_args": {"num_cpus": supernodes, "include_dashboard": False},
        },
    )


# ---------------------------------------------------------------------------------------------- loopback
APP_PYPROJECT = """[build-system]
requires = ["hatchling"]
build-backend = "hatchling.build"

[project]
name = "flrun-recipe"
version = "1.0.0"
description = "A fl-lightning recipe as Flower apps"
# none: Flower would install what they need into a per-run environment ahead of this one's packages (flwr's own
# dependencies included), and the run must use the torch, numpy and fl-lightning installed beside Flower
dependencies = []

[tool.flwr.app]
publisher = "fl-lightning"

[tool.flwr.app.components]
serverapp = "fl_lightning.flower.app:server"
clientapp = "fl_lightning.flower.app:client"

[tool.flwr.app.config]
recipe = "recipe.yaml"
fit-args = ""
supernodes = 2
"""


def write_app(folder: Path) -> Path:
    """A Flower app project in ``folder`` whose components are this package's apps (``flwr run`` builds it)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(APP_PYPROJECT)
    return folder


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _executable(name: str) -> str:
    """A Flower command of this Python's environment (beside its interpreter), else the one on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} is not installed; pip install -e '.[flower]' installs Flower's commands.")
    return found


class Loopback:
    """A SuperLink and ``supernodes`` SuperNodes as processes listening on 127.0.0.1 only (``--insecure``), each in
    its own process group so that ending it ends what it started (the ServerApp and ClientApp processes); a
    context manager that ends them all however the block ends."""

    def __init__(self, folder: Path, supernodes: int):
        self.folder, self.supernodes = folder, supernodes
        self.port = _free_port()
        self.processes: list[subprocess.Popen] = []
        self.env = {**os.environ, "FLWR_HOME": str(folder / "flwr-home"), SCRATCH_ENV: str(folder)}

    def __enter__(self) -> Loopback:
        home = Path(self.env["FLWR_HOME"])
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\naddress = "127.0.0.1:{self.port}"\n'
            "insecure = true\n"
        )
        try:
            self._start("superlink", [_executable("flower-superlink"), "--insecure", "--host", "127.0.0.1",
                                      "--port", str(self.port)])  # fmt: skip
            self._wait_listening("superlink", self.port)
            for i in range(self.supernodes):
                node_config = f"partition-id={i} num-partitions={self.supernodes}"
                self._start(f"supernode{i}", [
                    _executable("flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                    "--host", "127.0.0.1", "--port", str(_free_port()), "--node-config", node_config,
                ])  # fmt: skip
        except BaseException:
            self.close()
            raise
        return self

    def _wait_listening(self, name: str, port: int, within_s: float = 120.0) -> None:
        """Returns once 127.0.0.1:``port`` accepts connections; the process's log when it ends or never listens."""
        deadline = time.monotonic() + within_s
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    return
            ended = self.processes[-1].poll() is not None
            if ended or time.monotonic() > deadline:
                tail = (self.folder / f"{name}.log").read_text(errors="replace")[-1500:]
                state = "ended" if ended else f"did not listen on 127.0.0.1:{port} within {within_s:.0f} s"
                raise RuntimeError(f"the loopback deployment's {name} {state}; its log ends with:\n{tail}")
            time.sleep(0.2)

    def _start(self, name: str, command: list[str]) -> None:
        log = open(self.folder / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        self.processes.append(
            subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True)
        )
        log.close()

    def submit(self, app: Path, run_config: str) -> None:
        """``flwr run`` of the app on this SuperLink, its log streamed until the run ends."""
        command = [_executable("flwr"), "run", str(app), "loopback", "--run-config", run_config, "--stream"]
        with open(self.folder / "flwr-run.log", "wb") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=self.env, check=False)

    def close(self) -> None:
        """Ends every process group it started: SIGTERM, then SIGKILL to what is left after a grace period."""
        for process in reversed(self.processes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # its children too, if any outlived it
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=5)
        self.processes.clear()

    def __exit__(self, *exc: object) -> None:
        self.close()


_RAISED = re.compile(r"^(?:[\w.]+\.)?(ConfigError|Diverged|UserError|\w*Error): (.+)$", re.MULTILINE)


def _failure(log: str) -> Exception:
    """What stopped the ServerApp, from ``flwr run``'s log: its error's sentence (a recipe's mistake as the
    ConfigError it was), else the log's end."""
    raised = _RAISED.findall(log)
    if raised:
        kind, sentence = raised[-1]
        if kind in ("ConfigError", "UserError", "Diverged"):
            return ConfigError(sentence)
        return RuntimeError(f"the loopback run stopped: {sentence}")
    return RuntimeError(f"the loopback run ended without its summary; flwr run's log ends with:\n{log[-2000:]}")


def run_loopback(fit_args: list[str], supernodes: int) -> dict[str, Any]:
    """Runs ``flrun fit <fit_args>`` as Flower apps on a loopback deployment that this call starts and ends;
    returns the run's summary."""
    from ..run.arguments import parse_fit
    from ..run.run_dir import run_root

    _, init, resolved = parse_fit(fit_args)
    root = run_root(init.output_dir, init.name, init.seed).resolve()
    folder = Path(tempfile.mkdtemp(prefix="flrun-flower-"))
    try:
        recipe = folder / "recipe.yaml"
        recipe.write_text(resolved)
        app = write_app(folder / "app")
        more = shlex.join(["--output_dir", str(root), "--runtime.progress", "false"])
        run_config = f'recipe="{recipe}" fit-args="{more}" supernodes={supernodes}'
        with Loopback(folder, supernodes) as loopback:
            loopback.submit(app, run_config)
        summary_file = root / "summary.json"
        if not summary_file.is_file() or "flower" not in json.loads(summary_file.read_text()):
            raise _failure((folder / "flwr-run.log").read_text(errors="replace"))
        return json.loads(summary_file.read_text())
    finally:
        shutil.rmtree(folder, ignore_errors=True)
