"""redis-py asyncio clients for the Redis backend's async API, on a django-redis cache's settings.

django-redis only makes blocking clients. This module reads the same ``CACHES[alias]``
and builds the asyncio client that django-redis' connection factory would have built
as a blocking one, for the primary (the first ``LOCATION``, where django-redis writes):

- ``django_redis.pool.ConnectionFactory`` (the default): ``redis.asyncio.Redis`` on a
  pool ``from_url`` with the same ``USERNAME``, ``PASSWORD``, ``SOCKET_TIMEOUT``,
  ``SOCKET_CONNECT_TIMEOUT``, ``CONNECTION_POOL_KWARGS`` and ``REDIS_CLIENT_KWARGS``;
- ``django_redis.pool.SentinelConnectionFactory``: ``redis.asyncio.sentinel.Sentinel``
  on ``SENTINELS`` (with ``SENTINEL_KWARGS``) and a sentinel-managed pool for the
  service named by the URL's host (``is_master`` as in the URL, the master by default),
  which is what ``Sentinel.master_for`` makes;
- ``django_tokenbucket.backends.redis.ClusterConnectionFactory``:
  ``redis.asyncio.cluster.RedisCluster.from_url``.

Where the cache sets no ``SOCKET_TIMEOUT`` and a deadline is in force, the connect
timeout the cache leaves unset is half the deadline (as on the sync path, ``clients``)
and replies get no socket timeout: ``asyncio.timeout`` cuts every wait of a call.

The blocking classes these settings may name (``CONNECTION_POOL_CLASS``,
``REDIS_CLIENT_CLASS``, ``PARSER_CLASS``, a ``connection_class`` or ``retry`` in the
kwargs) are replaced by their asyncio counterparts. A setting that has none (a
connection factory or client class of your own, django-redis' ``ShardClient``) cannot be
mirrored: the async API then runs the blocking client in a worker thread, as before,
and ``AsyncioClients.thread_reason`` says why. Options the asyncio classes refuse are an
ImproperlyConfigured naming the cache and the option.

An asyncio client belongs to the event loop it first ran on, so there is one per
running loop, built on its first call there and again after ``CACHES`` changed. It is
closed when its loop shuts down (``asyncio.run``, ASGI servers and asgiref close the
loop's async generators first, and a generator here closes the client), and forgotten
with the loop.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

import redis.asyncio
import redis.asyncio.connection
import redis.asyncio.retry
import redis.asyncio.sentinel
import redis.connection
import redis.retry
import redis.sentinel
from django.core.exceptions import ImproperlyConfigured
from django_redis.pool import ConnectionFactory, SentinelConnectionFactory
from redis._parsers import (
    _AsyncHiredisParser,
    _AsyncRESP2Parser,
    _AsyncRESP3Parser,
    _HiredisParser,
    _RESP2Parser,
    _RESP3Parser,
)
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.connection import to_bool

from .clients import PRIMARY_CLIENTS, cache_primary, filled_options, imported_option

__all__ = ["AsyncioClients"]

logger = logging.getLogger("django_tokenbucket")

#: The blocking classes django-redis' settings may name, and their asyncio counterparts.
_ASYNCIO_CLASSES: dict[Any, Any] = {
    redis.connection.ConnectionPool: redis.asyncio.ConnectionPool,
    redis.connection.BlockingConnectionPool: redis.asyncio.BlockingConnectionPool,
    redis.sentinel.SentinelConnectionPool: redis.asyncio.sentinel.SentinelConnectionPool,
    redis.Redis: redis.asyncio.Redis,
    redis.connection.Connection: redis.asyncio.Connection,
    redis.connection.SSLConnection: redis.asyncio.SSLConnection,
    redis.connection.UnixDomainSocketConnection: redis.asyncio.UnixDomainSocketConnection,
    redis.sentinel.SentinelManagedConnection: redis.asyncio.sentinel.SentinelManagedConnection,
    redis.sentinel.SentinelManagedSSLConnection: redis.asyncio.sentinel.SentinelManagedSSLConnection,
    _HiredisParser: _AsyncHiredisParser,
    _RESP2Parser: _AsyncRESP2Parser,
    _RESP3Parser: _AsyncRESP3Parser,
}


class _ThreadPath(Exception):
    """The cache's settings name something the asyncio client has no counterpart for."""


@dataclass
class _LoopClient:
    """The asyncio client of one event loop, for one generation of CACHES."""

    generation: int
    client: Any
    #: Awaited when the loop shuts down: closes the client and the pools it does not own.
    close: Callable[[], Awaitable[None]]
    #: The async generator whose finalisation at loop shutdown runs ``close``.
    closer: Any = field(default=None)


