"""The ``flrun`` command line: ``fit``, ``models``, ``data``, ``sweep``, ``report`` and ``table``.

Owns argument handling per command and the one-line error at exit status 2. The top layer: it may import
every other package, and none imports it.
"""

from .commands import main

__all__ = ["main"]
