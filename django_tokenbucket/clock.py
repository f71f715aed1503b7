"""Where "now" comes from when the store has no clock of its own, and how tests pin it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

__all__ = ["app_now", "freeze", "frozen", "override", "pinned"]

#: Set by ``freeze`` (``django_tokenbucket.testing.frozen_clock``); backends use it
#: instead of the store's clock so that tests can make exact assertions without sleeping.
_override: int | None = None

#: Set for the duration of one decision by ``pinned``: a DRF throttle whose ``timer``
#: a test replaced decides at that time. A context variable, so that it stays with the
#: thread or task that set it.
_pinned: ContextVar[int | None] = ContextVar("django_tokenbucket_pinned_clock", default=None)


def override() -> int | None:
    """Return the pinned time in microseconds, or None when the real clock applies."""
    pinned_now = _pinned.get()
    return _override if pinned_now is None else pinned_now


def freeze(microseconds: int | None) -> None:
    """Pin every decision of this process at ``microseconds`` since the epoch; None lets
    the real clock apply again. (``pinned`` pins one context's decisions, and wins.)"""
    global _override
    _override = microseconds


def frozen() -> int | None:
    """Return the time ``freeze`` pinned, in microseconds, or None when it pinned none."""
    return _override


def app_now() -> int:
    """Return this host's time in microseconds since the epoch (or the pinned time)."""
    now = override()
    return time.time_ns() // 1000 if now is None else now


@contextmanager
def pinned(microseconds: int) -> Iterator[None]:
    """Decide at ``microseconds`` since the epoch inside the block (this context only)."""
    token = _pinned.set(microseconds)
    try:
        yield
    finally:
        _pinned.reset(token)
