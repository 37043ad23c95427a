"""Reproducibility reports from run and sweep directories: reading runs, grouping them by experiment,
HTML / Markdown / W&B rendering, sweep sections, paper tables, and the partition chart of
``flrun data inspect``.

May import ``run`` (what a run's files mean) and everything below; never ``sweep`` or ``cli``.
"""