class AsyncioClients:
    """The asyncio clients of one django-redis cache, one per running event loop."""

    def __init__(self, alias: str, setting: str, *, cluster_factory: type[Any], deadline: float | None = None) -> None:
        self.alias = alias
        self.setting = setting
        #: The backend's TIMEOUT: what the socket timeouts the cache leaves unset become.
        self.deadline = deadline
        self._cluster_factory = cluster_factory
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopClient] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()
        #: Why the async API runs in a thread (settings it cannot mirror), or None.
        self.thread_reason: str | None = None
        self._thread_generation: int | None = None

    async def client(self, generation: int) -> Any | None:
        """Return the running loop's client for CACHES ``generation``; None means: use a thread."""
        if self._thread_generation == generation:
            return None
        loop = asyncio.get_running_loop()
        entry = self._by_loop.get(loop)
        if entry is not None and entry.generation == generation:
            return entry.client
        try:
            client, close = self._build()
        except _ThreadPath as reason:
            self.thread_reason, self._thread_generation = str(reason), generation
            logger.info(
                "the Redis rate-limit backend (%s) runs its async calls in a worker thread: %s has no "
                "asyncio counterpart",
                self.setting,
                reason,
            )
            return None
        self.thread_reason, self._thread_generation = None, None
        fresh = _LoopClient(generation, client, close)
        with self._lock:
            # Loops closed without shutting down their generators leave their clients
            # here: drop those now (their sockets close as they are collected).
            for stale in [other for other in self._by_loop if other.is_closed()]:
                del self._by_loop[stale]
            replaced = self._by_loop.get(loop)
            self._by_loop[loop] = fresh
        if replaced is not None:
            # Settings changed: the old client's loop is this one, so it can be closed now.
            await self._close(loop, replaced)
        fresh.closer = self._closer(loop, fresh)
        await fresh.closer.__anext__()  # registers it with the loop's async generator hooks
        return client

    def clients(self) -> int:
        """How many event loops have a client now (for tests and operations)."""
        return len(self._by_loop)

    async def _closer(self, loop: asyncio.AbstractEventLoop, entry: _LoopClient) -> AsyncIterator[None]:
        try:
            yield
        finally:
            with self._lock:
                if self._by_loop.get(loop) is entry:
                    del self._by_loop[loop]
            await entry.close()

    async def _close(self, loop: asyncio.AbstractEventLoop, entry: _LoopClient) -> None:
        if entry.closer is not None:
            await entry.closer.aclose()
        else:
            await entry.close()

    # -- building a client from CACHES[alias] ----------------------------------------------

    def _option_error(self, option: str, problem: object) -> ImproperlyConfigured:
        return ImproperlyConfigured(
            f"CACHES[{self.alias!r}]['OPTIONS'][{option!r}] cannot be used by the asyncio Redis client "
            f"of the rate-limit backend ({self.setting}): {problem}"
        )

    def _build(self) -> tuple[Any, Callable[[], Awaitable[None]]]:
        primary = cache_primary(self.alias, self.setting)
        client_class, url, factory = primary.client_class, primary.url, primary.factory
        if not (isinstance(client_class, type) and client_class in PRIMARY_CLIENTS):
            raise _ThreadPath(f"CACHES[{self.alias!r}]['OPTIONS']['CLIENT_CLASS'] is {client_class!r}")
        # The client is the backend's own: the socket timeouts the cache leaves unset are
        # the deadline's (clients.filled_options), as on the sync path.
        filled = filled_options(primary.options, self.deadline)
        options = filled or primary.options
        params = self._connection_params(options)
        if filled is not None:
            # asyncio.timeout cuts every wait of a call at the deadline, so its replies need no
            # timer of their own (redis-py starts one per send and per read when given a
            # socket timeout, and from redis-py 8 on gives one when none is given: 5 s). The
            # connect keeps half the deadline, so that a host that does not answer fails it
            # within the call, which tells the breaker (a cancelled connect tells it nothing).
            params["socket_timeout"] = None
        try:
            if factory is self._cluster_factory:
                return self._cluster(url, params, options)
            if factory is SentinelConnectionFactory:
                return self._sentinel(url, params, options)
            if factory is ConnectionFactory:
                return self._plain(url, params, options)
        except TypeError as exc:  # an option the asyncio classes do not take
            raise ImproperlyConfigured(
                f"CACHES[{self.alias!r}]['OPTIONS'] has an option the asyncio Redis client of the "
                f"rate-limit backend ({self.setting}) does not take: {exc}"
            ) from exc
        raise _ThreadPath(f"CACHES[{self.alias!r}] uses the connection factory {factory!r}")

    def _asyncio_class(self, option: str, blocking: Any) -> Any:
        counterpart = _ASYNCIO_CLASSES.get(blocking)
        if counterpart is None:
            raise _ThreadPath(f"CACHES[{self.alias!r}]['OPTIONS'][{option!r}] is {blocking!r}")
        return counterpart

    def _connection_params(self, options: dict[str, Any]) -> dict[str, Any]:
        """What django-redis' ``make_connection_params`` passes to the pool, for asyncio."""
        params: dict[str, Any] = {}
        parser = options.get("PARSER_CLASS")
        if parser is not None:
            params["parser_class"] = self._asyncio_class("PARSER_CLASS", imported_option(options, "PARSER_CLASS", ""))
        if options.get("USERNAME"):
            params["username"] = options["USERNAME"]
        if options.get("PASSWORD"):
            params["password"] = options["PASSWORD"]
        timeouts = (("SOCKET_TIMEOUT", "socket_timeout"), ("SOCKET_CONNECT_TIMEOUT", "socket_connect_timeout"))
        for option, name in timeouts:
            value = options.get(option)
            if value:
                if not isinstance(value, (int, float)):
                    raise self._option_error(option, f"{value!r} is not a number of seconds")
                params[name] = value
        return params

    def _kwargs(self, options: dict[str, Any], option: str) -> dict[str, Any]:
        """``options[option]`` (a dict of redis-py kwargs) with its blocking objects made asyncio ones."""
        given = options.get(option) or {}
        if not isinstance(given, dict):
            raise self._option_error(option, f"{given!r} is not a dict")
        kwargs = dict(given)
        if "connection_class" in kwargs:
            where = f"{option}']['connection_class"
            kwargs["connection_class"] = self._asyncio_class(where, kwargs["connection_class"])
        retry = kwargs.get("retry")
        if isinstance(retry, redis.retry.Retry):
            # The same policy: its backoff is shared, the retry loop must await.
            kwargs["retry"] = redis.asyncio.retry.Retry(
                retry._backoff,
                retry.get_retries(),
                tuple(retry._supported_errors),  # type: ignore[arg-type]
            )
        return kwargs

    def _plain(self, url: str, params: dict[str, Any], options: dict[str, Any]) -> tuple[Any, Any]:
        pool_class = self._asyncio_class(
            "CONNECTION_POOL_CLASS",
            imported_option(options, "CONNECTION_POOL_CLASS", "redis.connection.ConnectionPool"),
        )
        client_class = self._asyncio_class(
            "REDIS_CLIENT_CLASS", imported_option(options, "REDIS_CLIENT_CLASS", "redis.client.Redis")
        )
        pool = pool_class.from_url(url, **{**params, **self._kwargs(options, "CONNECTION_POOL_KWARGS")})
        pool.make_connection()  # refuses options its connections do not take, now rather than per call
        client = client_class(connection_pool=pool, **self._kwargs(options, "REDIS_CLIENT_KWARGS"))

        async def close() -> None:
            await client.aclose()
            await pool.disconnect()

        return client, close

    def _sentinel(self, url: str, params: dict[str, Any], options: dict[str, Any]) -> tuple[Any, Any]:
        sentinels = options.get("SENTINELS")
        if not sentinels:
            raise self._option_error("SENTINELS", "SentinelConnectionFactory needs a list of (host, port)")
        pool_class = self._asyncio_class(
            "CONNECTION_POOL_CLASS",
            imported_option(options, "CONNECTION_POOL_CLASS", "redis.sentinel.SentinelConnectionPool"),
        )
        client_class = self._asyncio_class(
            "REDIS_CLIENT_CLASS", imported_option(options, "REDIS_CLIENT_CLASS", "redis.client.Redis")
        )
        pool_kwargs = self._kwargs(options, "CONNECTION_POOL_KWARGS")
        sentinel = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
            sentinels, sentinel_kwargs=options.get("SENTINEL_KWARGS"), **{**params, **pool_kwargs}
        )
        parsed = urlparse(url)
        query = parse_qs(parsed.query)
        is_master = to_bool(query.pop("is_master", ["1"])[0])  # type: ignore[no-untyped-call]
        service_url = urlunparse((*parsed[:4], urlencode(query, doseq=True), parsed[5]))
        # What Sentinel.master_for makes (slave_for when the URL says is_master=0), from
        # the URL as django-redis reads it: the host names the service.
        pool = pool_class.from_url(
            service_url,
            service_name=parsed.hostname,
            sentinel_manager=sentinel,
            is_master=is_master,
            **{**params, **pool_kwargs},
        )
        client = client_class(connection_pool=pool, **self._kwargs(options, "REDIS_CLIENT_KWARGS"))

        async def close() -> None:
            await client.aclose()
            await pool.disconnect()
            for node in sentinel.sentinels:
                await node.aclose()

        return client, close

    def _cluster(self, url: str, params: dict[str, Any], options: dict[str, Any]) -> tuple[Any, Any]:
        # As ClusterConnectionFactory: the node URL, the connection params but the parser, and
        # REDIS_CLIENT_KWARGS; the cluster client makes its own pools.
        kwargs = {name: value for name, value in params.items() if name != "parser_class"}
        kwargs.update(self._kwargs(options, "REDIS_CLIENT_KWARGS"))
        client = AsyncRedisCluster.from_url(url, **kwargs)

        async def close() -> None:
            await client.aclose()

        return client, close
