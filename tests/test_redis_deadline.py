"""The Redis backend's ``TIMEOUT`` (one deadline per call) and its per-node breaker, on
private redis-server processes that the tests stop and freeze (SIGSTOP): nothing mocked.

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

from django_tokenbucket import BackendUnavailable, limiter
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.base import BUSY_WINDOW
from django_tokenbucket.backends.redis import aio
from django_tokenbucket.backends.redis.breaker import BREAKERS, MAX_BACKOFF
from django_tokenbucket.testing import frozen_clock

from .redis_servers import CONNECTS, AsyncCountingConnection, CountingConnection, LocalSentinel, RedisServer
from .settings import TOKENBUCKET as BASE_SETTINGS

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


# -- the option and its checks --------------------------------------------------------------


def redis_checks(timeout, **cache_options):
    cache = {**settings.CACHES["redis"], "OPTIONS": cache_options}
    tokenbucket = {**BASE_SETTINGS, "BACKEND": REDIS_BACKEND, "OPTIONS": {"CACHE": "redis", "TIMEOUT": timeout}}
    with override_settings(CACHES={**settings.CACHES, "redis": cache}, TOKENBUCKET=tokenbucket):
        return [
            (m.id, m.msg)
            for m in run_checks(tags=["caches"])
            if (m.id or "").startswith("django_tokenbucket.") and m.id != "django_tokenbucket.W021"
        ]


@pytest.mark.redis
def test_check_holds_the_socket_timeouts_against_timeout():
    assert redis_checks(0.5, SOCKET_CONNECT_TIMEOUT=0.2, SOCKET_TIMEOUT=0.1) == []
    assert redis_checks(None) == []
    [(check_id, message)] = redis_checks(0.5, SOCKET_CONNECT_TIMEOUT=2, SOCKET_TIMEOUT=0.1)
    assert check_id == "django_tokenbucket.W022" and "SOCKET_CONNECT_TIMEOUT = 2" in message
    [(check_id, message)] = redis_checks(0.5)
    assert check_id == "django_tokenbucket.W022" and "no SOCKET_TIMEOUT nor SOCKET_CONNECT_TIMEOUT" in message
    [(check_id, message)] = redis_checks(0.5, SOCKET_TIMEOUT=10)
    assert "SOCKET_TIMEOUT = 10" in message and "CONNECT" not in message.split("has")[1].split(":")[0]


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
