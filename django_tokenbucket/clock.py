"""Where "now" comes from when the store has no clock of its own, and how tests pin it."""

from __future__ import annotations

import time

__all__ = ["app_now", "override"]

#: Set by ``django_tokenbucket.testing.frozen_clock``; backends use it instead of the
#: store's clock so that tests can make exact assertions without sleeping.
_override: int | None = None


def override() -> int | None:
    """Return the pinned time in microseconds, or None when the real clock applies."""
    return _override


def app_now() -> int:
    """Return this host's time in microseconds since the epoch (or the pinned time)."""
    if _override is not None:
        return _override
    return time.time_ns() // 1000
