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
"""

from __future__ import annotations

import hashlib
import re
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import replace
from importlib import resources
from typing import Any

from django.core.cache import caches
from django.core.exceptions import ImproperlyConfigured

try:
    from django_redis import get_redis_connection
    from django_redis.pool import ConnectionFactory
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"the Redis backend needs django-redis: pip install 'django-tokenbucket[redis]' ({exc})"
    ) from exc
from redis.cluster import RedisCluster
from redis.commands.core import Script
from redis.exceptions import NoScriptError, RedisClusterException, RedisError

from .. import clock
from ..algorithms import Decision, State
from ..conf import tokenbucket_settings
from ..config import FIXED_WINDOW, LimitConfig
from ..keys import EncodedKey
from .base import BackendError, BaseBackend, Outcome, Request, RowId, row_id

__all__ = ["SCRIPT", "ClusterConnectionFactory", "RedisBackend", "state_key"]

#: The decision script, shipped as package data.
SCRIPT = resources.files("django_tokenbucket").joinpath("lua", "decide.lua").read_text(encoding="utf-8")

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


def state_key(config: LimitConfig, key: EncodedKey) -> str:
    """Return the key of one limit's state before the cache's key function is applied.

    Names made of ``[A-Za-z0-9_.-]`` (up to 64 characters) appear as they are; any
    other name is replaced by ``~`` and its SHA-256, so keys stay short, free of
    braces, and distinct for distinct names. The hash tag is the key's digest.
    """
    name = config.name
    if not _PLAIN_NAME.fullmatch(name):
        name = "~" + hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()
    digest = key.digest
    return f"tokenbucket:{name}:{{{digest[:16]}}}{digest[16:]}"


class RedisBackend(BaseBackend):
    """Store limits in Redis, using the client of a django-redis cache.

    Options: ``CACHE``, the alias in ``CACHES`` (default ``"default"``); it must be a
    ``django_redis.cache.RedisCache``. For Redis Cluster, give that cache
    ``"CONNECTION_FACTORY": "django_tokenbucket.backends.redis.ClusterConnectionFactory"``.
    """

    def __init__(self, options: Mapping[str, Any]) -> None:
        super().__init__(options)
        unknown = set(self.options) - _OPTIONS
        if unknown:
            raise ImproperlyConfigured(
                f"TOKENBUCKET['OPTIONS'] has unknown option(s) for the Redis backend: "
                f"{', '.join(sorted(map(repr, unknown)))}; expected 'CACHE'"
            )
        alias = self.options.get("CACHE", "default")
        if not isinstance(alias, str):
            raise ImproperlyConfigured(f"TOKENBUCKET['OPTIONS']['CACHE'] must be a cache alias, not {alias!r}")
        self.cache_alias: str = alias
        self._script: Script | None = None
        self._script_lock = threading.Lock()
        #: Figures for tests and operations: store failures by exception class, and
        #: how often the script had to be sent again (NOSCRIPT).
        self.errors: Counter[str] = Counter()
        self.script_reloads = 0

    # -- public helpers (operations, tests) ---------------------------------------------

    def client(self) -> Any:
        """Return the raw redis-py client of the cache (``Redis`` or ``RedisCluster``)."""
        try:
            return get_redis_connection(self.cache_alias, write=True)
        except NotImplementedError:
            raise ImproperlyConfigured(
                f"the Redis backend needs a django-redis cache, and CACHES[{self.cache_alias!r}] is not one "
                f"(set its BACKEND to 'django_redis.cache.RedisCache')"
            ) from None

    def key(self, config: LimitConfig, key: EncodedKey) -> str:
        """Return the Redis key that holds the state of ``config`` for ``key``."""
        return str(caches[self.cache_alias].make_key(state_key(config, key)))

    # -- BaseBackend ----------------------------------------------------------------------

    def decide(self, requests: Sequence[Request], *, apply: bool) -> Outcome:
        keys: list[str] = []
        index: dict[RowId, int] = {}
        override = clock.override()
        if override is not None:
            now, min_ttl = str(override), PINNED_CLOCK_MIN_TTL_MS
        elif tokenbucket_settings.CLOCK == "app":
            now, min_ttl = str(clock.app_now()), MIN_TTL_MS
        else:
            now, min_ttl = "", MIN_TTL_MS
        argv = [now, "1" if apply else "0", str(min_ttl), str(MAX_TTL_MS), str(len(requests))]
        for request in requests:
            rid = row_id(request)
            if rid not in index:
                keys.append(self.key(request.config, request.key))
                index[rid] = len(keys)
            argv += self._request_arguments(request, index[rid])
        try:
            client = self.client()
            self._check_slots(client, keys, requests)
            reply = self._run(client, keys, argv)
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc) from exc
        return self._outcome(reply, len(requests))

    def reset(self, config: LimitConfig, key: EncodedKey) -> None:
        try:
            self.client().delete(self.key(config, key))
        except (RedisError, RedisClusterException, OSError) as exc:
            raise self._failed(exc) from exc

    def refund(self, config: LimitConfig, key: EncodedKey, amount: int) -> Outcome:
        """Give ``amount`` micro-tokens back, capped at the capacity, in one script run.

        The decision script with a negative count refills the limit and then adds the
        tokens, which is what ``algorithms.token_bucket_refund`` does; a value above the
        capacity is what every read caps, and its key expires at once (a full limit).
        Unlike the database backend, this does not join the caller's transaction.
        """
        uncapped = replace(config, max_reserved=None)
        outcome = self.decide([Request(uncapped, key, -amount, reserve=True)], apply=True)
        decision = outcome.decisions[0]
        if decision.value > config.capacity:
            decision = replace(decision, value=config.capacity, full_after=0)
        return Outcome([decision], outcome.now)

    # -- internals ------------------------------------------------------------------------

    def _failed(self, exc: BaseException) -> BackendError:
        self.errors[type(exc).__name__] += 1
        return BackendError(f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _request_arguments(request: Request, key_index: int) -> list[str]:
        config = request.config
        if not request.reserve:
            lowest = "0"
        elif config.max_reserved is None:
            lowest = ""
        else:
            lowest = str(-config.max_reserved)
        fresh = config.fresh_state(request.key.digest)
        return [
            str(key_index),
            "f" if config.kind == FIXED_WINDOW else "t",
            str(config.rate),
            str(config.period),
            str(config.capacity),
            lowest,
            str(request.count),
            str(fresh.value),
            str(fresh.ts),
        ]

    @staticmethod
    def _check_slots(client: Any, keys: list[str], requests: Sequence[Request]) -> None:
        if len(keys) < 2 or not isinstance(client, RedisCluster):
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
        try:
            return client.evalsha(script.sha, len(keys), *keys, *argv)
        except NoScriptError:
            self.script_reloads += 1
            # A flush, restart or failover emptied the script cache. EVAL runs the
            # script and caches it again in one round trip, on whichever node owns the slot.
            return client.eval(SCRIPT, len(keys), *keys, *argv)

    @staticmethod
    def _outcome(reply: Sequence[Any], count: int) -> Outcome:
        if len(reply) != 1 + _FIELDS * count:
            raise BackendError(f"unexpected reply from the decision script: {reply!r}")
        decisions = []
        for start in range(1, len(reply), _FIELDS):
            allowed, value, retry_after, full_after, state_value, state_ts = reply[start : start + _FIELDS]
            decisions.append(
                Decision(
                    allowed=allowed in (b"1", "1"),
                    value=int(value),
                    retry_after=int(retry_after) if retry_after else None,
                    full_after=int(full_after),
                    state=State(int(state_value), int(state_ts)) if state_value else None,
                )
            )
        return Outcome(decisions, int(reply[0]))


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
