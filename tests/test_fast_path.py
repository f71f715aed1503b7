"""The Redis backend's per-decision shortcuts give what the slow paths would.

The backend keeps the cache's client and key prefix, and each limit's script arguments,
from one decision to the next; ``limit()`` and ``check()`` skip the grouping of several
limits; ``Status`` is filled without its dataclass ``__init__``. These tests change the
settings under a warm backend and require that the next decision follows them.
"""

from __future__ import annotations

import dataclasses

import pytest
from django.conf import settings
from django.test import override_settings

from django_tokenbucket import RateLimited, limiter
from django_tokenbucket.algorithms import MICRO, Decision
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.base import RecentDenials, Request
from django_tokenbucket.backends.redis import RedisBackend, state_key
from django_tokenbucket.backends.redis import backend as redis_backend
from django_tokenbucket.keys import encode_key
from django_tokenbucket.status import Status
from django_tokenbucket.testing import frozen_clock

from .redis_servers import RedisServer
from .settings import TOKENBUCKET as BASE_SETTINGS

T0 = 1_700_000_000.0
T0_US = int(T0 * MICRO)


def custom_key(key: str, key_prefix: str, version: int) -> str:
    """A KEY_FUNCTION of the kind projects write (under the test prefix, so the keys are cleaned up)."""
    return f"{key_prefix}:custom-v{version}:{key}"


@pytest.fixture
def backend(redis_store):
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **redis_store}):
        backend = get_backend()
        assert isinstance(backend, RedisBackend)
        yield backend


def redis_cache(**changes):
    return {**settings.CACHES, "redis": {**settings.CACHES["redis"], **changes}}


def stored(backend: RedisBackend, name: str, key: str) -> bytes | None:
    return backend.client().get(backend.key(limiter.resolve(name), encode_key(key)))


@pytest.mark.redis
def test_a_new_cache_version_applies_to_the_next_decision(backend):
    with frozen_clock(T0):
        limiter.limit("ten_per_minute", "v", count=2)  # warm: client and prefix kept
        assert stored(backend, "ten_per_minute", "v") == f"{8 * MICRO} {T0_US}".encode()
        with override_settings(CACHES=redis_cache(VERSION=7)):
            assert limiter.limit("ten_per_minute", "v", count=3).value == 7  # a fresh key
            key = backend.key(limiter.resolve("ten_per_minute"), encode_key("v"))
            assert f"{settings.REDIS_KEY_PREFIX}:7:" in key
            assert backend.client().get(key) == f"{7 * MICRO} {T0_US}".encode()
        # Back to version 1: its state is where it was left.
        assert limiter.limit("ten_per_minute", "v").value == 7
        assert stored(backend, "ten_per_minute", "v") == f"{7 * MICRO} {T0_US}".encode()


@pytest.mark.redis
def test_a_key_function_is_applied_to_every_decision(backend):
    config = limiter.resolve("ten_per_minute")
    limiter.limit("ten_per_minute", "warm")
    with override_settings(CACHES=redis_cache(KEY_FUNCTION="tests.test_fast_path.custom_key")), frozen_clock(T0):
        expected = f"{settings.REDIS_KEY_PREFIX}:custom-v1:{state_key(config, encode_key('f'))}"
        assert backend.key(config, encode_key("f")) == expected
        limiter.limit_many([("ten_per_minute", "f"), ("login", "f")])
        limiter.limit("ten_per_minute", "f", count=4)
        assert backend.client().get(expected) == f"{5 * MICRO} {T0_US}".encode()
        login = f"{settings.REDIS_KEY_PREFIX}:custom-v1:{state_key(limiter.resolve('login'), encode_key('f'))}"
        assert backend.client().get(login) == f"{4 * MICRO} {T0_US}".encode()


@pytest.mark.redis
@pytest.mark.redis_processes
def test_a_cache_moved_to_another_server_is_followed(backend):
    with frozen_clock(T0):
        assert limiter.limit("login", "moved", count=2).value == 3  # the suite's server, client kept
        with RedisServer() as server:
            with override_settings(CACHES=redis_cache(LOCATION=server.url)):
                assert limiter.limit("login", "moved").value == 4  # fresh on the new server
                other = server.client()
                assert other.get(backend.key(limiter.resolve("login"), encode_key("moved"))) == (
                    f"{4 * MICRO} {T0_US}".encode()
                )
                other.close()
            # CACHES restored: the first server's state again.
            assert limiter.limit("login", "moved").value == 2


