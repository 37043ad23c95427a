"""Several processes: launching ranks (``runtime.devices``, torchrun, Slurm), the process group and the
exchange of one flat message per rank, GPUs shared among a command's child processes, and Lightning Fabric
imported alone.

Imports only ``federation``; the orchestrator's use of it (which clients a rank trains) is in
``run.sharding``.
"""
