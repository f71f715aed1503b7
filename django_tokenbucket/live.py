"""What a stored bucket holds now: the live view shared by the admin, the command and cleanup.

A bucket is stored as ``(value, ts)`` (a database row, a Redis value); the tokens it
holds *now* follow from those two numbers, the limit's config and the store's clock.
Everything here derives that with the same pure functions the backends decide with
(``LimitConfig.decide``); ``backends.database.filters`` does the same for many rows at
once, in SQL.
"""

from __future__ import annotations

from dataclasses import dataclass

from .algorithms import MICRO, State
from .limits import LimitConfig

__all__ = [
    "FULL",
    "LIMITED",
    "PARTIAL",
    "STATES",
    "LiveState",
    "cleanup_span",
    "is_idle",
    "live_state",
    "one_token",
    "refill_time",
]

LIMITED = "limited"
PARTIAL = "partial"
FULL = "full"
#: The states a row can be in now, for filters and summaries.
STATES = (LIMITED, PARTIAL, FULL)


def one_token(limit: LimitConfig) -> int:
    """Return what "a call can pass" means for ``limit``: one token, or all of a smaller capacity."""
    return min(MICRO, limit.capacity)


@dataclass(frozen=True)
class LiveState:
    """The state of one row now. Amounts in micro-tokens, durations in microseconds."""

    value: int
    capacity: int
    #: Until the limit is full again (0 when full).
    full_after: int
    #: Until one token (or the whole capacity, when smaller) is there; 0 when it is.
    next_token_after: int
    #: When the store read "now", in µs since the epoch.
    now: int
    threshold: int

    @property
    def state(self) -> str:
        """Return LIMITED (a one-token call would be denied now), PARTIAL or FULL."""
        if self.value >= self.capacity:
            return FULL
        if self.value < self.threshold:
            return LIMITED
        return PARTIAL

    @property
    def fill(self) -> float:
        """Return how full the limit is, from 0 (empty or in debt) to 1."""
        return max(0.0, min(1.0, self.value / self.capacity))

    @property
    def tokens(self) -> float:
        return self.value / MICRO


def live_state(limit: LimitConfig, state: State | None, key_digest: str, now: int) -> LiveState:
    """Return what a row with ``state`` (None: nothing stored) holds at ``now`` under ``limit``'s current config."""
    # reserve=True makes the probe an allowed zero-token call for any value the limit
    # can hold, so the decision reports the value now without a denial's special cases.
    probe = limit.decide(state, now, 0, key_digest, reserve=True)
    threshold = one_token(limit)
    next_token = 0
    if probe.value < threshold:
        wait = limit.decide(state, now, threshold, key_digest).retry_after
        next_token = 0 if wait is None else wait
    return LiveState(
        value=probe.value,
        capacity=limit.capacity,
        full_after=probe.full_after,
        next_token_after=next_token,
        now=now,
        threshold=threshold,
    )


def is_idle(limit: LimitConfig, state: State, key_digest: str, now: int) -> bool:
    """Return whether the row may be deleted: from ``now`` on, it decides like a fresh key.

    A token bucket qualifies once it is full (a full bucket and a fresh one are the
    same state); a fixed window once it is full, which puts it on the configured
    windows too (a row stored under another ``period`` or ``start`` moves onto them).
    """
    probe = limit.decide(state, now, 0, key_digest, reserve=True)
    fresh = limit.decide(None, now, 0, key_digest, reserve=True)
    return probe.allowed and probe.state == fresh.state


def cleanup_span(limit: LimitConfig) -> int:
    """Return an idle time (µs) after which every row not in debt is full.

    Rows last written before ``now - cleanup_span`` are cleanup's candidates: an index
    range on ``(name, ts)`` finds them, and ``is_idle`` confirms each one.
    """
    return refill_time(limit, limit.capacity)


def refill_time(limit: LimitConfig, amount: int) -> int:
    """Return the time (µs) after which a row holding 0 or more holds at least ``amount``."""
    return limit.algorithm.refill_time(amount, limit.rate, limit.period)
