"""A recipe as Flower apps: a ServerApp whose run is ``flrun fit``'s (the orchestrator's one round loop, the
strategy's phases and aggregation, evaluation, the run files) and a ClientApp that runs each task with the same
Fabric loop and strategy client hooks, payloads travelling as Flower records (``codec``: dtypes and shapes, no
pickle); ``flrun flower`` runs them on Flower's simulation engine or on a loopback deployment of a SuperLink and
SuperNodes (``loopback``).

Needs the optional ``flwr`` package (``pip install -e ".[flower]"``). May import ``run`` and everything below it;
only ``cli`` imports it.
"""
