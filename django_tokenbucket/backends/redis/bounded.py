"""One deadline per call (the Redis backend's ``TIMEOUT``), and failing fast per node.

redis-py bounds each socket wait, not a call: its cluster client tries a command again
up to ten times after a connection error, re-reading the topology each time, and
sleeps 0.25 s per ``CLUSTERDOWN`` reply, so a call can take seconds whatever
``SOCKET_TIMEOUT`` says. A rate limiter sits in front of every request, so every call
is bounded unless the settings say ``TIMEOUT: None``: ``DEFAULT_TIMEOUT`` when they
give none (``deadline_option``). Within it, the backend makes each call itself:

- on one server (Sentinel's included) it sends the command on a connection of the
  client's pool and reads the reply for no longer than the time left (redis-py's pools
  retry nothing by default either);
- on a cluster it sends the command to the primary the client's slot table names for
  the key, through that node's pool, and goes on by itself: ``MOVED`` updates the table,
  ``ASK`` is followed, ``CLUSTERDOWN`` and ``TRYAGAIN`` are waited out (10 ms doubling
  to 0.2 s, cut to the deadline), and a node that cannot be reached makes it read the
  topology again and try the slot's new primary, if another node now holds it;
- on asyncio the backend wraps the whole call in ``asyncio.timeout``.

No step starts once the deadline has passed, and a reply is awaited only for the time
left; on the sync API a connection being made is bounded by ``SOCKET_CONNECT_TIMEOUT``
and its handshake by ``SOCKET_TIMEOUT`` alone, which the backend sets for its own
connections where the cache sets none (``clients``). A command that was sent and whose
reply did not come is never sent again: the script may have run.

Every node is guarded by its breaker (``breaker``): once no connection to a node could
be made, the calls whose keys it holds fail at once, until one probe finds it (or its
successor) again. A late reply or a dropped connection fails its call alone.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import PRIMARY, get_node_name
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    RedisClusterException,
    RedisError,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.utils import str_if_bytes

from ..base import timeout_option
from .breaker import BREAKERS, Breakers
from .spares import give_back, lease, pooled_connection

__all__ = [
    "DEFAULT_TIMEOUT",
    "DeadlineExceeded",
    "NodeUnavailable",
    "acluster_execute",
    "aread",
    "asyncio_node",
    "awaited_reply",
    "cluster_execute",
    "deadline_option",
    "expired",
    "guarded",
    "node_of",
    "refused",
    "run_within",
    "single_execute",
]

#: The deadline of every call when the backend's OPTIONS give no ``TIMEOUT`` (seconds).
#: A healthy decision takes well under a millisecond, so this is reached only by a Redis
#: that is not answering (down, frozen, blocked by a slow command, a cluster waiting for
#: a failover) or a host too loaded to read its reply: long enough never to cut a healthy
#: call, short enough that a request held by a failing store is answered (by the fail
#: mode) within a fifth of a second rather than after redis-py's retries and waits.
DEFAULT_TIMEOUT = 0.2

#: The first pause after ``CLUSTERDOWN`` or ``TRYAGAIN``, and the longest.
FIRST_PAUSE = 0.01
MAX_PAUSE = 0.2
#: A reply is awaited with the connection's own socket timeout, rather than one cut to
#: the time left, when that ends at most this much after the deadline: the backend's own
#: connections time out at the deadline itself (``clients``), and setting the socket's
#: timeout for a read and back costs two system calls per call.
READ_SLACK = 0.005


def deadline_option(options: Any, setting: str = "TOKENBUCKET") -> float | None:
    """The seconds a call may take: ``OPTIONS["TIMEOUT"]``, ``DEFAULT_TIMEOUT`` when it is
    not given, None (no deadline, redis-py's own behaviour) when it is given as None.

    Raises ValueError for anything else than None or a positive, finite number.
    """
    if "TIMEOUT" not in options:
        return DEFAULT_TIMEOUT
    return timeout_option(options["TIMEOUT"], setting)


class DeadlineExceeded(RedisTimeoutError):
    """The call did not finish within the backend's ``TIMEOUT``."""


class NodeUnavailable(RedisConnectionError):
    """The node holding the call's keys was found unreachable lately: failed without trying."""


def _mark(exc: BaseException, sent: bool) -> BaseException:
    # What the backend reads to say whether a failed call is ambiguous.
    exc.tokenbucket_sent = sent  # type: ignore[attr-defined]
    return exc


#: The attribute of a pool that holds its breaker's name (fixed for the pool's life).
_NODE = "_django_tokenbucket_node"


def node_of(pool: Any) -> str:
    """The breaker's name for the server of a one-server pool: ``host:port``, the socket path,
    or the Sentinel service (whose master may move)."""
    node: str | None = getattr(pool, _NODE, None)
    if node is not None:
        return node
    service = getattr(pool, "service_name", None)
    kwargs = pool.connection_kwargs
    if service is not None:
        node = f"sentinel:{service}"
    elif "path" in kwargs:
        node = str(kwargs["path"])
    else:
        node = f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
    setattr(pool, _NODE, node)
    return node


def _connecting(exc: BaseException) -> bool:
    """Whether ``exc`` says no connection could be made (redis-py's words): nothing was sent."""
    return isinstance(exc, NodeUnavailable) or "connecting" in str(exc)


def awaited_reply(exc: BaseException) -> bool:
    """Whether ``exc`` is a reply that did not come in time on a connection that was made:
    a busy server, where one that accepts no connection is unreachable."""
    if not isinstance(exc, RedisTimeoutError) or getattr(exc, "tokenbucket_sent", True) is False:
        return False
    return isinstance(exc, DeadlineExceeded) or not _connecting(exc)


def refused(node: str, breakers: Breakers = BREAKERS) -> NodeUnavailable:
    """The error of a call that its node's breaker failed at once (nothing was sent)."""
    wait = breakers.get(node).remaining()
    error = NodeUnavailable(
        f"Redis node {node} could not be reached lately: failing at once for {wait * 1000:.0f} ms more, "
        f"then one call tries it again"
    )
    _mark(error, sent=False)
    return error


def expired(timeout: float) -> DeadlineExceeded:
    """The error of a call that ran out of its ``TIMEOUT``."""
    return DeadlineExceeded(f"no reply within the backend's TIMEOUT = {timeout:g} s")


_READ_TIMEOUT_BY_CLASS: dict[type[Any], bool] = {}


def _reads_with_timeout(link_class: type[Any]) -> bool:
    """Whether ``link_class.read_response`` takes a ``timeout`` (redis-py 8 on)."""
    known = _READ_TIMEOUT_BY_CLASS.get(link_class)
    if known is None:
        parameters = inspect.signature(link_class.read_response).parameters
        known = _READ_TIMEOUT_BY_CLASS[link_class] = "timeout" in parameters
    return known


def _read_within(link: Any, seconds: float) -> Any:
    """The next reply on ``link``, its start waited for ``seconds`` at most.

    redis-py 8 takes the wait itself. Before it (redis-py 7, which ``limits[redis]`` still
    pins), ``can_read`` waits for the reply's first bytes: a server that never answers
    ends the wait at the deadline, not at the connection's socket timeout; the rest of a
    reply already begun follows within that timeout.
    """
    if _reads_with_timeout(type(link)):
        return link.read_response(timeout=seconds)
    if not link.can_read(timeout=seconds):
        raise RedisTimeoutError("Timeout reading from socket")
    return link.read_response()


def _on_link(
    pool: Any,
    commands: Sequence[Sequence[Any]],
    deadline: float,
    timeout: float,
    node: str,
    breakers: Breakers,
    *,
    packed: Any = None,
    spare: bool = False,
) -> list[Any]:
    """Send ``commands`` together on a connection of ``pool``; read their replies until ``deadline``.

    ``packed``: the commands already packed. ``spare``: a connection that the process'
    decisions hand to each other (``spares.lease``), on a one-server pool. A reply
    that is an error is raised after every reply was read (the connection stays in
    step); the first one wins.
    """
    try:
        link = lease(pool) if spare else pooled_connection(pool)
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        breakers.failed(node)
        _mark(exc, sent=False)
        raise
    if time.monotonic() >= deadline:  # connecting took the time left
        give_back(pool, link) if spare else pool.release(link)
        raise _mark(expired(timeout), sent=False)
    sent = False
    replies: list[Any] = []
    error: ResponseError | None = None
    try:
        if packed is None:
            packed = link.pack_command(*commands[0]) if len(commands) == 1 else link.pack_commands(commands)
        link.send_packed_command(packed)
        sent = True
        own = link.socket_timeout
        for _ in commands:
            left = deadline - time.monotonic()
            cut = own is None or left < own - READ_SLACK
            try:
                # A wait no longer than the time left; the connection's own timeout otherwise.
                # Never 0: a non-blocking read with nothing to read is an error, not a timeout.
                reply = _read_within(link, max(left, 1e-4)) if cut else link.read_response()
            except ResponseError as exc:
                error = error or exc
                reply = None
            except RedisTimeoutError as exc:
                if not cut and own < left:
                    raise  # the connection's own timeout, shorter than the time left
                raise expired(timeout) from exc
            replies.append(reply)
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        # Not the breaker's business: the node was reached (a reply late on a busy
        # machine, a connection the server dropped); the next connection tells.
        link.disconnect()
        _mark(exc, sent=sent)
        raise
    except BaseException:
        link.disconnect()
        raise
    finally:
        give_back(pool, link) if spare else pool.release(link)
    breakers.succeeded(node)  # it answered, if only with an error
    if error is not None:
        raise error
    return replies


def single_execute(
    pool: Any,
    commands: Sequence[Sequence[Any]],
    deadline: float,
    timeout: float,
    breakers: Breakers = BREAKERS,
    *,
    packed: Any = None,
) -> list[Any]:
    """Run ``commands`` together on the server of ``pool`` (no retry) within ``deadline``; their
    replies. On a spare connection (``spares.lease``), as the calls without a deadline."""
    node = node_of(pool)
    if not breakers.allow(node):
        raise refused(node, breakers)
    return _on_link(pool, commands, deadline, timeout, node, breakers, packed=packed, spare=True)


def run_within(pool: Any, deadline: float, timeout: float, *command: Any) -> Any:
    """Run one ``command`` on the server of ``pool`` within ``deadline``; its reply
    (``single_execute`` for the decision script: ``connections.run_on_link`` with a deadline)."""
    node = node_of(pool)
    if not BREAKERS.allow(node):
        raise refused(node)
    return _on_link(pool, (command,), deadline, timeout, node, BREAKERS, spare=True)[0]


def cluster_execute(
    client: Any, key: str, args: Sequence[Any], deadline: float, timeout: float, breakers: Breakers = BREAKERS
) -> Any:
    """Run one command on the primary of ``key``'s slot of the cluster ``client``, within ``deadline``."""
    pause = FIRST_PAUSE
    redirect = None
    nodes = client.nodes_manager
    while True:
        if time.monotonic() >= deadline:
            raise _mark(expired(timeout), sent=False)
        node = redirect or client.get_node_from_key(key)
        if not breakers.allow(node.name):
            raise refused(node.name, breakers)
        pool = client.get_redis_connection(node).connection_pool
        try:
            commands = [("ASKING",), args] if redirect is not None else [args]
            return _on_link(pool, commands, deadline, timeout, node.name, breakers)[-1]
        except MovedError as exc:
            nodes.move_slot(exc)
            redirect = None
        except AskError as exc:
            redirect = nodes.get_node(host=exc.host, port=exc.port)
            if redirect is None:  # a node the table does not know yet: read the topology
                nodes.initialize()
                redirect = nodes.get_node(host=exc.host, port=exc.port)
                if redirect is None:
                    raise
        except (ClusterDownError, TryAgainError):
            redirect = None
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))
            pause = min(MAX_PAUSE, pause * 2)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            if getattr(exc, "tokenbucket_sent", True) or isinstance(exc, DeadlineExceeded):
                raise  # the script may have run: never again
            # Nothing was sent: go on if a replica has taken the slot over (see
            # _slot_taken_over: asked of a live node, the topology read once it has).
            if not _slot_taken_over(client, key, node.name, deadline, timeout, breakers):
                raise
            nodes.initialize(last_failed_node_name=node.name)
            if client.get_node_from_key(key).name == node.name:
                raise
            redirect = None


