"""The Redis backend's async API on redis-py's asyncio client, against real Redis servers.

The shared behaviour of the async twins is in test_conformance.py (which checks that on
Redis they never take a thread); here: the client is built from the same cache settings
as django-redis' (password, timeouts, pool kwargs, the primary of several locations,
Sentinel), keys are the sync path's, NOSCRIPT, failures and their fail modes, and one
client per event loop. Servers are redis-server processes of the test's own.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import contextmanager

import pytest
import redis.asyncio
import redis.asyncio.sentinel
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from django_redis.pool import ConnectionFactory

from django_tokenbucket import BackendUnavailable, LimitRequest, limiter
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.base import BackendError, Request
from django_tokenbucket.backends.redis import RedisBackend
from django_tokenbucket.keys import encode_key
from django_tokenbucket.testing import frozen_clock

from .redis_servers import LocalSentinel, RedisServer, once_answered_async
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = [pytest.mark.redis, pytest.mark.redis_processes]

T0 = 1_700_000_000.0
REDIS_BACKEND = "django_tokenbucket.backends.redis.RedisBackend"


class OwnFactory(ConnectionFactory):
    """A connection factory of a project's own: the asyncio client cannot know what it does."""


@contextmanager
def limiter_on(cache: dict, *, fail_open: bool = False):
    """The limiter on the cache ``cache`` (alias ``aio``)."""
    tokenbucket = {
        **BASE_SETTINGS,
        "BACKEND": REDIS_BACKEND,
        "OPTIONS": {"CACHE": "aio"},
        "FAIL_OPEN": fail_open,
        "LOG_INTERVAL": 0,
    }
    with override_settings(CACHES={**settings.CACHES, "aio": cache}, TOKENBUCKET=tokenbucket):
        backend = get_backend()
        assert isinstance(backend, RedisBackend)
        yield backend


def plain_cache(location, **options) -> dict:
    return {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": location,
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 2, **options},
    }


def stored(backend: RedisBackend, name: str, key: object) -> bytes | None:
    """The raw state of ``name`` for ``key``, read with the sync path's client and key."""
    return backend.client().get(backend.key(limiter.resolve(name), encode_key(key)))


async def test_the_client_has_the_caches_settings_and_writes_to_the_first_location():
    with RedisServer("--requirepass", "s3cret") as primary, RedisServer("--requirepass", "s3cret") as other:
        cache = plain_cache(
            [primary.url, other.url],
            PASSWORD="s3cret",
            CONNECTION_POOL_KWARGS={"max_connections": 7, "decode_responses": True},
            REDIS_CLIENT_KWARGS={"single_connection_client": False},
        )
        with limiter_on(cache) as backend, frozen_clock(T0):
            assert (await limiter.alimit("login", "loc", count=2)).value == 3
            client = await backend.asyncio_clients.client(_generation())
            assert isinstance(client, redis.asyncio.Redis)
            kwargs = client.connection_pool.connection_kwargs
            assert (kwargs["password"], kwargs["socket_timeout"], kwargs["socket_connect_timeout"]) == ("s3cret", 2, 0.5)
            assert client.connection_pool.max_connections == 7
            # The write went to the primary, as django-redis writes; the sync path reads it back.
            assert primary.client(password="s3cret").dbsize() == 1
            assert other.client(password="s3cret").dbsize() == 0
            assert limiter.get_value("login", "loc") == 3
            assert backend.async_calls == {"asyncio": 1}


async def test_keys_are_the_sync_paths_with_prefix_version_and_key_function():
    with RedisServer() as server:
        cache = {
            **plain_cache(server.url),
            "KEY_PREFIX": "pfx",
            "VERSION": 3,
            "KEY_FUNCTION": "tests.test_redis_asyncio.reversed_key",
        }
        with limiter_on(cache) as backend, frozen_clock(T0):
            await limiter.alimit("login", "kf")
            key = backend.key(limiter.resolve("login"), encode_key("kf"))
            assert key.startswith("3|pfx|tokenbucket:login:")
            assert server.client().exists(key) == 1
            await limiter.areset("login", "kf")
            assert server.client().exists(key) == 0


def reversed_key(key: str, key_prefix: str, version: int) -> str:
    return f"{version}|{key_prefix}|{key}"


