"""The clients the backend talks through: Redis Cluster's connection factory, and what a
client will do on its own when a command fails (retry it, or not).
"""

from __future__ import annotations

import threading
from typing import Any

from django_redis.pool import ConnectionFactory
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .spares import give_back, lease

__all__ = [
    "ClusterConnectionFactory",
    "after_fork_in_child",
    "may_have_run",
    "packed_read",
    "run_on_link",
    "script_pool",
    "single_server_pool",
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


def after_fork_in_child() -> None:
    """Give a forked child the factory's lock of its own (``django_tokenbucket.lifecycle``)."""
    # A fork while another thread held it would leave the child's copy held.
    ClusterConnectionFactory._lock = threading.Lock()


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


def may_have_run(client: Any, exc: BaseException) -> bool:
    """Whether a command may have run although its call on ``client`` failed with ``exc``.

    A call the backend made itself (``bounded``, ``run_on_link``) marks the exception with
    whether the command was sent, and that decides. Otherwise: yes when the client sends
    a command again on its own (an earlier attempt may have run it); no when Redis
    answered with an error; yes when the connection failed or timed out once made, while
    the reply was awaited (redis-py says "connecting" when none could be made: nothing
    was sent).
    """
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
    pool = single_server_pool(client)
    return None if pool is None or _client_retries(client) else pool


def run_on_link(pool: Any, *command: Any) -> Any:
    """Send ``command`` on a connection of ``pool`` and return its reply.

    What redis-py's ``execute_command`` does on a client without retries, without its
    per-call hooks (event dispatch, observability, the retry wrapper): about a tenth
    of a decision's time at the floor (issue 35, item 5). A failure says whether the
    command was sent, as ``bounded`` does, for ``may_have_run``.
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


def single_server_pool(client: Any) -> Any:
    """The connection pool of a client of one server (Sentinel's included), else None."""
    if isinstance(client, (RedisCluster, AsyncRedisCluster)) or getattr(client, "connection", None) is not None:
        return None  # a cluster, or a client holding a single connection of its own
    return getattr(client, "connection_pool", None)


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
