"""Limits in Redis, through a django-redis cache alias.

Each decision is one Lua script (``lua/decide.lua`` of this package, with the big-number
helpers of ``lua/bignum.lua`` joined in: ``script``): it reads the state of every limit of the call,
takes the time from Redis' ``TIME``, decides all or nothing with the same integer
arithmetic as ``algorithms`` and writes what changed, atomically. Every written key
expires when its bucket would be full again, so an absent key means "fresh" and idle
keys clean themselves up.

Keys are made with the cache's key function (so ``KEY_PREFIX``, ``VERSION`` and
``KEY_FUNCTION`` apply) from ``tokenbucket:<name>:{<key digest[:16]>}<key digest[16:]>``.
The braces are a Redis Cluster hash tag: every limit of one key lives in one slot, so
``limit_many()`` over limits that share a key is one atomic script on a cluster too.

Unlike the database backend, a decision does not join the caller's database
transaction: a rollback does not return the tokens.

The async API (``alimit``...) decides on redis-py's asyncio client, built from the same
cache settings (``aio``), one per event loop: no thread per decision.

For the admin and the command, a limit's buckets are listed with ``SCAN`` (``MATCH`` on
the limit's key pattern, a bounded ``COUNT``, on every primary of a cluster, a page
bounded by time: ``keyspace``), never ``KEYS``. A stored value is ``"<value> <ts>"`` only: no readable label is kept (it
would cost every decision an argument, and a process running the previous script
could not read such a value during a rolling upgrade), so buckets are shown by their
digest and found by their exact key.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple

from django.core.cache import caches
from django.core.cache.backends.base import default_key_func
from django.core.exceptions import ImproperlyConfigured

try:
    import django_redis  # noqa: F401  (the error to show when it is missing)
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(f"the Redis backend needs django-redis: pip install 'dj-tokenbucket[redis]' ({exc})") from exc
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from ... import catalogue, clock
from ...keys import EncodedKey
from ...limits import LimitConfig
from ...settings import tokenbucket_settings
from ..base import Answers, BackendError, BaseBackend, Outcome, RecentDenials, Request, RowId, row_id
from .aio import AsyncioClients
from .analytics import AnalyticsKeys
from .bounded import (
    acluster_execute,
    asyncio_node,
    awaited_reply,
    cluster_execute,
    deadline_option,
    expired,
    guarded,
    node_of,
    run_within,
)
from .checks import check_cache
from .clients import decision_client
from .connections import ClusterConnectionFactory, may_have_run, run_on_link, script_pool, single_server_pool
from .keyspace import KeyspaceListing, check_one_slot, key_head, node_clients, state_key, tagged_key
from .reads import ReadsFirst
from .script import (
    HEADERS,
    INDEX_AND_COUNT,
    PINNED_HEADERS,
    SCRIPT,
    SCRIPT_SHA,
    as_msgpack,
    reply_outcome,
    time_microseconds,
)

__all__ = ["RedisBackend", "settings_changed"]

_OPTIONS = {"CACHE", "TIMEOUT"}
#: Limits whose arguments a backend keeps formatted.
_LIMITS_CACHE_SIZE = 4096
#: Bumped whenever CACHES or TOKENBUCKET changes, so that every backend reloads its
#: client, key prefix and clock.
_settings_generation = 0


def settings_changed() -> None:
    """Make every backend reload its client, key prefix and clock (``django_tokenbucket.lifecycle``)."""
    global _settings_generation
    _settings_generation += 1


class _Connection(NamedTuple):
    """What a backend reuses between decisions until CACHES or TOKENBUCKET changes."""

    generation: int
    client: Any
    #: ``KEY_PREFIX:VERSION:`` when the cache uses Django's default key function, else None.
    prefix: str | None
    make_key: Callable[[str], Any]
    #: ``TOKENBUCKET["CLOCK"] == "app"``: the script is sent this host's time.
    app_clock: bool
    #: The client's connection pool when it talks to one server (``_read``), else None.
    read_pool: Any
    #: That pool again when the client never retries a command: the script runs on it directly.
    script_pool: Any = None
    #: Under a deadline, the pool the script runs on (``bounded.single_execute``); None on a cluster.
    bounded_pool: Any = None


class _Limit(NamedTuple):
    """What every decision on one limit sends, formatted once."""

    config: LimitConfig
    #: The start of its state keys, up to the hash tag.
    key_head: str
    #: kind, rate, period, capacity, lowest and fresh value of the script's request
    #: argument (MessagePack), without and with ``reserve``...
    plain: bytes
    reserve: bytes
    #: ...and the fresh ts, when it does not depend on the key (all but fixed windows
    #: without a ``start``).
    fresh_ts: bytes | None


class RedisBackend(ReadsFirst, AnalyticsKeys, KeyspaceListing, BaseBackend):
    """Store limits in Redis, using the client of a django-redis cache.

    Options: ``CACHE``, the alias in ``CACHES`` (default ``"default"``); it must be a
    ``django_redis.cache.RedisCache``. For Redis Cluster, give that cache
    ``"CONNECTION_FACTORY": "django_tokenbucket.backends.redis.ClusterConnectionFactory"``.
    ``TIMEOUT`` (default ``bounded.DEFAULT_TIMEOUT``, 0.2): the seconds a whole call may
    take before it fails as a store failure, and unreachable nodes fail their keys' calls
    at once (``bounded``); ``None`` leaves each call to redis-py, unbounded. Where the
    cache sets no socket timeouts, the backend's calls go through a client of its own
    whose connections time out within the deadline (``clients``).
    """

    option_names = frozenset(_OPTIONS)
    unknown_option_check = catalogue.E021
    asyncio_native = True
    lists_buckets = True
    keeps_analytics = True

    def __init__(self, options: Mapping[str, Any], *, setting: str = "TOKENBUCKET") -> None:
        super().__init__(options, setting=setting)
        unknown = set(self.options) - _OPTIONS
        if unknown:
            raise ImproperlyConfigured(
                f"{setting}['OPTIONS'] has unknown option(s) for the Redis backend: "
                f"{', '.join(sorted(map(repr, unknown)))}; expected 'CACHE' or 'TIMEOUT'"
            )
        try:
            #: The deadline of a call in seconds, or None for none (``TIMEOUT: None``).
            self.timeout = deadline_option(self.options, setting)
        except ValueError as exc:
            raise ImproperlyConfigured(str(exc)) from None
        alias = self.options.get("CACHE", "default")
        if not isinstance(alias, str):
            raise ImproperlyConfigured(f"{setting}['OPTIONS']['CACHE'] must be a cache alias, not {alias!r}")
        self.cache_alias: str = alias
        self._script: Script | None = None
        self._script_lock = threading.Lock()
        self._connection: _Connection | None = None
        #: id(config) -> what it sends; the config is held, so its id cannot be reused.
        self._limits: dict[int, _Limit] = {}
        #: Figures for tests and operations: store failures by exception class, and
        #: how often the script had to be sent again (NOSCRIPT).
        self.errors: Counter[str] = Counter()
        #: When Redis last answered a decision: a reply that then times out finds it busy, not down.
        self.answers = Answers()
        self.script_reloads = 0
        #: Which keys to read first (see ``_read``), and how often a read was "sent" and
        #: "decided" the call without the script.
        self.recent_denials = RecentDenials()
        self.reads: Counter[str] = Counter()
        #: The asyncio clients of the async API, one per event loop.
        self.asyncio_clients = AsyncioClients(
            alias, setting, cluster_factory=ClusterConnectionFactory, deadline=self.timeout
        )
        #: Calls of the async API by how they reached Redis: "asyncio" (its own client)
        #: or "thread" (the blocking client in a worker thread, for cache settings that
        #: the asyncio client cannot mirror; ``asyncio_clients.thread_reason`` says why).
        self.async_calls: Counter[str] = Counter()
        self._asyncio_keys: tuple[int, str | None, Callable[[str], Any], Any, Any] | None = None

    @classmethod
    def check_options(cls, options: Mapping[str, Any], setting: str) -> list[Any]:
        """Check the cache behind the backend: it exists, is django-redis, and never evicts.

        Under an evicting ``maxmemory-policy`` Redis may delete a bucket's key when
        memory runs out, and a missing key reads as a full bucket: a silent reset. The
        policy is read with ``CONFIG GET``; when Redis is down or denies CONFIG (as
        managed services may), the check says nothing rather than guess.
        """
        return [*super().check_options(options, setting), *check_cache(options, setting)]

    # -- public helpers (operations, tests) ---------------------------------------------

    def client(self) -> Any:
        """Return the raw redis-py client of the cache (``Redis`` or ``RedisCluster``)."""
        return self._connect().client

    def key(self, config: LimitConfig, key: EncodedKey) -> str:
        """Return the Redis key that holds the state of ``config`` for ``key``."""
        return str(caches[self.cache_alias].make_key(state_key(config, key)))

    # -- BaseBackend ----------------------------------------------------------------------

    def decide(self, requests: Sequence[Request], *, apply: bool) -> Outcome:
        try:
            deadline = None if self.timeout is None else time.monotonic() + self.timeout
            # Inside the try: a cluster client discovers its nodes when it is made.
            connection = self._connect()
            if self._reads_first(requests, apply):
                read = self._read(connection, requests[0], apply=apply, deadline=deadline)
                if read is not None:
                    return read
            keys, argv = self._command(connection, requests, apply=apply)
            check_one_slot(connection.client, keys, requests)
            reply = self._run(connection, keys, argv, deadline)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc, ambiguous=apply and self._script_may_have_run(exc)) from exc
        return self._learned(reply_outcome(reply, len(requests)), requests, apply)

    async def adecide(self, requests: Sequence[Request], *, apply: bool) -> Outcome:
        """``decide()`` on the asyncio client of the running event loop: the same script,
        keys, clock and error mapping, without a thread; within the deadline, unless ``TIMEOUT`` is None."""
        if self.timeout is None:
            return await self._adecide(requests, apply, None)
        deadline = time.monotonic() + self.timeout
        try:
            async with asyncio.timeout(self.timeout):
                return await self._adecide(requests, apply, deadline)
        except TimeoutError as exc:  # asyncio's, at the deadline: what ran was cancelled
            raise self._failed(expired(self.timeout), ambiguous=apply) from exc

    async def _adecide(self, requests: Sequence[Request], apply: bool, deadline: float | None) -> Outcome:
        client = None
        try:
            connection = await self._aconnect()
            if connection is None:
                self.async_calls["thread"] += 1
                return await super().adecide(requests, apply=apply)
            self.async_calls["asyncio"] += 1
            if self._reads_first(requests, apply):
                read = await self._aread(connection, requests[0], apply=apply, deadline=deadline)
                if read is not None:
                    return read
            client = connection.client
            keys, argv = self._command(connection, requests, apply=apply)
            check_one_slot(client, keys, requests)
            reply = await self._arun(connection, keys, argv, deadline)
        except (RedisError, RedisClusterException, OSError) as exc:
            ambiguous = apply and client is not None and may_have_run(client, exc)
            raise self._failed(exc, ambiguous=ambiguous) from exc
        return self._learned(reply_outcome(reply, len(requests)), requests, apply)

    def _learned(self, outcome: Outcome, requests: Sequence[Request], apply: bool) -> Outcome:
        """Return ``outcome``, after remembering whether its key is likely denied next time."""
        self.answers.answered()
        if apply and len(requests) == 1:
            self.recent_denials.learn(self.cache_alias, requests[0], outcome.decisions[0])
        return outcome

    def _command(
        self, connection: _Connection, requests: Sequence[Request], *, apply: bool
    ) -> tuple[list[str], list[str | bytes]]:
        """Return the keys and arguments of the decision script for ``requests``."""
        override = clock.override()
        if override is not None:
            now, header = str(override), PINNED_HEADERS[apply]
        elif connection.app_clock:
            now, header = str(clock.app_now()), HEADERS[apply]
        else:
            now, header = "-", HEADERS[apply]
        if len(requests) == 1:
            # The common call, without the bookkeeping of shared rows.
            request = requests[0]
            limit = self._limit(request.config)
            return [self._key(connection, limit, request.key)], [now, header, self._request_argument(limit, request, 1)]
        keys: list[str] = []
        argv: list[str | bytes] = [now, header]
        index: dict[RowId, int] = {}
        for request in requests:
            limit = self._limit(request.config)
            rid = row_id(request)
            if rid not in index:
                keys.append(self._key(connection, limit, request.key))
                index[rid] = len(keys)
            argv.append(self._request_argument(limit, request, index[rid]))
        return keys, argv

    def reset(self, config: LimitConfig, key: EncodedKey) -> None:
        try:
            self.client().delete(self.key(config, key))
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc) from exc

    async def areset(self, config: LimitConfig, key: EncodedKey) -> None:
        if self.timeout is None:
            await self._areset(config, key)
            return
        try:
            async with asyncio.timeout(self.timeout):
                await self._areset(config, key)
        except TimeoutError as exc:  # asyncio's, at the deadline
            raise self._failed(expired(self.timeout)) from exc

    async def _areset(self, config: LimitConfig, key: EncodedKey) -> None:
        try:
            connection = await self._aconnect()
            if connection is None:
                self.async_calls["thread"] += 1
                await super().areset(config, key)
                return
            self.async_calls["asyncio"] += 1
            await connection.client.delete(self._key(connection, self._limit(config), key))
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc) from exc

    def refund(self, config: LimitConfig, key: EncodedKey, amount: int) -> Outcome:
        """Give ``amount`` micro-tokens back, capped at the capacity, in one script run.

        The decision script with a negative count refills the limit and then adds the
        tokens, which is what ``algorithms.token_bucket_refund`` does; a value above the
        capacity is what every read caps, and its key expires at once (a full limit).
        Unlike the database backend, this does not join the caller's transaction.
        """
        return _capped(config, self.decide([_refund_request(config, key, amount)], apply=True))

    async def arefund(self, config: LimitConfig, key: EncodedKey, amount: int) -> Outcome:
        return _capped(config, await self.adecide([_refund_request(config, key, amount)], apply=True))

    def store_now(self) -> int:
        """Redis' ``TIME`` (the pinned or app clock when decisions use those)."""
        override = clock.override()
        if override is not None:
            return override
        if tokenbucket_settings.CLOCK == "app":
            return clock.app_now()
        try:
            return time_microseconds(node_clients(self.client())[0].time())
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc) from exc

    # -- internals ------------------------------------------------------------------------

    def _failed(self, exc: BaseException, *, ambiguous: bool = False) -> BackendError:
        self.errors[type(exc).__name__] += 1
        return BackendError(
            f"{type(exc).__name__}: {exc}", ambiguous=ambiguous, busy=awaited_reply(exc) and self.answers.recently()
        )

    def _script_may_have_run(self, exc: BaseException) -> bool:
        """Whether the script may have run although the call failed.

        Without client retries: when its reply timed out or the connection dropped while
        waiting for it (redis-py says "connecting" when no connection could be made, so
        nothing was sent). With retries (a cluster client, or a ``retry`` in the client's
        options), an earlier attempt may have run it before the one that failed, whatever
        the last one says.
        """
        connection = self._connection
        if connection is None:  # no client could be made: nothing was sent
            return False
        return may_have_run(connection.client, exc)

    def _connect(self) -> _Connection:
        """Return the client and key prefix of the cache, loaded again after CACHES changed.

        django-redis would look the cache up (a thread-local) and its client on every
        call; its connection pools are process-wide anyway, so one client serves all
        threads, as ``get_redis_connection`` would hand out the same pool. Under a
        deadline, a cache without socket timeouts is decided on through a client of the
        backend's own (``clients``).
        """
        connection = self._connection
        if connection is not None and connection.generation == _settings_generation:
            return connection
        generation = _settings_generation
        client = decision_client(self.cache_alias, self.setting, self.timeout)
        single = single_server_pool(client)
        connection = self._connection = _Connection(
            generation,
            client,
            *self._key_function(),
            _app_clock(),
            single,
            script_pool(client),
            None if isinstance(client, RedisCluster) else single or client.connection_pool,
        )
        return connection

    async def _aconnect(self) -> _Connection | None:
        """Return the running loop's asyncio client with the key prefix, or None for the thread path."""
        generation = _settings_generation
        client = await self.asyncio_clients.client(generation)
        if client is None:
            return None
        keys = self._asyncio_keys
        if keys is None or keys[0] != generation or keys[3] is not client:
            keys = self._asyncio_keys = (generation, *self._key_function(), client, single_server_pool(client))
        return _Connection(generation, client, keys[1], keys[2], _app_clock(), keys[4])

    def _key_function(self) -> tuple[str | None, Callable[[str], Any]]:
        """Return what keys are made with: the cache's prefix (with Django's default key
        function) and its ``make_key``."""
        cache = caches[self.cache_alias]
        prefix = f"{cache.key_prefix}:{cache.version}:" if cache.key_func is default_key_func else None
        return prefix, cache.make_key

    @staticmethod
    def _key(connection: _Connection, limit: _Limit, key: EncodedKey) -> str:
        if connection.prefix is not None:
            # What default_key_func makes of it, without the cache lookup per call.
            return connection.prefix + tagged_key(limit.key_head, key)
        return str(connection.make_key(tagged_key(limit.key_head, key)))

    def _limit(self, config: LimitConfig) -> _Limit:
        """Return what decisions on ``config`` send, formatted on its first decision only."""
        limit = self._limits.get(id(config))
        if limit is not None and limit.config is config:
            return limit
        algorithm = config.algorithm
        uncapped = None if config.max_reserved is None else -config.max_reserved
        # A fresh state's value is the capacity and, but for fixed windows without a
        # start, its ts is the same for every key.
        fresh = config.fresh_state("")
        fresh_ts = None if algorithm.phased and config.start is None else as_msgpack(fresh.ts)
        limit = _Limit(
            config,
            key_head(config),
            as_msgpack(algorithm.code, config.rate, config.period, config.capacity, 0, fresh.value),
            as_msgpack(algorithm.code, config.rate, config.period, config.capacity, uncapped, fresh.value),
            fresh_ts,
        )
        if len(self._limits) >= _LIMITS_CACHE_SIZE:
            # Inline configs may be made per call: start over rather than grow.
            self._limits.clear()
        self._limits[id(config)] = limit
        return limit

    @staticmethod
    def _request_argument(limit: _Limit, request: Request, key_index: int) -> bytes:
        fresh_ts = limit.fresh_ts
        if fresh_ts is None:  # the windows of this key
            fresh_ts = as_msgpack(limit.config.fresh_state(request.key.digest).ts)
        fields = limit.reserve if request.reserve else limit.plain
        return INDEX_AND_COUNT.pack(0xD3, key_index, 0xD3, request.count) + fields + fresh_ts

    def _run(self, connection: _Connection, keys: list[str], argv: list[str | bytes], deadline: float | None) -> Any:
        client = connection.client
        script = self._script
        if script is None:
            with self._script_lock:
                if self._script is None:
                    self._script = client.register_script(SCRIPT)
                script = self._script
        assert script is not None
        # Not evalsha(): its per-call argument-deprecation wrapper; and on a client that
        # never retries, not execute_command() either: its per-call hooks (run_on_link).
        execute: Callable[..., Any]
        if deadline is None:
            pool = connection.script_pool
            execute = client.execute_command if pool is None else partial(run_on_link, pool)
        elif connection.bounded_pool is not None:
            execute = partial(run_within, connection.bounded_pool, deadline, self.timeout or 0.0)
        else:
            key, timeout = keys[0], self.timeout or 0.0
            execute = lambda *args: cluster_execute(client, key, args, deadline, timeout)  # noqa: E731
        try:
            return execute("EVALSHA", script.sha, len(keys), *keys, *argv)
        except NoScriptError:
            self.script_reloads += 1
            # A flush, restart or failover emptied the script cache. EVAL runs the
            # script and caches it again in one round trip, on whichever node owns the slot.
            return execute("EVAL", SCRIPT, len(keys), *keys, *argv)

    async def _arun(
        self, connection: _Connection, keys: list[str], argv: list[str | bytes], deadline: float | None
    ) -> Any:
        client = connection.client
        pool = connection.read_pool  # None on a cluster
        bounded_cluster = deadline is not None and pool is None and isinstance(client, AsyncRedisCluster)
        call = partial(acluster_execute, client, keys[0]) if bounded_cluster else client.execute_command

        async def run() -> Any:
            try:
                return await call("EVALSHA", SCRIPT_SHA, len(keys), *keys, *argv)
            except NoScriptError:
                self.script_reloads += 1
                return await call("EVAL", SCRIPT, len(keys), *keys, *argv)

        if deadline is None or bounded_cluster:
            return await run()
        return await guarded(node_of(pool) if pool is not None else asyncio_node(client, keys[0]), run)


def _app_clock() -> bool:
    """Whether the script is sent this host's time (``TOKENBUCKET["CLOCK"] == "app"``)."""
    return bool(tokenbucket_settings.CLOCK == "app")


def _refund_request(config: LimitConfig, key: EncodedKey, amount: int) -> Request:
    """The decision script's request that gives ``amount`` micro-tokens back (``refund``):
    a negative count, as a reservation, on the limit without its ``max_reserved``."""
    return Request(replace(config, max_reserved=None), key, -amount, reserve=True)


def _capped(config: LimitConfig, outcome: Outcome) -> Outcome:
    """``outcome`` with a value above the capacity read as the capacity, as every read caps it."""
    decision = outcome.decisions[0]
    if decision.value > config.capacity:
        decision = replace(decision, value=config.capacity, full_after=0)
    return Outcome([decision], outcome.now)
