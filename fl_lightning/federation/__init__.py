"""The federation's vocabulary, below everything else: named types and payloads that know their size
(``types``), the one user-facing error (``errors``), client populations and tiers, samplers, the
communication ledger, learning-rate schedules over rounds, the named random streams and the mask of a padded
batch's real rows (``padding``).

Imports nothing from the rest of the package.
"""
