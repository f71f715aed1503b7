"""The Redis backend's ``TIMEOUT`` (one deadline per call) and its per-node breaker, on
private redis-server processes that the tests stop and freeze (SIGSTOP), and on a loopback
address that never answers a connection (``SilentHost``): nothing mocked. Both are on by
default (issue 46): the cases "at the defaults" configure neither ``TIMEOUT`` nor any
socket timeout, as a project that configures nothing.

Times are checked against bounds far from the figures they tell apart (a call bounded
by TIMEOUT = 0.3 s against a SOCKET_TIMEOUT of 5 s), never as performance figures.
Connection attempts are counted by a connection class that counts the sockets it opens
(tests/redis_servers.py), so "no attempt while the breaker is open" is exact.
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager

import pytest
from django.conf import settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from django_redis import get_redis_connection
from django_redis.pool import ConnectionFactory

from django_tokenbucket import BackendUnavailable, limiter
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.base import BUSY_WINDOW
from django_tokenbucket.backends.redis import aio
from django_tokenbucket.backends.redis.bounded import DEFAULT_TIMEOUT
from django_tokenbucket.backends.redis.breaker import BREAKERS, MAX_BACKOFF
from django_tokenbucket.keys import encode_key
from django_tokenbucket.testing import frozen_clock

from .redis_servers import (
    CONNECTS,
    AsyncCountingConnection,
    CountingConnection,
    LocalSentinel,
    RedisServer,
    SilentHost,
)
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.default_deadline

REDIS_BACKEND = "django_tokenbucket.backends.redis.RedisBackend"
T0 = 1_700_000_000.0
TIMEOUT = 0.3
#: Far above TIMEOUT: a call that waited for it was not bounded by the deadline.
SOCKET_TIMEOUT = 5.0
#: What a call may take beyond TIMEOUT on a busy 2-core machine: scheduling, not waiting.
MARGIN = 1.5


@pytest.fixture(autouse=True)
def fresh_breakers(monkeypatch):
    # The asyncio client mirrors the counting connection class by its counterpart.
    monkeypatch.setitem(aio._ASYNCIO_CLASSES, CountingConnection, AsyncCountingConnection)
    BREAKERS.clear()
    yield
    BREAKERS.clear()


@contextmanager
def bounded_redis(server: RedisServer, timeout: float | None = TIMEOUT, fail_open: bool = False, **cache_options):
    """The limiter on ``server`` with ``TIMEOUT``, through the counting connection class."""
    cache = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": server.url,
        "OPTIONS": {
            "SOCKET_CONNECT_TIMEOUT": 0.2,
            "SOCKET_TIMEOUT": SOCKET_TIMEOUT,
            "CONNECTION_POOL_KWARGS": {"connection_class": CountingConnection},
            **cache_options,
        },
    }
    tokenbucket = {
        **BASE_SETTINGS,
        "BACKEND": REDIS_BACKEND,
        "OPTIONS": {"CACHE": "private", "TIMEOUT": timeout},
        "FAIL_OPEN": fail_open,
    }
    with override_settings(CACHES={**settings.CACHES, "private": cache}, TOKENBUCKET=tokenbucket):
        yield get_backend()


@contextmanager
def at_the_defaults(url: str):
    """The limiter on ``url`` as a project that configures nothing has it: no ``TIMEOUT``,
    no socket timeout (only the counting connection class, which changes no timeout)."""
    cache = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": url,
        "OPTIONS": {"CONNECTION_POOL_KWARGS": {"connection_class": CountingConnection}},
    }
    tokenbucket = {**BASE_SETTINGS, "BACKEND": REDIS_BACKEND, "OPTIONS": {"CACHE": "private"}}
    with override_settings(CACHES={**settings.CACHES, "private": cache}, TOKENBUCKET=tokenbucket):
        yield get_backend()


def decide(api: str, name: str, key: str):
    """One ``limit()`` on the sync or the asyncio API."""
    if api == "sync":
        return limiter.limit(name, key)
    return asyncio.run(limiter.alimit(name, key))


def timed_failure(api: str, key: str) -> tuple[float, str]:
    started = time.monotonic()
    with pytest.raises(BackendUnavailable) as raised:
        decide(api, "login", key)
    return time.monotonic() - started, str(raised.value)


def until_answered(api: str, key: str):
    """Decide until the breaker lets a probe through to the server again (its back-off)."""
    ends = time.monotonic() + MAX_BACKOFF + MARGIN
    while True:
        try:
            return decide(api, "login", key)
        except BackendUnavailable:
            assert time.monotonic() < ends, "no probe reached the server again"
            time.sleep(0.01)


API = pytest.mark.parametrize("api", ["sync", "asyncio"])


@pytest.mark.redis_processes
@pytest.mark.redis_faults
@API
def test_a_frozen_server_fails_each_call_at_the_deadline_not_the_socket_timeout(api):
    with RedisServer() as server, bounded_redis(server) as backend, frozen_clock(T0):
        assert decide(api, "login", "frozen").ok
        server.pause()
        try:
            # The sync API: the call on the connection already open. A call that must open
            # a new one waits for its handshake up to SOCKET_TIMEOUT (docs/redis.md, W022):
            # asyncio's calls, cancelled at the deadline, do not.
            calls = 1 if api == "sync" else 4
            failures = [timed_failure(api, "frozen") for _ in range(calls)]
        finally:
            server.resume()
        # Each call ended at TIMEOUT, never at the 5 s SOCKET_TIMEOUT; a server that accepts
        # connections is not unreachable, so no breaker held it off.
        assert max(elapsed for elapsed, _ in failures) < TIMEOUT + MARGIN, failures
        assert all("TIMEOUT = 0.3 s" in text for _, text in failures), failures
        assert backend.errors["DeadlineExceeded"] == calls
        status = decide(api, "login", "frozen")
        # The scripts sent to the frozen server may have run once it woke: spent, never more.
        assert status.ok and 0 <= status.value <= 3


@pytest.mark.redis_processes
@pytest.mark.redis_faults
@API
def test_an_unreachable_server_is_left_alone_until_one_probe_finds_it_again(api):
    server = RedisServer()
    with server, bounded_redis(server) as backend, frozen_clock(T0):
        assert decide(api, "login", "down").ok
        node = f"127.0.0.1:{server.port}"
        server.stop()
        breaker = BREAKERS.get(node)
        calls = rejected_calls = 0
        ended = time.monotonic() + 3 * MAX_BACKOFF
        while time.monotonic() < ended:
            connects, rejected = CONNECTS[server.port], breaker.rejected
            elapsed, text = timed_failure(api, "down")
            calls += 1
            if breaker.rejected > rejected:
                # Failed by the breaker: at once, and without a connection attempt.
                rejected_calls += 1
                assert CONNECTS[server.port] == connects and "could not be reached lately" in text
            else:
                assert CONNECTS[server.port] == connects + 1  # the probe: one attempt, no retry
            assert elapsed < TIMEOUT + MARGIN
        probes = calls - rejected_calls
        assert rejected_calls > probes > 0  # most calls never tried; each back-off let one through
        assert backend.errors["NodeUnavailable"] == rejected_calls
        server.start()  # on the same port
        until_answered(api, "down")  # the next probe finds it, and closes the breaker
        assert breaker.state == "closed"
        assert decide(api, "login", "down").ok


@pytest.mark.redis_processes
@pytest.mark.redis_faults
def test_fail_open_applies_to_a_call_past_its_deadline():
    """With FAIL_OPEN, a call past its deadline is let through once Redis has been quiet
    for BUSY_WINDOW; just after an answer, Redis is taken for busy, and the call is
    refused (issue 35, item 7: a flood's timeouts must not let it past the limit)."""
    with RedisServer() as server, bounded_redis(server, fail_open=True) as backend, frozen_clock(T0):
        assert limiter.limit("login", "open").ok
        server.pause()
        try:
            with pytest.raises(BackendUnavailable, match="the store is busy"):
                limiter.limit("login", "open")
            time.sleep(BUSY_WINDOW + 0.05)
            status = limiter.limit("login", "open")
        finally:
            server.resume()
            BREAKERS.clear()
        assert status.ok and status.failed_open
        # The first call ran out of its deadline; the second one opens a new connection,
        # whose handshake the frozen server never answers.
        assert backend.errors["DeadlineExceeded"] >= 1 and backend.errors.total() == 2, backend.errors


@pytest.mark.redis_processes
@pytest.mark.redis_faults
def test_without_timeout_the_socket_timeout_alone_bounds_a_call():
    """The negative control: the same frozen server, no TIMEOUT, a 1 s SOCKET_TIMEOUT."""
    with RedisServer() as server, bounded_redis(server, timeout=None, SOCKET_TIMEOUT=1) as backend:
        assert limiter.limit("login", "control").ok
        server.pause()
        try:
            elapsed, text = timed_failure("sync", "control")
        finally:
            server.resume()
        assert elapsed >= 1.0 and "Timeout reading" in text
        assert backend.errors["TimeoutError"] == 1


# -- at the defaults: no TIMEOUT, no socket timeouts -------------------------------------------


@pytest.mark.redis_processes
@pytest.mark.redis_faults
@API
def test_at_the_defaults_every_call_on_a_frozen_server_ends_at_the_default_deadline(api):
    """A frozen server accepts connections and answers nothing. Without a deadline, and
    with django-redis passing no socket timeout, redis-py waits 5 s for each reply (for
    ever before redis-py 8). At the defaults every call ends by the default deadline, those
    that must open a new connection included: its handshake is bounded by the backend's
    own connections' socket timeout, the deadline (a connect and its handshake can take
    one and a half deadlines at most)."""
    with RedisServer() as server, at_the_defaults(server.url) as backend, frozen_clock(T0):
        assert backend.timeout == DEFAULT_TIMEOUT
        assert decide(api, "login", "frozen").ok
        server.pause()
        try:
            failures = [timed_failure(api, "frozen") for _ in range(4)]
        finally:
            server.resume()
        assert max(elapsed for elapsed, _ in failures) < 1.5 * DEFAULT_TIMEOUT + MARGIN, failures
        assert backend.errors["DeadlineExceeded"] >= 1, backend.errors
        BREAKERS.clear()
        assert until_answered(api, "frozen").ok


@pytest.mark.redis_processes
@pytest.mark.redis_faults
@API
def test_at_the_defaults_a_host_that_never_answers_fails_at_once_after_its_first_call(api):
    """A host that is down (its SYNs unanswered): without a connect timeout redis-py waits
    5 s per connection (before redis-py 8, the system's SYN retries: minutes). At the
    defaults the backend's own connections give up connecting within half the deadline,
    which opens the node's breaker: the calls after it fail at once, without a connection
    attempt, until a probe tries again."""
    with SilentHost() as host, at_the_defaults(host.url) as backend:
        breaker = BREAKERS.get(f"127.0.0.1:{host.port}")
        calls = failures_for(api, "silent", seconds=1.0, port=host.port)
        assert max(elapsed for elapsed, _, _ in calls) < DEFAULT_TIMEOUT + MARGIN, calls[:5]
        refused = [elapsed for elapsed, was_refused, _ in calls if was_refused]
        # Most calls were refused by the breaker, without trying to connect, at once.
        assert len(refused) > len(calls) / 2 and breaker.rejected == len(refused)
        assert all(connected == 0 for _, was_refused, connected in calls if was_refused)
        assert sorted(refused)[len(refused) // 2] < 0.005
        # The calls let through (the first one and the probes) each tried once.
        assert all(connected == 1 for _, was_refused, connected in calls if not was_refused)
        assert backend.errors["NodeUnavailable"] == len(refused)


def failures_for(api: str, key: str, *, seconds: float, port: int) -> list[tuple[float, bool, int]]:
    """Fail ``limit()`` on ``key`` for ``seconds``, each call timed on its own (asyncio: in one
    event loop): (seconds it took, whether the breaker refused it, connections it tried)."""
    calls: list[tuple[float, bool, int]] = []

    def record(started: float, rejected: int, connects: int, error: BaseException | None) -> None:
        assert isinstance(error, BackendUnavailable), error
        breaker = BREAKERS.get(f"127.0.0.1:{port}")
        calls.append((time.monotonic() - started, breaker.rejected > rejected, CONNECTS[port] - connects))

    def state() -> tuple[float, int, int]:
        return time.monotonic(), BREAKERS.get(f"127.0.0.1:{port}").rejected, CONNECTS[port]

    ends = time.monotonic() + seconds
    if api == "sync":
        while time.monotonic() < ends:
            before = state()
            try:
                limiter.limit("login", key)
            except BaseException as exc:
                record(*before, exc)
            else:
                record(*before, None)
        return calls

    async def run() -> None:
        while time.monotonic() < ends:
            before = state()
            try:
                await limiter.alimit("login", key)
            except BaseException as exc:
                record(*before, exc)
            else:
                record(*before, None)

    asyncio.run(run())
    return calls


@pytest.mark.redis
def test_at_the_defaults_the_backend_has_a_client_of_its_own_and_the_cache_keeps_its_own():
    """The socket timeouts the backend needs must not change the cache's own calls: where the
    cache sets none, the backend decides on a client of its own (the same server and
    options, its timeouts filled in); a cache that sets them is shared as it is."""
    bare = settings.CACHES["redis-bare"]  # no OPTIONS, a URL of its own (see tests/settings.py)
    tokenbucket = {**BASE_SETTINGS, "BACKEND": REDIS_BACKEND, "OPTIONS": {"CACHE": "bare"}}
    with override_settings(CACHES={**settings.CACHES, "bare": bare}, TOKENBUCKET=tokenbucket):
        backend = get_backend()
        assert limiter.limit("login", "own").ok
        own, cached = backend.client().connection_pool, get_redis_connection("bare").connection_pool
        assert own is not cached
        assert own.connection_kwargs["socket_timeout"] == DEFAULT_TIMEOUT
        assert own.connection_kwargs["socket_connect_timeout"] == DEFAULT_TIMEOUT / 2
        # What django-redis gives the cache's client: no socket timeout of ours.
        assert "socket_timeout" not in cached.connection_kwargs
        assert "socket_connect_timeout" not in cached.connection_kwargs
        backend.reset(limiter.resolve("login"), encode_key("own"))
    with override_settings(TOKENBUCKET={**tokenbucket, "OPTIONS": {"CACHE": "redis"}}):
        assert get_backend().client() is get_redis_connection("redis", write=True)
    with override_settings(
        CACHES={**settings.CACHES, "bare": bare},
        TOKENBUCKET={**tokenbucket, "OPTIONS": {"CACHE": "bare", "TIMEOUT": None}},
    ):
        assert get_backend().client() is get_redis_connection("bare", write=True)


# -- the option and its checks --------------------------------------------------------------


UNSET = object()


def redis_checks(timeout=UNSET, factory=None, **cache_options):
    cache = {**settings.CACHES["redis"], "OPTIONS": cache_options}
    if factory is not None:
        cache["OPTIONS"]["CONNECTION_FACTORY"] = factory
    options = {"CACHE": "redis"} if timeout is UNSET else {"CACHE": "redis", "TIMEOUT": timeout}
    tokenbucket = {**BASE_SETTINGS, "BACKEND": REDIS_BACKEND, "OPTIONS": options}
    with override_settings(CACHES={**settings.CACHES, "redis": cache}, TOKENBUCKET=tokenbucket):
        return [
            (m.id, m.msg)
            for m in run_checks(tags=["caches"])
            if (m.id or "").startswith("django_tokenbucket.") and m.id != "django_tokenbucket.W021"
        ]


class ConnectionFactoryOfYourOwn(ConnectionFactory):
    """A factory that makes its clients its own way: the backend cannot build one like it."""

    def get_connection(self, params):
        return super().get_connection(params)


@pytest.mark.redis
def test_check_holds_the_socket_timeouts_against_timeout():
    assert redis_checks(0.5, SOCKET_CONNECT_TIMEOUT=0.2, SOCKET_TIMEOUT=0.1) == []
    assert redis_checks(None) == []
    [(check_id, message)] = redis_checks(0.5, SOCKET_CONNECT_TIMEOUT=2, SOCKET_TIMEOUT=0.1)
    assert check_id == "django_tokenbucket.W022" and "SOCKET_CONNECT_TIMEOUT = 2" in message
    [(check_id, message)] = redis_checks(0.5, SOCKET_TIMEOUT=10)
    assert "TIMEOUT is 0.5 s," in message
    assert "SOCKET_TIMEOUT = 10" in message and "CONNECT" not in message.split("has")[1].split(":")[0]
    # Unset socket timeouts: the backend's own connections get the deadline's.
    assert redis_checks(0.5) == []
    [(check_id, message)] = redis_checks(0.5, SOCKET_CONNECT_TIMEOUT=2)
    assert "SOCKET_CONNECT_TIMEOUT = 2" in message and "SOCKET_TIMEOUT" not in message.split("2 and")[-1]
    # ...unless the backend cannot build a client like the cache's.
    [(check_id, message)] = redis_checks(0.5, factory=f"{__name__}.ConnectionFactoryOfYourOwn")
    assert check_id == "django_tokenbucket.W022" and "no SOCKET_TIMEOUT nor SOCKET_CONNECT_TIMEOUT" in message


@pytest.mark.redis
def test_check_at_the_default_deadline():
    """A project that configures nothing: nothing to warn about. Socket timeouts it set
    above the default deadline are, and the warning says the deadline is the default."""
    assert redis_checks() == []
    assert redis_checks(SOCKET_CONNECT_TIMEOUT=0.1, SOCKET_TIMEOUT=0.2) == []
    [(check_id, message)] = redis_checks(SOCKET_CONNECT_TIMEOUT=2, SOCKET_TIMEOUT=10)
    assert check_id == "django_tokenbucket.W022"
    assert (
        "TIMEOUT is 0.2 s (the default)" in message and "SOCKET_CONNECT_TIMEOUT = 2 and SOCKET_TIMEOUT = 10" in message
    )


@pytest.mark.parametrize("value", [0, -1, "1", True, float("inf"), float("nan")])
def test_a_bad_timeout_is_a_check_error_and_refused_at_use(value):
    [(check_id, message)] = redis_checks(value, SOCKET_TIMEOUT=0.1)
    assert check_id == "django_tokenbucket.E029" and "TIMEOUT" in message and repr(value) in message
    tokenbucket = {**BASE_SETTINGS, "BACKEND": REDIS_BACKEND, "OPTIONS": {"CACHE": "redis", "TIMEOUT": value}}
    with override_settings(TOKENBUCKET=tokenbucket):
        with pytest.raises(ImproperlyConfigured, match="TIMEOUT"):
            limiter.limit("login", "k")


@pytest.mark.redis_processes
@pytest.mark.redis_faults
def test_sentinel_calls_are_bounded_and_read_first_within_the_deadline():
    with RedisServer() as master, LocalSentinel(master, service="tbdeadline") as sentinel:
        cache = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": "redis://tbdeadline/0",
            "OPTIONS": {
                "CLIENT_CLASS": "django_redis.client.SentinelClient",
                "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                "SENTINELS": [sentinel.address],
                "SENTINEL_KWARGS": {"socket_timeout": 0.2},
                "SOCKET_CONNECT_TIMEOUT": 0.2,
                # Not above TIMEOUT (W022): a new connection's handshake (Sentinel's PING
                # to the master) is bounded by SOCKET_TIMEOUT alone.
                "SOCKET_TIMEOUT": TIMEOUT,
            },
        }
        tokenbucket = {
            **BASE_SETTINGS,
            "BACKEND": REDIS_BACKEND,
            "OPTIONS": {"CACHE": "sentinel", "TIMEOUT": TIMEOUT},
        }
        with (
            override_settings(CACHES={**settings.CACHES, "sentinel": cache}, TOKENBUCKET=tokenbucket),
            frozen_clock(T0),
        ):
            backend = get_backend()
            assert limiter.limit("login", "s", count=2).value == 3
            assert asyncio.run(limiter.alimit("login", "s", count=2)).value == 1
            # A key left short: its next decisions are reads, within the deadline too.
            assert not limiter.limit("login", "s", count=2).ok
            assert limiter.get_value("login", "s") == 1
            assert backend.reads["decided"] == 2 and backend.async_calls == {"asyncio": 1}
            master.pause()
            try:
                failures = [timed_failure(api, "s") for api in ("sync", "asyncio", "sync", "asyncio")]
            finally:
                master.resume()
            assert max(elapsed for elapsed, _ in failures) < TIMEOUT + MARGIN, failures
            assert until_answered("sync", "s").value == 0
