"""Where ``flrun flower`` runs the apps: Flower's simulation engine (:func:`run_simulated`)."""

from __future__ import annotations

import os
from typing import Any

from .apps import client_app, server_app


def run_simulated(fit_args: list[str], supernodes: int) -> dict[str, Any]:
    """Runs ``flrun fit <fit_args>`` as Flower apps on the simulation engine with ``supernodes`` SuperNodes (each a
    worker process); returns the run's summary."""
    from flwr.simulation import run_simulation

    summaries: list[dict[str, Any]] = []
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
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
    if not summaries:
        raise RuntimeError("the ServerApp ended without finishing the run; Flower's log above says why.")
    return summaries[0]
