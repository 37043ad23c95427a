"""The federation's vocabulary, below everything else: named types and payloads that know their size
(``types``), the one user-facing error (``errors``), client populations and tiers, samplers, the
communication ledger, learning-rate schedules over rounds and the named random streams.

Imports nothing from the rest of the package.
"""
