"""Fail fast per node: a circuit breaker for each Redis node (``host:port``) of a process.

A node that no connection can be made to (refused, or timed out) is left
alone for a short, growing back-off (``FIRST_BACKOFF`` doubling to ``MAX_BACKOFF``):
decisions whose keys live there fail at once, without a connection attempt, rather
than each spending the client's connection retries, which in a worker or an event
loop shared with healthy keys slows those too. When the back-off has passed, one call
at a time (the probe) goes through: if the node answers, it is closed again; if not,
the next back-off is twice as long. On a cluster the breaker is keyed by the node the
client's slot table names; after a failover the probe, finding the old primary gone,
reads the topology again and reaches the promoted replica.

``Breaker`` is the state machine of one node, with an injectable clock; ``BREAKERS``
holds those of the process, shared by the sync and the asyncio clients, and starts
empty in a forked child (a child must find out for itself).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

__all__ = ["BREAKERS", "FIRST_BACKOFF", "MAX_BACKOFF", "Breaker", "Breakers", "after_fork_in_child"]

#: Seconds a node is left alone after its first failure, and at most.
FIRST_BACKOFF = 0.05
MAX_BACKOFF = 1.0


class Breaker:
    """The state of one node: closed (calls go through), open (they fail at once) or
    probing (one call is finding out whether the node answers again).

    ``allow()`` says whether a call may go to the node; a call it lets through must end
    with ``succeeded()`` or ``failed()``. A probe that never reports (its caller was
    cancelled) is given up after the current back-off, and another call probes.
    Not thread-safe by itself: ``Breakers`` serialises the calls.
    """

    __slots__ = ("backoff", "clock", "failures", "opened_until", "probe_until", "rejected")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        #: Consecutive failures; 0 when closed.
        self.failures = 0
        #: The back-off now in force (seconds), and the time before which calls fail.
        self.backoff = 0.0
        self.opened_until = 0.0
        #: While a probe is out: the time after which it is taken as lost.
        self.probe_until: float | None = None
        #: Calls failed at once, without a connection attempt (for tests and operations).
        self.rejected = 0

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"probing"``."""
        if self.failures == 0:
            return "closed"
        if self.probe_until is not None and self.clock() < self.probe_until:
            return "probing"
        return "open"

    def allow(self) -> bool:
        """Whether a call may go to the node now (when open: True for one probe)."""
        if self.failures == 0:
            return True
        now = self.clock()
        if now < self.opened_until or (self.probe_until is not None and now < self.probe_until):
            self.rejected += 1
            return False
        self.probe_until = now + max(self.backoff, FIRST_BACKOFF)
        return True

    def succeeded(self) -> None:
        """The node answered: close."""
        self.failures = 0
        self.backoff = 0.0
        self.opened_until = 0.0
        self.probe_until = None

    def failed(self) -> None:
        """The node could not be reached: open for the next back-off."""
        self.failures += 1
        self.backoff = min(MAX_BACKOFF, FIRST_BACKOFF * 2 ** (self.failures - 1))
        self.opened_until = self.clock() + self.backoff
        self.probe_until = None

    def remaining(self) -> float:
        """Seconds until the node may be probed again (0 when it may be now)."""
        return max(0.0, self.opened_until - self.clock())


class Breakers:
    """The breakers of a process, by node name, created on first use."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[str, Breaker] = {}

    def reset_after_fork(self) -> None:
        # The parent's lock may have been held at the fork; its verdicts are not the child's.
        self._lock = threading.Lock()
        self._nodes = {}

    def get(self, node: str) -> Breaker:
        """The breaker of ``node`` (for tests and operations)."""
        with self._lock:
            breaker = self._nodes.get(node)
            if breaker is None:
                breaker = self._nodes[node] = Breaker(self.clock)
            return breaker

    def allow(self, node: str) -> bool:
        breaker = self._nodes.get(node)
        if breaker is None or breaker.failures == 0:
            return True  # the common case, without the lock
        with self._lock:
            return breaker.allow()

    def succeeded(self, node: str) -> None:
        breaker = self._nodes.get(node)
        if breaker is None or breaker.failures == 0:
            return
        with self._lock:
            breaker.succeeded()

    def failed(self, node: str) -> None:
        breaker = self.get(node)
        with self._lock:
            breaker.failed()

    def rejected(self) -> int:
        """Calls failed at once on every node, since the process started (or forked)."""
        with self._lock:
            return sum(breaker.rejected for breaker in self._nodes.values())

    def clear(self) -> None:
        """Forget every node (tests)."""
        with self._lock:
            self._nodes.clear()


#: The process's breakers, shared by every Redis backend and client in it.
BREAKERS = Breakers()


def after_fork_in_child() -> None:
    """Start a forked child with no verdict on any node (``django_tokenbucket.lifecycle``)."""
    BREAKERS.reset_after_fork()