def asyncio_node(client: Any, key: str) -> str | None:
    """The breaker's name for the node an asyncio client sends ``key``'s command to, if known."""
    if isinstance(client, AsyncRedisCluster):
        try:
            node = client.get_node_from_key(key)
        except (RedisClusterException, RedisError):
            return None  # its slot table is not read yet: the first call finds out
        return None if node is None else str(node.name)
    pool = getattr(client, "connection_pool", None)
    return None if pool is None else node_of(pool)


async def guarded(node: str | None, run: Callable[[], Awaitable[Any]], breakers: Breakers = BREAKERS) -> Any:
    """Await ``run()`` (a command of an asyncio client) behind the breaker of ``node`` (see
    ``asyncio_node``; None: unknown, unguarded).

    The deadline itself is ``asyncio.timeout``'s, around the whole call: this only tells
    the breaker whether the node answered. A call cancelled at the deadline tells it
    nothing: redis-py may have been waiting out a cluster that is down, not this node.
    """
    if node is None:
        return await run()
    if not breakers.allow(node):
        raise refused(node, breakers)
    try:
        reply = await run()
    except ResponseError:
        breakers.succeeded(node)  # it answered
        raise
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        if _connecting(exc):
            breakers.failed(node)
        raise
    breakers.succeeded(node)
    return reply


