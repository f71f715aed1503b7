"""Limits in Redis, through a django-redis cache alias.

Each decision is one Lua script (``django_tokenbucket/lua/decide.lua``): it reads the
state of every limit of the call, takes the time from Redis' ``TIME``, decides all or
nothing with the same integer arithmetic as ``algorithms`` and writes what changed,
atomically. Every written key expires when its bucket would be full again, so an
absent key means "fresh" and idle keys clean themselves up.

Keys are made with the cache's key function (so ``KEY_PREFIX``, ``VERSION`` and
``KEY_FUNCTION`` apply) from ``tokenbucket:<name>:{<key digest[:16]>}<key digest[16:]>``.
The braces are a Redis Cluster hash tag: every limit of one key lives in one slot, so
``limit_many()`` over limits that share a key is one atomic script on a cluster too.

Unlike the database backend, a decision does not join the caller's database
transaction: a rollback does not return the tokens.

The async API (``alimit``...) decides on redis-py's asyncio client, built from the same
cache settings (``redis_asyncio``), one per event loop: no thread per decision.
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from importlib import resources
from typing import Any, NamedTuple

from django.conf import settings
from django.core import checks
from django.core.cache import InvalidCacheBackendError, caches
from django.core.cache.backends.base import default_key_func
from django.core.exceptions import ImproperlyConfigured
from django.core.signals import setting_changed
from django.dispatch import receiver

try:
    from django_redis import get_redis_connection
    from django_redis.pool import ConnectionFactory
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"the Redis backend needs django-redis: pip install 'dj-tokenbucket[redis]' ({exc})"
    ) from exc
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisClusterException, RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .. import clock
from ..algorithms import Decision, State
from ..keys import EncodedKey
from ..limits import FIXED_WINDOW, LimitConfig
from ..settings import tokenbucket_settings
from . import is_django_redis
from .base import BackendError, BaseBackend, Outcome, Request, RowId, row_id
from .redis_asyncio import AsyncioClients, missing_cache_error, not_django_redis_error

__all__ = ["SCRIPT", "ClusterConnectionFactory", "RedisBackend", "state_key"]

#: The decision script, shipped as package data.
SCRIPT = resources.files("django_tokenbucket").joinpath("lua", "decide.lua").read_text(encoding="utf-8")
#: Its SHA-1, the name EVALSHA runs it by.
SCRIPT_SHA = hashlib.sha1(SCRIPT.encode("utf-8")).hexdigest()

#: Bounds of a key's TTL in milliseconds. The upper one only keeps Redis' expiry
#: arithmetic in range: no bucket of a valid limit takes 285,000 years to refill.
MIN_TTL_MS = 1
MAX_TTL_MS = 2**53
#: With a pinned test clock, pinned time and Redis' time disagree: a key must not
#: expire (and read as full) while a test's pinned clock stands still.
PINNED_CLOCK_MIN_TTL_MS = 3_600_000

_OPTIONS = {"CACHE"}
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FIELDS = 6
#: The script's first argument when the store's clock applies, by ``apply``.
_STORE_CLOCK_HEADERS = {True: f"- 1 {MIN_TTL_MS} {MAX_TTL_MS}", False: f"- 0 {MIN_TTL_MS} {MAX_TTL_MS}"}
#: Limits whose arguments a backend keeps formatted.
_LIMITS_CACHE_SIZE = 4096

#: Bumped whenever CACHES changes, so that every backend reloads its client and key prefix.
_caches_generation = 0


@receiver(setting_changed)
def _caches_changed(*, setting: str, **kwargs: Any) -> None:
    global _caches_generation
    if setting == "CACHES":
        _caches_generation += 1


class _Connection(NamedTuple):
    """What a backend reuses between decisions until CACHES changes."""

    generation: int
    client: Any
    #: ``KEY_PREFIX:VERSION:`` when the cache uses Django's default key function, else None.
    prefix: str | None
    make_key: Callable[[str], Any]


class _Limit(NamedTuple):
    """What every decision on one limit sends, formatted once."""

    config: LimitConfig
    #: The start of its state keys, up to the hash tag.
    key_head: str
    #: "<kind> <rate> <period> <capacity> <lowest> <fresh value>" of the script's
    #: request argument, without and with ``reserve``.
    plain: str
    reserve: str
    #: The fresh ts when it does not depend on the key (all but unanchored fixed windows).
    fresh_ts: str | None


def state_key(config: LimitConfig, key: EncodedKey) -> str:
    """Return the key of one limit's state before the cache's key function is applied.

    Names made of ``[A-Za-z0-9_.-]`` (up to 64 characters) appear as they are; any
    other name is replaced by ``~`` and its SHA-256, so keys stay short, free of
    braces, and distinct for distinct names. The hash tag is the key's digest.
    """
    return _state_key(_key_head(config), key)


def _key_head(config: LimitConfig) -> str:
    name = config.name
    if not _PLAIN_NAME.fullmatch(name):
        name = "~" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    return f"tokenbucket:{name}:"


def _state_key(head: str, key: EncodedKey) -> str:
    digest = key.digest
    return f"{head}{{{digest[:16]}}}{digest[16:]}"


class RedisBackend(BaseBackend):
    """Store limits in Redis, using the client of a django-redis cache.

    Options: ``CACHE``, the alias in ``CACHES`` (default ``"default"``); it must be a
    ``django_redis.cache.RedisCache``. For Redis Cluster, give that cache
    ``"CONNECTION_FACTORY": "django_tokenbucket.backends.redis.ClusterConnectionFactory"``.
    """

    option_names = frozenset(_OPTIONS)
    unknown_option_id = "django_tokenbucket.E021"
    asyncio_native = True

    def __init__(self, options: Mapping[str, Any], *, setting: str = "TOKENBUCKET") -> None:
        super().__init__(options, setting=setting)
        unknown = set(self.options) - _OPTIONS
        if unknown:
            raise ImproperlyConfigured(
                f"{setting}['OPTIONS'] has unknown option(s) for the Redis backend: "
                f"{', '.join(sorted(map(repr, unknown)))}; expected 'CACHE'"
            )
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
        self.script_reloads = 0
        #: The asyncio clients of the async API, one per event loop.
        self.asyncio_clients = AsyncioClients(alias, setting, cluster_factory=ClusterConnectionFactory)
        #: Calls of the async API by how they reached Redis: "asyncio" (its own client)
        #: or "thread" (the blocking client in a worker thread, for cache settings that
        #: the asyncio client cannot mirror; ``asyncio_clients.thread_reason`` says why).
        self.async_calls: Counter[str] = Counter()
        self._asyncio_keys: tuple[int, str | None, Callable[[str], Any]] | None = None

    @classmethod
    def check_options(cls, options: Mapping[str, Any], setting: str) -> list[Any]:
        """Check the cache behind the backend: it exists, is django-redis, and never evicts.

        Under an evicting ``maxmemory-policy`` Redis may delete a bucket's key when
        memory runs out, and a missing key reads as a full bucket: a silent reset. The
        policy is read with ``CONFIG GET``; when Redis is down or denies CONFIG (as
        managed services may), the check says nothing rather than guess.
        """
        messages = super().check_options(options, setting)
        alias = options.get("CACHE", "default")
        hint = (
            f"Point {setting}['OPTIONS']['CACHE'] at a cache whose BACKEND is 'django_redis.cache.RedisCache' "
            "(pip install 'dj-tokenbucket[redis]')."
        )
        cache_settings: dict[str, Any] = getattr(settings, "CACHES", {})
        if not isinstance(alias, str) or alias not in cache_settings:
            messages.append(
                checks.Error(
                    f"{setting}['OPTIONS']['CACHE'] = {alias!r} is not an alias in CACHES.",
                    hint=hint,
                    id="django_tokenbucket.E020",
                )
            )
            return messages
        cache_backend = cache_settings[alias].get("BACKEND")
        if not is_django_redis(cache_backend):
            messages.append(
                checks.Warning(
                    f"The Redis rate-limit backend uses CACHES[{alias!r}], whose BACKEND {cache_backend!r} "
                    f"is not a django-redis cache: every rate-limit call will fail.",
                    hint=hint,
                    id="django_tokenbucket.W020",
                )
            )
            return messages
        policy = _eviction_policy(alias)
        if policy is not None and policy != "noeviction":
            messages.append(
                checks.Warning(
                    f"The Redis behind CACHES[{alias!r}] has maxmemory-policy {policy!r}: when its memory is "
                    f"full it may delete rate-limit keys, and a deleted bucket reads as full again.",
                    hint="Set maxmemory-policy to 'noeviction' (a full Redis then fails calls, and "
                    "FAIL_OPEN decides), or give the limits a Redis of their own.",
                    id="django_tokenbucket.W021",
                )
            )
        return messages

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
            # Inside the try: a cluster client discovers its nodes when it is made.
            connection = self._connect()
            keys, argv = self._command(connection, requests, apply=apply)
            self._check_slots(connection.client, keys, requests)
            reply = self._run(connection.client, keys, argv)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc, ambiguous=apply and self._script_may_have_run(exc)) from exc
        return self._outcome(reply, len(requests))

    async def adecide(self, requests: Sequence[Request], *, apply: bool) -> Outcome:
        """``decide()`` on the asyncio client of the running event loop: the same script,
        keys, clock and error mapping, without a thread."""
        client = None
        try:
            connection = await self._aconnect()
            if connection is None:
                self.async_calls["thread"] += 1
                return await super().adecide(requests, apply=apply)
            self.async_calls["asyncio"] += 1
            client = connection.client
            keys, argv = self._command(connection, requests, apply=apply)
            self._check_slots(client, keys, requests)
            reply = await self._arun(client, keys, argv)
        except (RedisError, RedisClusterException, OSError) as exc:
            ambiguous = apply and client is not None and _may_have_run(client, exc)
            raise self._failed(exc, ambiguous=ambiguous) from exc
        return self._outcome(reply, len(requests))

    def _command(
        self, connection: _Connection, requests: Sequence[Request], *, apply: bool
    ) -> tuple[list[str], list[str]]:
        """Return the keys and arguments of the decision script for ``requests``."""
        override = clock.override()
        if override is not None:
            header = f"{override} {int(apply)} {PINNED_CLOCK_MIN_TTL_MS} {MAX_TTL_MS}"
        elif tokenbucket_settings.CLOCK == "app":
            header = f"{clock.app_now()} {int(apply)} {MIN_TTL_MS} {MAX_TTL_MS}"
        else:
            header = _STORE_CLOCK_HEADERS[apply]
        if len(requests) == 1:
            # The common call, without the bookkeeping of shared rows.
            request = requests[0]
            limit = self._limit(request.config)
            return [self._key(connection, limit, request.key)], [header, self._request_argument(limit, request, 1)]
        keys: list[str] = []
        argv = [header]
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

    # -- internals ------------------------------------------------------------------------

    def _failed(self, exc: BaseException, *, ambiguous: bool = False) -> BackendError:
        self.errors[type(exc).__name__] += 1
        return BackendError(f"{type(exc).__name__}: {exc}", ambiguous=ambiguous)

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
        return _may_have_run(connection.client, exc)

    def _connect(self) -> _Connection:
        """Return the client and key prefix of the cache, loaded again after CACHES changed.

        django-redis would look the cache up (a thread-local) and its client on every
        call; its connection pools are process-wide anyway, so one client serves all
        threads, as ``get_redis_connection`` would hand out the same pool.
        """
        connection = self._connection
        if connection is not None and connection.generation == _caches_generation:
            return connection
        generation = _caches_generation
        try:
            client = get_redis_connection(self.cache_alias, write=True)
        except InvalidCacheBackendError:
            raise missing_cache_error(self.cache_alias, self.setting) from None
        except NotImplementedError:
            raise not_django_redis_error(self.cache_alias) from None
        connection = self._connection = _Connection(generation, client, *self._key_function())
        return connection

    async def _aconnect(self) -> _Connection | None:
        """Return the running loop's asyncio client with the key prefix, or None for the thread path."""
        generation = _caches_generation
        client = await self.asyncio_clients.client(generation)
        if client is None:
            return None
        keys = self._asyncio_keys
        if keys is None or keys[0] != generation:
            keys = self._asyncio_keys = (generation, *self._key_function())
        return _Connection(generation, client, keys[1], keys[2])

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
            return connection.prefix + _state_key(limit.key_head, key)
        return str(connection.make_key(_state_key(limit.key_head, key)))

    def _limit(self, config: LimitConfig) -> _Limit:
        """Return what decisions on ``config`` send, formatted on its first decision only."""
        limit = self._limits.get(id(config))
        if limit is not None and limit.config is config:
            return limit
        head = f"{'f' if config.kind == FIXED_WINDOW else 't'} {config.rate} {config.period} {config.capacity}"
        uncapped = "-" if config.max_reserved is None else str(-config.max_reserved)
        # A fresh state's value is the capacity and, but for fixed windows without a
        # start, its ts is the same for every key.
        fresh = config.fresh_state("")
        fresh_ts = None if config.kind == FIXED_WINDOW and config.start is None else str(fresh.ts)
        limit = _Limit(
            config, _key_head(config), f"{head} 0 {fresh.value}", f"{head} {uncapped} {fresh.value}", fresh_ts
        )
        if len(self._limits) >= _LIMITS_CACHE_SIZE:
            # Inline configs may be made per call: start over rather than grow.
            self._limits.clear()
        self._limits[id(config)] = limit
        return limit

    @staticmethod
    def _request_argument(limit: _Limit, request: Request, key_index: int) -> str:
        fresh_ts = limit.fresh_ts
        if fresh_ts is None:
            fresh_ts = str(limit.config.fresh_state(request.key.digest).ts)
        return f"{key_index} {request.count} {limit.reserve if request.reserve else limit.plain} {fresh_ts}"

    @staticmethod
    def _check_slots(client: Any, keys: list[str], requests: Sequence[Request]) -> None:
        if len(keys) < 2 or not isinstance(client, (RedisCluster, AsyncRedisCluster)):
            return
        cluster: Any = client
        if len({cluster.keyslot(key) for key in keys}) > 1:
            names = ", ".join(sorted({repr(r.config.name) for r in requests}))
            raise ImproperlyConfigured(
                f"rate limits {names}: on Redis Cluster, limits decided together (limit_many) must "
                f"share one key, so that their states live in one hash slot; these use different "
                f"keys (or a KEY_FUNCTION that moved the hash tag)"
            )

    def _run(self, client: Any, keys: list[str], argv: list[str]) -> Any:
        script = self._script
        if script is None:
            with self._script_lock:
                if self._script is None:
                    self._script = client.register_script(SCRIPT)
                script = self._script
        assert script is not None
        # execute_command rather than evalsha(): the same command, without redis-py's
        # per-call argument-deprecation wrapper.
        try:
            return client.execute_command("EVALSHA", script.sha, len(keys), *keys, *argv)
        except NoScriptError:
            self.script_reloads += 1
            # A flush, restart or failover emptied the script cache. EVAL runs the
            # script and caches it again in one round trip, on whichever node owns the slot.
            return client.execute_command("EVAL", SCRIPT, len(keys), *keys, *argv)

    async def _arun(self, client: Any, keys: list[str], argv: list[str]) -> Any:
        try:
            return await client.execute_command("EVALSHA", SCRIPT_SHA, len(keys), *keys, *argv)
        except NoScriptError:
            self.script_reloads += 1
            return await client.execute_command("EVAL", SCRIPT, len(keys), *keys, *argv)

    @staticmethod
    def _outcome(reply: Any, count: int) -> Outcome:
        if isinstance(reply, bytes):
            reply = reply.decode("ascii", "replace")
        fields: list[str] = reply.split(" ") if isinstance(reply, str) else []
        if len(fields) != 1 + _FIELDS * count:
            raise BackendError(f"unexpected reply from the decision script: {reply!r}")
        decisions = []
        for start in range(1, len(fields), _FIELDS):
            allowed, value, retry_after, full_after, state_value, state_ts = fields[start : start + _FIELDS]
            decisions.append(
                Decision(
                    allowed == "1",
                    int(value),
                    None if retry_after == "-" else int(retry_after),
                    int(full_after),
                    None if state_value == "-" else State(int(state_value), int(state_ts)),
                )
            )
        return Outcome(decisions, int(fields[0]))


