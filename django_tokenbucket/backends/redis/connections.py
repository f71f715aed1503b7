"""The clients the backend talks through: Redis Cluster's connection factory, and what a
client will do on its own when a command fails (retry it, or not).
"""

from __future__ import annotations

import os
import re
import select
import threading
from typing import Any

from django_redis.pool import ConnectionFactory
from redis import __version__ as redis_version
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

__all__ = [
    "ClusterConnectionFactory",
    "after_fork_in_child",
    "give_back",
    "lease",
    "packed_read",
    "run_on_link",
    "script_pool",
]


class ClusterConnectionFactory(ConnectionFactory):  # type: ignore[misc]
    """A django-redis connection factory that returns redis-py's ``RedisCluster`` client.

    Use it for a cache whose ``LOCATION`` is the URL of any node of a Redis Cluster::

        CACHES["ratelimit"] = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": "redis://10.0.0.1:7000",
            "OPTIONS": {"CONNECTION_FACTORY": "django_tokenbucket.backends.redis.ClusterConnectionFactory"},
        }

    ``PASSWORD``, ``USERNAME``, ``SOCKET_TIMEOUT``, ``SOCKET_CONNECT_TIMEOUT`` and
    ``REDIS_CLIENT_KWARGS`` are passed on. One client per process and configuration is
    shared, since each discovers the cluster's topology.
    """

    _clusters: dict[tuple[str, str], RedisCluster] = {}
    _lock = threading.Lock()

    def get_connection(self, params: dict[str, Any]) -> RedisCluster:
        kwargs = {k: v for k, v in params.items() if k not in ("url", "parser_class")}
        kwargs.update(self.redis_client_cls_kwargs)
        cache_key = (str(params["url"]), repr(sorted(kwargs.items())))
        with self._lock:
            client = self._clusters.get(cache_key)
            if client is None:
                client = self._clusters[cache_key] = RedisCluster.from_url(params["url"], **kwargs)
        return client

    def disconnect(self, connection: Any) -> None:
        connection.disconnect_connection_pools()


def _client_retries(client: Any) -> bool:
    """Whether redis-py may send a command again after a connection error or timeout."""
    if isinstance(client, (RedisCluster, AsyncRedisCluster)):
        return True
    options = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    retry = options.get("retry")
    return bool(
        options.get("retry_on_timeout")
        or options.get("retry_on_error")
        or (retry is not None and retry.get_retries() > 0)
    )


def _may_have_run(client: Any, exc: BaseException) -> bool:
    """Whether the script may have run although the call on ``client`` failed (see ``_script_may_have_run``)."""
    sent = getattr(exc, "tokenbucket_sent", None)
    if sent is not None:  # the backend made the call itself (``bounded``): it knows
        return bool(sent)
    if _client_retries(client):
        return True
    if isinstance(exc, ResponseError):  # Redis answered: the script failed or never ran
        return False
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError)) and "connecting" not in str(exc)


def script_pool(client: Any) -> Any:
    """The pool to run the decision script on directly (``run_on_link``), else None: a
    client of one server that never sends a command again on its own."""
    pool = _single_server_pool(client)
    return None if pool is None or _client_retries(client) else pool


def run_on_link(pool: Any, *command: Any) -> Any:
    """Send ``command`` on a connection of ``pool`` and return its reply.

    What redis-py's ``execute_command`` does on a client without retries, without its
    per-call hooks (event dispatch, observability, the retry wrapper): about a tenth
    of a decision's time at the floor (issue 35, item 5). A failure says whether the
    command was sent, as ``bounded`` does, for ``_may_have_run``.
    """
    try:
        link = lease(pool)
    except (RedisError, OSError) as exc:
        exc.tokenbucket_sent = False  # type: ignore[union-attr]
        raise
    try:
        link.send_packed_command(link.pack_command(*command))
        return link.read_response()
    except ResponseError:
        raise  # the reply was read: the connection is in step
    except (RedisError, OSError) as exc:
        link.disconnect()
        exc.tokenbucket_sent = True  # type: ignore[union-attr]
        raise
    except BaseException:
        link.disconnect()
        raise
    finally:
        give_back(pool, link)