async def acluster_execute(client: Any, key: str, *args: Any, breakers: Breakers = BREAKERS) -> Any:
    """``cluster_execute`` on redis-py's asyncio cluster client (the deadline is the caller's
    ``asyncio.timeout``).

    redis-py's own loop answers ``CLUSTERDOWN`` by closing every connection of the client,
    those other tasks are using included (they then fail outside redis-py's errors), and
    retries a refused connection ten times: this loop does neither.
    """
    await client.initialize()  # reads the topology on the first call only
    pause = FIRST_PAUSE
    redirect = None
    while True:
        node = redirect or client.get_node_from_key(key)
        if not breakers.allow(node.name):
            raise refused(node.name, breakers)
        try:
            if redirect is not None:
                await node.execute_command("ASKING")
            reply = await node.execute_command(*args)
        except MovedError as exc:
            breakers.succeeded(node.name)
            await client.nodes_manager.move_slot(exc)
            redirect = None
            continue
        except AskError as exc:
            breakers.succeeded(node.name)
            redirect = client.nodes_manager.get_node(host=exc.host, port=exc.port)
            if redirect is None:
                raise
            continue
        except (ClusterDownError, TryAgainError):
            breakers.succeeded(node.name)
            redirect = None
            await asyncio.sleep(pause)
            pause = min(MAX_PAUSE, pause * 2)
            continue
        except ResponseError:
            breakers.succeeded(node.name)
            raise
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            sent = not _connecting(exc)
            _mark(exc, sent=sent)
            if sent:
                raise  # the script may have run: never again
            breakers.failed(node.name)
            # Go on if a replica has taken the slot over (see _slot_taken_over); through the
            # nodes manager, not the client, whose initialize() holds every other task's
            # call behind its lock meanwhile, and closes every connection if it fails.
            if not await _aslot_taken_over(client, key, node.name):
                raise
            await client.nodes_manager.initialize(last_failed_node_name=node.name)
            if client.get_node_from_key(key).name == node.name:
                raise
            redirect = None
            continue
        breakers.succeeded(node.name)
        return reply