def _refund_request(config: LimitConfig, key: EncodedKey, amount: int) -> Request:
    return Request(replace(config, max_reserved=None), key, -amount, reserve=True)


def _capped(config: LimitConfig, outcome: Outcome) -> Outcome:
    decision = outcome.decisions[0]
    if decision.value > config.capacity:
        decision = replace(decision, value=config.capacity, full_after=0)
    return Outcome([decision], outcome.now)


def _may_have_run(client: Any, exc: BaseException) -> bool:
    """Whether the script may have run although the call on ``client`` failed (see ``_script_may_have_run``)."""
    if _client_retries(client):
        return True
    if isinstance(exc, ResponseError):  # Redis answered: the script failed or never ran
        return False
    return isinstance(exc, (RedisConnectionError, RedisTimeoutError)) and "connecting" not in str(exc)


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


def _eviction_policy(alias: str) -> str | None:
    """Return Redis' maxmemory-policy, the first evicting one of a cluster's nodes, or None if unknown."""
    try:
        reply = get_redis_connection(alias).config_get("maxmemory-policy")
    except Exception:  # down, CONFIG denied or renamed, not a Redis: nothing to report
        return None
    policies = []
    pending: list[Any] = [reply]
    while pending:  # a cluster client answers per node: {node: {name: value}}
        item = pending.pop()
        if isinstance(item, dict):
            for name, value in item.items():
                if isinstance(value, dict):
                    pending.append(value)
                elif (name.decode() if isinstance(name, bytes) else name) == "maxmemory-policy":
                    policies.append(value.decode() if isinstance(value, bytes) else str(value))
    evicting = sorted(p for p in policies if p != "noeviction")
    return evicting[0] if evicting else (policies[0] if policies else None)
