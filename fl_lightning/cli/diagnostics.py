"""Where the package's messages go when ``flrun`` runs: its modules log to ``logging.getLogger(__name__)``
(notes at INFO, warnings at WARNING) and print nothing themselves; ``flrun`` shows those of level INFO and
above on stderr, one message a line, as they were written.

Used as a library (``fl_lightning.fit``), the package configures no logging: warnings reach stderr through
Python's last-resort handler, and ``logging.getLogger("fl_lightning").setLevel(logging.INFO)`` with a handler
of one's own shows the notes too.
"""

from __future__ import annotations

import logging
import sys

PACKAGE = "fl_lightning"


class StderrHandler(logging.StreamHandler):
    """Writes to ``sys.stderr`` as it is at each message (a redirected or captured stream included)."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))
        self.addFilter(lambda record: record.name == PACKAGE or record.name.startswith(PACKAGE + "."))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler sets it; the handler always writes to the stderr of the moment
        pass


def show_messages() -> None:
    """Shows the package's notes and warnings on stderr (once, however often a command runs in a process).

    The handler sits on the root logger, so a part of the package that shows a run's messages its own way
    (a sweep's trials prefix theirs with the trial) stops them from propagating there.
    """
    logging.getLogger(PACKAGE).setLevel(logging.INFO)
    root = logging.getLogger()
    if not any(isinstance(handler, StderrHandler) for handler in root.handlers):
        root.addHandler(StderrHandler())