def _slot_taken_over(
    client: Any, key: str, failed: str, deadline: float, timeout: float, breakers: Breakers
) -> bool:
    """Whether a live primary of the cluster says that another node than ``failed`` now
    serves ``key``'s slot (False when none answers: the slot is still failing).

    redis-py's own way to find out, a read of the whole topology, makes every connection
    of every node reconnect on its next use: the healthy nodes' calls would pay for each
    probe of a dead node. One ``CLUSTER SLOTS`` asked of a live node costs them nothing.
    """
    for node in _live_primaries(client, failed):
        pool = client.get_redis_connection(node).connection_pool
        try:
            ranges = _on_link(pool, [("CLUSTER", "SLOTS")], deadline, timeout, node.name, breakers)[-1]
        except (RedisError, OSError):
            continue
        return _serves_elsewhere(client, key, ranges, node, failed)
    return False


async def _aslot_taken_over(client: Any, key: str, failed: str) -> bool:
    """``_slot_taken_over`` for redis-py's asyncio cluster client."""
    for node in _live_primaries(client, failed):
        try:
            ranges = await node.execute_command("CLUSTER SLOTS")
        except (RedisError, OSError):
            continue
        return _serves_elsewhere(client, key, ranges, node, failed)
    return False


def _live_primaries(client: Any, failed: str) -> list[Any]:
    return [n for n in list(client.nodes_manager.nodes_cache.values()) if n.name != failed and n.server_type == PRIMARY]


def _serves_elsewhere(client: Any, key: str, ranges: Sequence[Any], asked: Any, failed: str) -> bool:
    """Whether the ``CLUSTER SLOTS`` reply ``ranges`` of node ``asked`` gives ``key``'s slot
    to another node than ``failed``."""
    slot = client.keyslot(key)
    for start, end, primary, *_replicas in ranges:
        if int(start) <= slot <= int(end):
            host = str_if_bytes(primary[0]) or asked.host
            return get_node_name(*client.nodes_manager.remap_host_port(host, int(primary[1]))) != failed
    return False


async def aread(pool: Any, commands: Sequence[Sequence[Any]], *, guard: bool) -> list[Any] | None:
    """Send ``commands`` together on a connection of an asyncio ``pool``; their replies, or
    None when one is an error. ``guard``: behind the server's breaker (``TIMEOUT``)."""
    node = node_of(pool)
    if guard and not BREAKERS.allow(node):
        raise refused(node)
    try:
        link = await pooled_connection(pool)
    except (RedisConnectionError, RedisTimeoutError, OSError):
        if guard:
            BREAKERS.failed(node)
        raise
    try:
        await link.send_packed_command(link.pack_commands(commands))
        replies = [await link.read_response() for _ in commands]
    except ResponseError:
        await link.disconnect()  # the other reply may be unread
        return None
    except BaseException:
        await link.disconnect()
        raise
    finally:
        await pool.release(link)
    if guard:
        BREAKERS.succeeded(node)
    return replies