class _Spares:
    """The connections that this process' decisions on one pool hand to each other.

    redis-py's ``get_connection`` and ``release`` cost 5 µs a call together (a lock,
    events, observability): about 7 % of a decision, and what stood between the Redis
    backend and issue 35's floor (1.1× a raw ``EVALSHA``). A decision takes a spare
    instead, checked for what the pool checks in what it lends (a socket the server closed is
    connected again, not written to), and puts it back after its reply, or after
    disconnecting it when the call failed. The pool lends each spare once and counts it
    in use from then on, so the spares are at most a quarter of its ``max_connections``:
    the cache's other users keep the rest. A blocking pool keeps its own lending. A
    forked child starts with none (the parent's sockets are not its own).
    """

    __slots__ = ("links", "most", "pid")

    def __init__(self, most: int) -> None:
        self.pid = os.getpid()
        self.most = most
        self.links: list[Any] = []


#: The attribute of a pool that holds its _Spares: they live and go with the pool.
_SPARES = "_django_tokenbucket_spares"
_spares_made = threading.Lock()


def after_fork_in_child() -> None:
    """Give a forked child locks of its own (``django_tokenbucket.lifecycle``)."""
    # A fork while another thread held a lock would leave the child's copy held.
    global _spares_made
    _spares_made = threading.Lock()
    ClusterConnectionFactory._lock = threading.Lock()


def _spares_of(pool: Any) -> _Spares | None:
    """The spare connections of ``pool`` in this process, or None where the pool's own
    lending must stay in charge (a blocking pool, or one of very few connections)."""
    spares = getattr(pool, _SPARES, None)
    if spares is None or spares.pid != os.getpid():
        most = getattr(pool, "max_connections", 0) // 4
        if most < 1 or hasattr(pool, "queue_class"):
            return None
        with _spares_made:  # two threads' first calls must not keep two lists
            spares = getattr(pool, _SPARES, None)
            if spares is None or spares.pid != os.getpid():
                spares = _Spares(most)
                setattr(pool, _SPARES, spares)
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
                stale = _closed_by_server(link)
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
    return _pooled_connection(pool)


#: A spare's poll(2) object and the socket it watches (a reconnection makes another socket).
_WATCH = "_django_tokenbucket_watch"
_POLLS = hasattr(select, "poll")  # not on Windows


def _closed_by_server(link: Any) -> bool:
    """Whether ``link`` is disconnected, or has something to read before anything was
    asked (the server closed it): what the pool's ``can_read()`` check tells, in one
    poll(2) where that makes four system calls (the socket made non-blocking, a read,
    and back). A RESP3 push message waiting on the socket counts as closed: the link
    connects again, which is always safe; one already in the parser's buffer is read
    by the next ``read_response``, as after ``can_read()``.
    """
    sock = getattr(link, "_sock", None)
    if sock is None:
        return True
    if not _POLLS or not hasattr(link, "__dict__"):
        return bool(link.can_read())
    watch = link.__dict__.get(_WATCH)
    if watch is None or watch[0] is not sock:
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        watch = link.__dict__[_WATCH] = (sock, poller)
    return bool(watch[1].poll(0))


def give_back(pool: Any, link: Any) -> None:
    """Return a connection that ``lease`` gave, its reply read (or disconnected)."""
    spares = _spares_of(pool)
    if spares is None or len(spares.links) >= spares.most:
        pool.release(link)
    else:
        spares.links.append(link)


def _single_server_pool(client: Any) -> Any:
    """The connection pool of a client of one server (Sentinel's included), else None."""
    if isinstance(client, (RedisCluster, AsyncRedisCluster)) or getattr(client, "connection", None) is not None:
        return None  # a cluster, or a client holding a single connection of its own
    return getattr(client, "connection_pool", None)


def _pooled_connection(pool: Any) -> Any:
    """A connection of ``pool`` (of the asyncio client: an awaitable of one)."""
    # redis-py 5.3 deprecated the command name that earlier versions require.
    return pool.get_connection() if _POOL_TAKES_NO_COMMAND else pool.get_connection("GET")


_POOL_TAKES_NO_COMMAND = tuple(map(int, re.findall(r"\d+", redis_version)[:2])) >= (5, 3)


def packed_read(commands: list[tuple[str, ...]]) -> list[bytes] | None:
    """A read first's ``GET key`` (and ``TIME``) as RESP, the bytes redis-py's
    ``pack_commands`` writes for them at a fifteenth of its cost (every denial of a hot
    key is read first); None for a key that is not ASCII, left to the client's encoding."""
    key = commands[0][1]
    if not key.isascii():
        return None
    data = key.encode()
    get = b"*2\r\n$3\r\nGET\r\n$%d\r\n%b\r\n" % (len(data), data)
    return [get + _TIME if len(commands) == 2 else get]  # a list, as send_packed_command takes


_TIME = b"*1\r\n$4\r\nTIME\r\n"
