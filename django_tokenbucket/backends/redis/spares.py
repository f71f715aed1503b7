"""Spare connections: what a Redis decision takes instead of asking redis-py's pool.

redis-py's ``get_connection`` and ``release`` cost a lock, events, observability and a
``can_read()`` check of four system calls per call: measured at ~16 µs of a ~78 µs
decision (issue 50; docs/benchmarks.md). A decision takes a spare instead, checked for
what the pool checks in what it lends (a socket the server closed is connected again,
not written to), and puts it back after its reply, or after disconnecting it when the
call failed. The pool lends each spare once and counts it in use from then on, so the
spares are at most a quarter of its ``max_connections``: the cache's other users keep
the rest. A ``BlockingConnectionPool`` keeps its own lending. A forked child starts with
none (the parent's sockets are not its own).

This module is the only one of the package that reads a private name of redis-py, and
it reads one:

- ``Connection._sock``: the connection's socket, None while it is disconnected. A
  spare without one is connected again; one with one is polled (one ``poll(2)``) for
  data or an end of file that came before anything was asked.

Nothing is written onto redis-py's objects: each pool's spares are kept in a
``WeakKeyDictionary`` keyed by the pool, and go with it. A connection without a
``_sock`` attribute (another redis-py, another connection class) is neither kept nor
polled: it goes back to the pool, and the pool's own lending serves every call.
``tests/test_redis.py`` fails when redis-py's connections stop having it.
"""

from __future__ import annotations

import os
import re
import select
import threading
import weakref
from typing import Any

from redis import BlockingConnectionPool
from redis import __version__ as redis_version
from redis.exceptions import RedisError

__all__ = ["give_back", "knows", "lease", "pooled_connection"]

#: What ``getattr`` returns for a connection without the socket attribute read here.
_UNKNOWN = object()
_POLLS = hasattr(select, "poll")  # not on Windows


class _Spares:
    """The connections that this process' decisions on one pool hand to each other, and
    each one's poll(2) object with the socket it watches (by ``id`` of the connection;
    a reconnection makes another socket)."""

    __slots__ = ("links", "most", "pid", "watches")

    def __init__(self, most: int) -> None:
        self.pid = os.getpid()
        self.most = most
        self.links: list[Any] = []
        self.watches: dict[int, tuple[Any, Any]] = {}


_by_pool: weakref.WeakKeyDictionary[Any, _Spares] = weakref.WeakKeyDictionary()
_made = threading.Lock()


def after_fork_in_child() -> None:
    """Give a forked child a lock of its own (``django_tokenbucket.lifecycle``)."""
    # A fork while another thread held the lock would leave the child's copy held.
    global _made
    _made = threading.Lock()


def knows(link: Any) -> bool:
    """Whether ``link`` has the socket attribute this module reads (``Connection._sock``)."""
    return getattr(link, "_sock", _UNKNOWN) is not _UNKNOWN


def _spares_of(pool: Any) -> _Spares | None:
    """The spare connections of ``pool`` in this process, or None where the pool's own
    lending must stay in charge (a blocking pool, or one of very few connections)."""
    spares = _by_pool.get(pool)
    if spares is None or spares.pid != os.getpid():
        most = getattr(pool, "max_connections", 0) // 4
        if most < 1 or isinstance(pool, BlockingConnectionPool):
            return None
        with _made:  # two threads' first calls must not keep two lists
            spares = _by_pool.get(pool)
            if spares is None or spares.pid != os.getpid():
                spares = _by_pool[pool] = _Spares(most)
    return spares


def lease(pool: Any) -> Any:
    """A connection of ``pool`` for one call: a spare, else one the pool lends."""
    spares = _spares_of(pool)
    if spares is not None and spares.links:
        try:
            link = spares.links.pop()  # atomic: two threads never take the same spare
        except IndexError:  # another thread took the last one meanwhile
            pass
        else:
            # As the pool checks what it lends: data or an end of file before anything
            # was asked means the server closed it (a restart, a failover, idle clients
            # timed out), and it connects again before a command is written to it. A
            # spare that a failed call disconnected connects here too, so that a failure
            # to connect is raised before anything is sent.
            try:
                stale = _closed_by_server(spares, link)
            except (RedisError, OSError):
                stale = True
            if stale:
                link.disconnect()
                try:
                    link.connect()
                except BaseException:
                    give_back(pool, link)
                    raise
            return link
    return pooled_connection(pool)


def _closed_by_server(spares: _Spares, link: Any) -> bool:
    """Whether ``link`` is disconnected, or has something to read before anything was
    asked (the server closed it): what the pool's ``can_read()`` check tells, in one
    poll(2) where that makes four system calls (the socket made non-blocking, a read,
    and back). A RESP3 push message waiting on the socket counts as closed: the link
    connects again, which is always safe; one already in the parser's buffer is read
    by the next ``read_response``, as after ``can_read()``.
    """
    sock = link._sock
    if sock is None:
        return True
    if not _POLLS:
        return bool(link.can_read())
    watch = spares.watches.get(id(link))
    if watch is None or watch[0] is not sock:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        watch = spares.watches[id(link)] = (sock, poller)
    return bool(watch[1].poll(0))


def give_back(pool: Any, link: Any) -> None:
    """Return a connection that ``lease`` gave, its reply read (or disconnected)."""
    spares = _spares_of(pool)
    if spares is None or len(spares.links) >= spares.most or not knows(link):
        if spares is not None:
            spares.watches.pop(id(link), None)
        pool.release(link)
    else:
        spares.links.append(link)


def pooled_connection(pool: Any) -> Any:
    """A connection of ``pool`` from its own lending (of the asyncio client: an awaitable of one)."""
    # redis-py 5.3 deprecated the command name that earlier versions require.
    return pool.get_connection() if _POOL_TAKES_NO_COMMAND else pool.get_connection("GET")


_POOL_TAKES_NO_COMMAND = tuple(map(int, re.findall(r"\d+", redis_version)[:2])) >= (5, 3)
