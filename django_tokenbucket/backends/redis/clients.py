"""The blocking client the Redis backend decides on, and the socket timeouts of its connections.

A call's deadline (``bounded``) cannot cut a connection being made on the sync API: the
connect, and its handshake (redis-py's ``CLIENT SETINFO``, ``AUTH``, ``HELLO``, the
``PING`` of a Sentinel-managed connection), are bounded by the socket timeouts alone.
django-redis passes none when the cache's ``OPTIONS`` give none, and redis-py then waits
as long as the socket does: before redis-py 8 for ever (a connect to a host that is down
lasts the system's SYN retries, about two minutes on Linux; a frozen server's handshake,
for ever), from redis-py 8 on 5 s each. A deadline that such a call ignores bounds nothing.

The backend must not change how the cache's own calls behave. So when a deadline is in
force and the cache sets no ``SOCKET_TIMEOUT``, the backend decides on a client of its
own, which the cache's connection factory builds from the same ``OPTIONS`` for the same
primary, with what the cache left unset filled in (``filled_options``):
``SOCKET_TIMEOUT`` at the deadline (a new connection's handshake, and a cluster's
topology read, then end within it) and ``SOCKET_CONNECT_TIMEOUT`` at half of it (a host
that does not answer fails its connect within the call, which opens its breaker: a
connect cut by the deadline would tell the breaker nothing). It is one client (one pool)
per process and configuration, as django-redis keeps one per URL; the cache's client
keeps its own connections. A cache that sets ``SOCKET_TIMEOUT`` is used as it is: its
timeouts are the user's choice, and ``manage.py check`` says when they outlast the
deadline (W022). So is a cache whose connection factory or client class the backend
cannot build again (one of your own, django-redis' ``ShardClient``).

``cache_primary`` is also what the asyncio clients (``aio``) are built from.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlencode, urlparse, urlunparse

from django.conf import settings
from django.core.cache import InvalidCacheBackendError
from django.core.exceptions import ImproperlyConfigured
from django.utils.module_loading import import_string
from django_redis import get_redis_connection
from django_redis.client import DefaultClient, HerdClient, SentinelClient
from django_redis.pool import ConnectionFactory

from ..caches import is_django_redis
from .connections import ClusterConnectionFactory

__all__ = [
    "CachePrimary",
    "after_fork_in_child",
    "cache_primary",
    "decision_client",
    "filled_options",
    "imported_option",
    "missing_cache_error",
    "not_django_redis_error",
    "rebuildable",
]

#: django-redis' client classes whose raw client is the primary's, as ``get_client(write=True)``.
PRIMARY_CLIENTS = (DefaultClient, HerdClient, SentinelClient)


def missing_cache_error(alias: str, setting: str) -> ImproperlyConfigured:
    defined = ", ".join(map(repr, getattr(settings, "CACHES", {}))) or "none"
    return ImproperlyConfigured(
        f"{setting}['OPTIONS']['CACHE'] = {alias!r} is not an alias in CACHES "
        f"(defined: {defined}): name a django-redis cache"
    )


def not_django_redis_error(alias: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(
        f"the Redis backend needs a django-redis cache, and CACHES[{alias!r}] is not one "
        f"(set its BACKEND to 'django_redis.cache.RedisCache')"
    )


class CachePrimary(NamedTuple):
    """What django-redis makes the primary's client of (where it writes), for one cache alias."""

    alias: str
    options: dict[str, Any]
    #: The first ``LOCATION``; for ``SentinelClient``, with ``is_master=1`` as it adds.
    url: str
    client_class: Any
    factory: Any


def imported_option(options: Mapping[str, Any], option: str, default: str) -> Any:
    """Return ``options[option]`` (``default`` when unset), imported when it is a dotted
    path, as django-redis reads its class options."""
    path = options.get(option, default)
    return import_string(path) if isinstance(path, str) else path


def cache_primary(alias: str, setting: str) -> CachePrimary:
    """Read ``CACHES[alias]`` as django-redis does for ``get_client(write=True)``."""
    caches: dict[str, Any] = getattr(settings, "CACHES", {})
    if alias not in caches:
        raise missing_cache_error(alias, setting)
    cache = caches[alias]
    if not is_django_redis(cache.get("BACKEND")):
        raise not_django_redis_error(alias)
    options: dict[str, Any] = dict(cache.get("OPTIONS") or {})
    location = cache.get("LOCATION")
    if not location:
        raise ImproperlyConfigured(f"CACHES[{alias!r}] has no LOCATION (the Redis server's URL)")
    servers = location.split(",") if isinstance(location, str) else list(location)
    client_class = imported_option(options, "CLIENT_CLASS", "django_redis.client.DefaultClient")
    url = servers[0]
    if client_class is SentinelClient and isinstance(location, str):
        # As SentinelClient does: the first location is the service's master.
        parsed = urlparse(url)
        query = parse_qs(parsed.query, keep_blank_values=True)
        query["is_master"] = ["1"]
        url = urlunparse((*parsed[:4], urlencode(query, doseq=True), parsed[5]))
    # As django-redis' get_connection_factory: an option of None is unset.
    factory = options.get("CONNECTION_FACTORY") or getattr(
        settings, "DJANGO_REDIS_CONNECTION_FACTORY", "django_redis.pool.ConnectionFactory"
    )
    factory = import_string(factory) if isinstance(factory, str) else factory
    return CachePrimary(alias, options, url, client_class, factory)


