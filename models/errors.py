"""The one error type for bad user input (config, data, checkpoint).

It lives in the lowest package so that ``models``, ``parallelisms`` and ``trainer`` can
all raise it without breaking the dependency direction (models <- parallelisms <- trainer).
"""

from __future__ import annotations

from collections.abc import Collection

__all__ = ["ConfigError", "check_choice"]


class ConfigError(ValueError):
    """Bad user input. The message names the offending value and how to fix it."""


def check_choice(value: object, allowed: Collection[object], key: str) -> None:
    """Raise ``ConfigError`` unless ``value`` is one of ``allowed``; the one copy of the choice check."""
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not one of {list(allowed)}; set {key} to one of them.")
