"""The one error type for bad user input (config, data, checkpoint).

It lives in the lowest package so that ``models``, ``parallelisms`` and ``trainer`` can
all raise it without breaking the dependency direction (models <- parallelisms <- trainer).
"""


class ConfigError(ValueError):
    """Bad user input. The message names the offending value and how to fix it."""