async def test_a_flushed_script_is_sent_again_with_eval():
    with RedisServer() as server, limiter_on(plain_cache(server.url)) as backend, frozen_clock(T0):
        assert (await limiter.alimit("login", "ns")).value == 4
        reloads = backend.script_reloads
        server.client().script_flush()
        assert (await limiter.alimit("login", "ns")).value == 3
        assert backend.script_reloads == reloads + 1
        assert (await limiter.alimit("login", "ns")).value == 2
        assert backend.script_reloads == reloads + 1


async def test_refund_and_reset_are_native_too():
    with RedisServer() as server, limiter_on(plain_cache(server.url)) as backend, frozen_clock(T0):
        await limiter.alimit("login", "rf", count=5)
        assert (await limiter.arefund("login", "rf", count=2)).value == 2
        assert (await limiter.arefund("login", "rf", count=9)).value == 5  # capped at the capacity
        await limiter.alimit("login", "rf", count=5)
        await limiter.areset("login", "rf")
        assert await limiter.aget_value("login", "rf") == 5
        assert backend.async_calls["thread"] == 0 and backend._connection is None


async def test_nothing_listening_fails_with_the_fail_mode_and_is_not_ambiguous():
    server = RedisServer()  # a free port, never started: connections are refused
    with limiter_on(plain_cache(server.url)) as backend:
        with pytest.raises(BackendUnavailable, match=r"Connection refused|Error 111|connecting") as failure:
            await limiter.alimit("login", "k")
        assert failure.value.__cause__.ambiguous is False
        assert backend.errors["ConnectionError"] == 1
        with pytest.raises(BackendUnavailable):
            await limiter.areset("login", "k")
    with limiter_on(plain_cache(server.url), fail_open=True):
        assert (await limiter.alimit("login", "k")).failed_open
        with pytest.raises(BackendUnavailable):  # reading has nothing to allow
            await limiter.aget_value("login", "k")
    server.close()


async def test_a_server_that_stops_answering_is_an_ambiguous_failure_then_recovers():
    with RedisServer() as server, limiter_on(plain_cache(server.url, SOCKET_TIMEOUT=0.3)) as backend:
        with frozen_clock(T0):
            assert (await limiter.alimit("login", "slow")).ok
            server.pause()
            try:
                with pytest.raises(BackendError) as failure:
                    await backend.adecide([Request(limiter.resolve("login"), encode_key("slow"), 1)], apply=True)
                # The script was sent: it may have run. Redis answered just before: busy, not down.
                assert failure.value.ambiguous is True and "Timeout" in str(failure.value)
                assert failure.value.busy is True
                with pytest.raises(BackendError) as read:
                    await backend.adecide([Request(limiter.resolve("login"), encode_key("slow"), 0)], apply=False)
                assert read.value.ambiguous is False  # a read applies nothing
            finally:
                server.resume()
            # The read had to open a connection, whose handshake timed out: the node's
            # breaker opened, and its next probe finds the server again.
            assert (await once_answered_async(lambda: limiter.alimit("login", "slow"))).ok


async def test_a_key_denied_lately_is_read_on_the_asyncio_client_too(without_deny_cache):
    with RedisServer() as server, limiter_on(plain_cache(server.url)) as backend, frozen_clock(T0):
        for _ in range(5):
            assert (await limiter.alimit("login", "flood")).ok
        key = backend.key(limiter.resolve("login"), encode_key("flood"))
        before = server.client().get(key)
        denials = [await limiter.alimit("login", "flood") for _ in range(10)]
        assert all(not denial.ok and denial.retry_after == 12.0 for denial in denials)
        assert backend.reads == {"sent": 10, "decided": 10} and backend.async_calls == {"asyncio": 15}
        assert server.client().get(key) == before  # nothing written


async def test_a_connection_factory_of_ones_own_takes_the_thread_path(caplog):
    with RedisServer() as server:
        cache = plain_cache(server.url, CONNECTION_FACTORY="tests.test_redis_asyncio.OwnFactory")
        with limiter_on(cache) as backend, frozen_clock(T0), caplog.at_level(logging.INFO, "django_tokenbucket"):
            assert (await limiter.alimit("login", "own", count=2)).value == 3
            assert (await limiter.alimit("login", "own")).value == 2
            assert backend.async_calls == {"thread": 2}
            assert "OwnFactory" in backend.asyncio_clients.thread_reason
            assert server.client().dbsize() == 1
        # Said once, not per call.
        [record] = [r for r in caplog.records if "worker thread" in r.getMessage()]
        assert "OwnFactory" in record.getMessage() and "CACHES['aio']" in record.getMessage()


