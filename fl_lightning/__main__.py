import sys

from .distributed.gpu_share import follow_parent

follow_parent()  # a child of another flrun command (a table's run, a rank) ends with it
from .cli.commands import main  # noqa: E402 - after the parent is followed: the imports take seconds

sys.exit(main())
