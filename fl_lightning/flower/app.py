"""The components a Flower app project names (``pyproject.toml``'s ``[tool.flwr.app.components]``):
``serverapp = "fl_lightning.flower.app:server"`` and ``clientapp = "fl_lightning.flower.app:client"``. The
ServerApp reads the recipe from the run config (``recipe``, ``fit-args``, ``supernodes``); each SuperNode gets it
from the ServerApp and its share of the clients from its node config (``partition-id``, ``num-partitions``)."""

from .apps import client_app, server_app

server = server_app()
client = client_app()
