"""The federation's vocabulary, below everything else: named types and payloads that know their size
(``types``), the one user-facing error (``errors``), client populations and tiers, samplers, the
communication ledger, learning-rate schedules over rounds, the named random streams and the mask of a padded
batch's real rows (``padding``); the package's version and moved module paths (``release``) and the external
files several layers name (``pins``).

Imports nothing from the rest of the package.
"""
