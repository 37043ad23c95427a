"""The one exception type users see: a sentence saying what is wrong and how to fix it."""


class ConfigError(ValueError):
    """Bad input from a recipe, a command line or the file system.

    The CLI prints its message as one line and exits non-zero, without a traceback, so every
    message must name what is wrong and how to fix it.
    """


class RankLost(ConfigError):
    """One of several ranks lost contact with the others mid-run (one of them ended): the run stops, its last
    checkpoint intact. Under ``flrun fit --runtime.devices N`` the launcher says which rank ended and how."""
