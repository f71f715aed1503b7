"""Helpers for testing code that uses rate limits."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime

from . import clock, deny_cache
from .algorithms import MICRO

__all__ = ["frozen_clock"]


class FrozenClock:
    """A pinned time that a test can move forwards or backwards."""

    def __init__(self, seconds: float) -> None:
        self.set(seconds)

    def set(self, seconds: float) -> None:
        clock.freeze(round(seconds * MICRO))

    def advance(self, seconds: float) -> None:
        now = clock.frozen()
        assert now is not None
        clock.freeze(now + round(seconds * MICRO))

    @property
    def now(self) -> float:
        now = clock.frozen()
        assert now is not None
        return now / MICRO


@contextmanager
def frozen_clock(at: float | datetime = 1_700_000_000.0) -> Iterator[FrozenClock]:
    """Pin the limiter's clock (store and app clocks alike) for the duration of a block.

    ``at`` is seconds since the epoch or an aware datetime. The yielded object has
    ``advance(seconds)`` and ``set(seconds)``. Meant for tests: it affects every limit
    in this process.
    """
    previous = clock.frozen()
    seconds = at.timestamp() if isinstance(at, datetime) else at
    # A denial remembered at an earlier test's pinned time would look fresh at this one's,
    # though the test database or Redis was emptied between them.
    deny_cache.clear()
    try:
        yield FrozenClock(seconds)
    finally:
        clock.freeze(previous)
