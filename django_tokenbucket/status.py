"""What a rate-limit decision tells its caller."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["MultiStatus", "Status"]


def ambiguous_truth(kind: str) -> TypeError:
    """Return the error for ``bool()`` of a decision's result.

    "true when allowed" and "true when there is a result" are both natural readings, and
    each silently breaks code written for the other: ``if limiter.limit(...)`` reads as
    the first, ``status and status.retry_after`` (a RESPONSE callable, a template's
    ``{% if status %}``) as the second, and the demo and our own docs fell for it. Asking
    for ``.ok`` costs three characters and is never misread.
    """
    return TypeError(
        f"a {kind} has no truth value: test .ok for whether the call was allowed, "
        f"or `is not None` for whether there is a {kind}"
    )


@dataclass(frozen=True)
class Status:
    """The outcome of one ``limit()`` or ``check()`` call on one limit.

    ``value`` is the number of tokens left after the call when allowed (negative when
    reserved ahead), the number now when denied. ``retry_after`` is in seconds: when
    denied, until the same call would succeed (None if it never can); when allowed with
    a reservation, until the reserved tokens exist; otherwise None. ``reset_after`` is
    the time until the limit is full again, and ``timestamp`` the store's time of the
    decision, in seconds since the epoch.

    Test ``status.ok``: ``bool(status)`` raises TypeError rather than guess which of
    "allowed" and "present" the caller meant.
    """

    ok: bool
    name: str
    key: object
    count: float
    value: float | None
    retry_after: float | None
    reset_after: float | None
    capacity: float
    rate: float
    period: float
    timestamp: float | None
    #: True when the store failed and FAIL_OPEN let the call through undecided.
    failed_open: bool = False
    #: True when the limit is in shadow mode: it never blocks (``ok`` is always True)...
    shadow: bool = False
    #: ...and this is True when it would have denied the call.
    would_deny: bool = False
    #: True when this denial came from this process' memory of the key's last denial
    #: (``django_tokenbucket.deny_cache``), the store unasked; never on an allowed call.
    cached: bool = False
    #: The runtime override that applied (``limiter.override``, ``exempt``, ``block``):
    #: ``"limit"``, ``"exempt"``, ``"block"``, or None when the limit applied as configured.
    override: str | None = None

    @classmethod
    def _decided(
        cls,
        ok: bool,
        name: str,
        key: object,
        count: float,
        value: float,
        retry_after: float | None,
        reset_after: float,
        capacity: float,
        rate: float,
        period: float,
        timestamp: float,
        shadow: bool,
        would_deny: bool,
        cached: bool = False,
        override: str | None = None,
    ) -> Status:
        """Return the Status of a decision, as ``Status(...)`` would make it, only faster.

        Every decision makes one, and the __init__ of a frozen dataclass sets each of the
        16 fields through ``object.__setattr__``: filling ``__dict__`` at once costs a
        third as much. tests/test_fast_path.py keeps the two equal.
        """
        status = object.__new__(cls)
        status.__dict__.update(
            ok=ok,
            name=name,
            key=key,
            count=count,
            value=value,
            retry_after=retry_after,
            reset_after=reset_after,
            capacity=capacity,
            rate=rate,
            period=period,
            timestamp=timestamp,
            failed_open=False,
            shadow=shadow,
            would_deny=would_deny,
            cached=cached,
            override=override,
        )
        return status

    @property
    def remaining(self) -> int:
        """Return the whole tokens left (never negative), as RateLimit headers show them."""
        if self.value is None:
            return 0
        return max(0, math.floor(self.value))

    @property
    def retry_after_header(self) -> int | None:
        """Return ``retry_after`` as HTTP delay-seconds: rounded up, at least 1."""
        if self.retry_after is None:
            return None
        return max(1, math.ceil(self.retry_after))

    def __bool__(self) -> bool:
        raise ambiguous_truth("Status")


class MultiStatus(tuple[Status, ...]):
    """The statuses of several limits decided all-or-nothing, in the order asked."""

    def __new__(cls, statuses: Sequence[Status]) -> MultiStatus:
        return super().__new__(cls, tuple(statuses))

    @property
    def ok(self) -> bool:
        return all(status.ok for status in self)

    @property
    def denied(self) -> tuple[Status, ...]:
        return tuple(status for status in self if not status.ok)

    @property
    def retry_after(self) -> float | None:
        """Return the longest wait among the statuses that have one (the binding limit)."""
        relevant = self.denied if not self.ok else self
        waits = [s.retry_after for s in relevant]
        if not self.ok and any(w is None for w in waits):
            return None
        known = [w for w in waits if w is not None]
        return max(known) if known else None

    @property
    def timestamp(self) -> float | None:
        """Return the store's time of the decision (one time serves the whole group)."""
        return self[0].timestamp if len(self) else None

    def __bool__(self) -> bool:
        raise ambiguous_truth("MultiStatus")
