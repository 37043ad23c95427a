"""One federated run, from a recipe to its files: the recipe loader (``base:`` families) and the bounded reading
of any YAML a user hands over, the ``flrun fit`` parser and its one-sentence errors, the run directory a run may
write (its own, marked by ``run.json``), :func:`~fl_lightning.run.fit.fit` (and ``api``, the same run from
Python: ``fl_lightning.fit``), the :class:`FederationOrchestrator`
(the only round loop) and the option groups it is given (``options``), what a round's clients report
(``tally``), asynchronous rounds, the run's state and checkpoints, per-client state files,
divergence and injected faults, and the phases of a round shared over several ranks.

May import ``strategies``, ``client`` and everything below them; never ``sweep``, ``report`` or ``cli``.
"""
