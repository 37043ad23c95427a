"""``flrun sweep`` and ``flrun table``: Optuna studies over a recipe (the sweep file, the study's definition,
trials run through ``flrun fit``, worker processes, results) and the runs a paper table needs.

May import ``report``, ``run`` and everything below; never ``cli``.
"""