def filled_options(options: Mapping[str, Any], deadline: float | None) -> dict[str, Any] | None:
    """``options`` with the socket timeouts that the backend's own connections get under
    ``deadline``; None when the cache's client serves as it is (no deadline, or the cache
    sets ``SOCKET_TIMEOUT``).

    ``SOCKET_TIMEOUT`` becomes the deadline, ``SOCKET_CONNECT_TIMEOUT`` (unless given) half
    of it, and so do the sentinels' socket timeouts in a ``SENTINEL_KWARGS`` that gives
    none (without ``SENTINEL_KWARGS``, redis-py's Sentinel takes the socket options given
    for the master's connections).
    """
    if deadline is None or options.get("SOCKET_TIMEOUT"):
        return None
    filled = dict(options)
    filled["SOCKET_TIMEOUT"] = deadline
    if not options.get("SOCKET_CONNECT_TIMEOUT"):
        filled["SOCKET_CONNECT_TIMEOUT"] = deadline / 2
    sentinel_kwargs = options.get("SENTINEL_KWARGS")
    if isinstance(sentinel_kwargs, dict) and not sentinel_kwargs.get("socket_timeout"):
        filled["SENTINEL_KWARGS"] = {
            **sentinel_kwargs,
            "socket_timeout": deadline,
            "socket_connect_timeout": sentinel_kwargs.get("socket_connect_timeout") or deadline / 2,
        }
    return filled


def rebuildable(primary: CachePrimary) -> bool:
    """Whether the backend can build a client of its own like the cache's (``own_client``):
    django-redis' client classes, and a connection factory that makes its client as
    ``ConnectionFactory`` does (the Sentinel one included), or this package's cluster factory."""
    factory: Any = primary.factory
    if not (isinstance(primary.client_class, type) and primary.client_class in PRIMARY_CLIENTS):
        return False
    if not isinstance(factory, type):
        return False
    if issubclass(factory, ClusterConnectionFactory):
        return True
    builds_like_django_redis = getattr(factory, "get_connection", None) is ConnectionFactory.get_connection
    return issubclass(factory, ConnectionFactory) and builds_like_django_redis


_own_clients: dict[str, Any] = {}
_own_clients_lock = threading.Lock()


def after_fork_in_child() -> None:
    """Give a forked child a lock of its own (``django_tokenbucket.lifecycle``)."""
    # A fork while another thread held the lock would leave the child's copy held.
    global _own_clients_lock
    _own_clients_lock = threading.Lock()


def own_client(primary: CachePrimary, options: dict[str, Any]) -> Any:
    """The backend's own client of ``primary``, built from ``options`` by the cache's factory:
    one per process and configuration (its pool makes its connections on demand)."""
    key = repr((primary.factory, primary.client_class, primary.url, sorted(options.items())))
    with _own_clients_lock:
        client = _own_clients.get(key)
        if client is None:
            factory = primary.factory(dict(options))
            params = factory.make_connection_params(primary.url)
            if isinstance(factory, ClusterConnectionFactory):
                client = factory.get_connection(params)  # one per URL and options, not the cache's
            else:
                # Not get_connection(): django-redis keeps one pool per URL, which is the cache's.
                pool = factory.get_connection_pool(params)
                client = factory.redis_client_cls(connection_pool=pool, **factory.redis_client_cls_kwargs)
            _own_clients[key] = client
    return client


def decision_client(alias: str, setting: str, deadline: float | None) -> Any:
    """The blocking client the backend decides on: its own (see above), or the cache's."""
    if deadline is not None:
        primary = cache_primary(alias, setting)
        filled = filled_options(primary.options, deadline)
        if filled is not None and rebuildable(primary):
            return own_client(primary, filled)
    try:
        return get_redis_connection(alias, write=True)
    except InvalidCacheBackendError:
        raise missing_cache_error(alias, setting) from None
    except NotImplementedError:
        raise not_django_redis_error(alias) from None