@pytest.mark.redis
@pytest.mark.redis_processes
def test_another_cache_alias_is_followed(redis_store):
    with RedisServer() as server, frozen_clock(T0):
        caches = {**settings.CACHES, "other": {**settings.CACHES["redis"], "LOCATION": server.url}}
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, **redis_store}):
            assert limiter.limit("login", "alias", count=3).value == 2
            with override_settings(CACHES=caches, TOKENBUCKET={**BASE_SETTINGS, **redis_store, "OPTIONS": {"CACHE": "other"}}):
                assert limiter.limit("login", "alias").value == 4
            assert limiter.limit("login", "alias").value == 1


@pytest.mark.redis
def test_limits_of_one_name_with_other_configs_keep_their_own_arguments(backend, monkeypatch):
    # A tiny cache, so that formatted arguments are also dropped and made again.
    monkeypatch.setattr(redis_backend, "_LIMITS_CACHE_SIZE", 2)
    configs = [{"rate": f"{n}/m"} for n in (5, 3, 9)] + [{"kind": "fixed window", "rate": "4/m"}]
    with frozen_clock(T0):
        for round_ in range(3):
            for n, config in enumerate(configs):
                rate = int(config["rate"].split("/")[0])
                status = limiter.limit("inline", f"k{n}", config=config)
                assert status.ok and status.value == rate - 1 - round_
                assert status.capacity == rate


@pytest.mark.redis
def test_check_and_throws_match_limit_many(backend, without_deny_cache):
    with frozen_clock(T0):
        assert limiter.check("login", "c").value == 4  # what limit() would leave
        assert limiter.limit("login", "c", count=5).value == 0
        one = limiter.check("login", "c")
        [many] = limiter.check_many([("login", "c")])
        assert one == many and not one.ok
        with pytest.raises(RateLimited) as raised:
            limiter.limit("login", "c", throws=True)
        with pytest.raises(RateLimited) as raised_many:
            limiter.limit_many([("login", "c")], throws=True)
        assert raised.value.retry_after == raised_many.value.retry_after == 12.0
        assert raised.value.status == raised_many.value.status


def test_a_decided_status_equals_one_made_by_its_init():
    fields = {
        "ok": False,
        "name": "login",
        "key": ("tenant", 7),
        "count": 2.0,
        "value": -1.5,
        "retry_after": 3.25,
        "reset_after": 60.0,
        "capacity": 5.0,
        "rate": 5.0,
        "period": 60.0,
        "timestamp": T0,
        "shadow": True,
        "would_deny": True,
    }
    fast = Status._decided(**fields)
    made = Status(**fields)
    assert fast == made and hash(fast) == hash(made) and repr(fast) == repr(made)
    # Every field is set, in the declared order, so a new field cannot be forgotten here.
    assert list(vars(fast)) == [f.name for f in dataclasses.fields(Status)] == list(vars(made))
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.ok = True  # type: ignore[misc]


def test_recent_denials_keep_a_key_denied_again_once_and_stay_bounded():
    denials = RecentDenials(size=3)
    config = limiter.resolve("login")
    denied = Decision(False, 0, 12 * MICRO, 60 * MICRO, None)
    requests = [Request(config, encode_key(f"k{i}"), MICRO) for i in range(5)]
    for _ in range(3):
        denials.learn("default", requests[0], denied)  # a hot key: denied again and again
    assert denials.likely("default", requests[0]) and len(denials._until) == 1
    for request in requests[1:]:
        denials.learn("default", request, denied)
    assert len(denials._until) == 3
    assert not denials.likely("default", requests[0]) and not denials.likely("default", requests[1])
    assert all(denials.likely("default", request) for request in requests[2:])
    denials.learn("default", requests[4], Decision(True, 5 * MICRO, None, 0, None))  # admitted with room
    assert not denials.likely("default", requests[4])
