"""A client-side deadline on a database connection (the database backend's ``TIMEOUT``).

psycopg has no read timeout: when the server, or something on the route to it, stops
answering on a connection that is already open, a query waits for as long as TCP
keeps the connection (minutes, or for ever behind a proxy that still acknowledges).
``connect_timeout`` only bounds new connections, and ``statement_timeout`` is enforced
by the very server that is not answering. So one thread per process watches the
sockets of decisions in progress and shuts down any that outlives its deadline: the
blocked read returns at once with an error, the decision takes the fail mode, and
the server rolls the transaction back when it sees the connection gone.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["Watch", "after_fork_in_child", "watching"]


class Watch:
    """One socket and the monotonic time after which it is shut down."""

    __slots__ = ("deadline", "fd", "fired")

    def __init__(self, fd: int, deadline: float) -> None:
        self.fd = fd
        self.deadline = deadline
        self.fired = False


class _Watchdog:
    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._watches: set[Watch] = set()
        self._thread: threading.Thread | None = None

    def reset_after_fork(self) -> None:
        # The child has no watchdog thread, and the parent's may have held the lock.
        self.__init__()  # type: ignore[misc]

    def add(self, watch: Watch) -> None:
        with self._condition:
            if self._thread is None or not self._thread.is_alive():
                thread = threading.Thread(target=self._run, name="django_tokenbucket-deadline", daemon=True)
                thread.start()  # raises RuntimeError when no thread can start: no watch is made
                self._thread = thread
            self._watches.add(watch)
            self._condition.notify()

    def remove(self, watch: Watch) -> None:
        # Under the lock: once this returns, the watchdog will not touch the socket.
        with self._condition:
            self._watches.discard(watch)

    def _run(self) -> None:
        with self._condition:
            while True:
                now = time.monotonic()
                for watch in [w for w in self._watches if w.deadline <= now]:
                    self._watches.discard(watch)
                    watch.fired = True
                    _shut_down(watch.fd)
                next_deadline = min((w.deadline for w in self._watches), default=None)
                self._condition.wait(None if next_deadline is None else next_deadline - now)


def _shut_down(fd: int) -> None:
    try:
        sock = socket.socket(fileno=fd)
    except OSError:  # pragma: no cover - not a socket after all
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # already closed by the peer
    finally:
        # The watch owns this descriptor (a duplicate), so closing it is safe.
        sock.detach()


_watchdog = _Watchdog()


def after_fork_in_child() -> None:
    """Start a forked child with a watchdog of its own ``(``django_tokenbucket.lifecycle``)``."""
    _watchdog.reset_after_fork()


@contextmanager
def watching(fileno: int, seconds: float) -> Iterator[Watch]:
    """Shut the socket ``fileno`` down if the block is still running after ``seconds``.

    The watch holds a duplicate of the descriptor, so the number cannot be reused
    for another socket while it is watched, even if the connection is closed inside
    the block. ``Watch.fired`` tells the block's owner that the deadline passed.
    Raises OSError (no descriptor left) or RuntimeError (no thread can start).
    """
    watch = Watch(os.dup(fileno), time.monotonic() + seconds)
    try:
        _watchdog.add(watch)
        yield watch
    finally:
        _watchdog.remove(watch)
        os.close(watch.fd)