async def test_an_option_the_asyncio_client_refuses_names_the_cache():
    with RedisServer() as server:
        cache = plain_cache(server.url, CONNECTION_POOL_KWARGS={"no_such_option": 1})
        with limiter_on(cache), pytest.raises(ImproperlyConfigured, match=r"CACHES\['aio'\].*no_such_option"):
            await limiter.alimit("login", "bad")


def test_each_event_loop_has_its_own_client_closed_with_the_loop():
    """Two threads, each with a running loop, decide on one limit at once: exact, a client each."""
    with RedisServer() as server, limiter_on(plain_cache(server.url)) as backend, frozen_clock(T0):
        both_running = threading.Barrier(2)
        clients, allowed = [], []

        async def spend() -> None:
            for _ in range(3):
                allowed.append((await limiter.alimit("login", "loops")).ok)
            clients.append(await backend.asyncio_clients.client(_generation()))
            await asyncio.to_thread(both_running.wait, 10)
            assert backend.asyncio_clients.clients() == 2  # both loops still running
            await asyncio.to_thread(both_running.wait, 10)

        threads = [threading.Thread(target=asyncio.run, args=(spend(),)) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        assert sorted(allowed) == [False] + [True] * 5  # capacity 5 over both loops
        assert len(clients) == 2 and clients[0] is not clients[1]
        # asyncio.run closed each loop's client as the loop shut down, and forgot it.
        assert backend.asyncio_clients.clients() == 0
        assert server.client().info("clients")["connected_clients"] == 1  # this check's own


def test_a_settings_change_builds_a_new_client_on_the_same_loop():
    with RedisServer() as first, RedisServer() as second, frozen_clock(T0):

        async def decide_twice() -> tuple[object, object]:
            with limiter_on(plain_cache(first.url)) as backend:
                await limiter.alimit("login", "gen")
                before = await backend.asyncio_clients.client(_generation())
            with limiter_on(plain_cache(second.url)) as backend:
                await limiter.alimit("login", "gen", count=2)
                after = await backend.asyncio_clients.client(_generation())
            return before, after

        before, after = asyncio.run(decide_twice())
        assert before is not after
        assert first.client().dbsize() == 1 and second.client().dbsize() == 1


def test_sentinel_serves_the_sync_and_the_async_path():
    with RedisServer() as master, LocalSentinel(master, service="tbmaster") as sentinel:
        cache = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": "redis://tbmaster/0",
            "OPTIONS": {
                "CLIENT_CLASS": "django_redis.client.SentinelClient",
                "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                "SENTINELS": [sentinel.address],
                "SENTINEL_KWARGS": {"socket_timeout": 1},
                "SOCKET_CONNECT_TIMEOUT": 1,
                "SOCKET_TIMEOUT": 2,
            },
        }
        with limiter_on(cache) as backend, frozen_clock(T0):
            assert limiter.limit("login", "s", count=2).value == 3

            async def decide() -> object:
                status = await limiter.alimit("login", "s", count=2)
                assert await limiter.aget_value("login", "s") == 1
                client = await backend.asyncio_clients.client(_generation())
                assert isinstance(client.connection_pool, redis.asyncio.sentinel.SentinelConnectionPool)
                assert client.connection_pool.is_master and client.connection_pool.service_name == "tbmaster"
                return status

            assert asyncio.run(decide()).value == 1
            assert not limiter.limit("login", "s", count=2).ok
            assert backend.async_calls == {"asyncio": 2}
            # The value read (async) and the denial of a key left short (sync) were each
            # one read on the master's pool, without the script.
            assert backend.reads == {"sent": 2, "decided": 2}
            # Both paths wrote the one key on the master the sentinel names.
            assert master.client().dbsize() == 1
            assert stored(backend, "login", "s") is not None


def test_limit_many_is_native_and_all_or_nothing():
    with RedisServer() as server, limiter_on(plain_cache(server.url)) as backend, frozen_clock(T0):

        async def run() -> None:
            assert (await limiter.alimit_many([LimitRequest("login", "m", 4), LimitRequest("burst", "m")])).ok
            refused = await limiter.alimit_many([LimitRequest("login", "m", 2), LimitRequest("burst", "m")])
            assert not refused.ok
            assert await limiter.aget_value("login", "m") == 1

        asyncio.run(run())
        assert backend.async_calls["thread"] == 0 and backend.async_calls["asyncio"] == 3


def _generation() -> int:
    from django_tokenbucket.backends.redis import backend as redis_backend_module

    return redis_backend_module._settings_generation
