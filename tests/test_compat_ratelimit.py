"""django_tokenbucket.compat.ratelimit: django-ratelimit's API, decided by our backends.

django-ratelimit's own tests run against it in the ``compat`` tox env
(tests/upstream/run.py); these pin what its tests do not: exact windows on every
backend, stacked limits that never share a bucket, the store failing, the checks.
"""

from __future__ import annotations

import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import RequestFactory, override_settings

from django_tokenbucket import RateLimited, limiter
from django_tokenbucket.compat.ratelimit import ALL, UNSAFE
from django_tokenbucket.compat.ratelimit.core import _limiter, get_usage, is_ratelimited
from django_tokenbucket.compat.ratelimit.decorators import ratelimit
from django_tokenbucket.compat.ratelimit.exceptions import Ratelimited
from django_tokenbucket.middleware import RateLimitMiddleware
from django_tokenbucket.testing import frozen_clock

from .settings import TOKENBUCKET as BASE_SETTINGS

rf = RequestFactory()
T0 = 1_700_000_000.0

STORES = {
    "database": {},  # RATELIMIT_USE_CACHE unset: TOKENBUCKET's backend, the database
    "redis": {"RATELIMIT_USE_CACHE": "redis"},  # a django-redis cache: a Redis backend of its own
}


@pytest.fixture(params=sorted(STORES))
def backend(request, transactional_db):
    if request.param == "redis":
        request.getfixturevalue("redis_store")  # this run's keys deleted around the test
    with override_settings(**STORES[request.param]):
        yield request.param


@pytest.fixture
def clock(backend):
    with frozen_clock(T0) as frozen:
        yield frozen


def usage(request=None, **kwargs):
    options = {"group": "g", "key": "ip", "rate": "3/m", "method": ALL, **kwargs}
    return get_usage(request or rf.get("/"), **options)


def test_a_fixed_window_admits_its_rate_then_reopens_at_its_end(clock):
    counts = [usage(increment=True) for _ in range(4)]
    assert [u["should_limit"] for u in counts] == [False, False, False, True]
    assert [u["count"] for u in counts] == [1, 2, 3, 4]  # the refused request is counted in the answer...
    assert usage()["count"] == 3  # ...but not stored: it spent nothing
    time_left = counts[-1]["time_left"]
    assert 0 < time_left <= 60
    clock.advance(time_left - 0.5)
    assert usage(increment=True)["should_limit"]
    clock.advance(0.5)
    reopened = usage(increment=True)
    assert not reopened["should_limit"] and reopened["count"] == 1 and reopened["time_left"] == 60


def test_windows_start_at_a_per_key_offset(clock):
    lefts = set()
    for n in range(20):
        request = rf.get("/", REMOTE_ADDR=f"192.0.2.{n}")
        lefts.add(usage(request, increment=True)["time_left"])
    assert len(lefts) > 5  # the clients' windows do not all reopen at once


def test_the_limit_is_a_named_fixed_window_of_the_limiter(clock, backend):
    usage(increment=True)
    store = _limiter()  # the database's limiter, or one of its own on the Redis cache
    assert (store is limiter) == (backend == "database")
    status = store.get_status("g:3/60s", "127.0.0.1", config={"kind": "fixed window", "rate": 3, "period": 60})
    assert status.value == 2


def test_stacked_burst_and_sustained_rates_are_separate_buckets(clock):
    @ratelimit(key="ip", rate="100/m", block=False)
    @ratelimit(key="ip", rate="10/s", block=False)
    def view(request):
        return request.limited

    group = f"{view.__module__}.{view.__qualname__}"
    clock.advance(usage(group=group, rate="100/m")["time_left"])  # the start of a minute window
    assert [view(rf.get("/")) for _ in range(11)] == [False] * 10 + [True]  # ten a second
    # As in django-ratelimit, each decorator counts what reaches it: the outer minute
    # counted the eleventh request too (89 left of 100).
    clock.advance(1)
    for second in range(1, 10):
        assert [view(rf.get("/")) for _ in range(10)] == [False] * (10 if second < 9 else 9) + [True] * (second == 9)
        clock.advance(1)
    # A hundred in this minute: refused, though the second's bucket has room again.
    assert view(rf.get("/")) is True


def test_methods_count_separately_and_request_limited_is_always_set(clock):
    @ratelimit(key="ip", rate="1/m", method="POST", block=False)
    def view(request):
        return request.limited

    assert view(rf.post("/")) is False
    assert view(rf.post("/")) is True
    assert view(rf.get("/")) is False  # not counted, and still set


def test_block_raises_ratelimited_which_the_middleware_answers_with_429(clock):
    @ratelimit(key="ip", rate="1/m")
    def view(request):
        return HttpResponse("ok")

    middleware = RateLimitMiddleware(view)
    assert middleware(rf.get("/")).status_code == 200
    with pytest.raises(Ratelimited) as excinfo:
        view(rf.get("/"))
    assert isinstance(excinfo.value, RateLimited) and 0 < excinfo.value.retry_after <= 60
    response = middleware.process_exception(rf.get("/"), excinfo.value)
    assert response.status_code == 429 and int(response["Retry-After"]) == pytest.approx(
        excinfo.value.retry_after, abs=1
    )
    assert response["Cache-Control"] == "no-store"


def test_zero_none_and_callable_rates(clock):
    assert is_ratelimited(rf.get("/"), group="z", key="ip", rate="0/m", increment=True)
    assert not is_ratelimited(rf.get("/"), group="n", key="ip", rate=None, increment=True)
    tiered = lambda group, request: (2, 60) if request.GET.get("plan") == "pro" else "1/m"  # noqa: E731
    assert [
        is_ratelimited(rf.get("/", {"plan": "pro"}), group="t", key="ip", rate=tiered, increment=True) for _ in range(3)
    ] == [False, False, True]
    assert [is_ratelimited(rf.get("/"), group="t", key="ip", rate=tiered, increment=True) for _ in range(2)] == [
        False,
        True,
    ]


@pytest.mark.parametrize(
    "mask, other, shared", [(32, "10.1.1.2", False), (24, "10.1.1.200", True), (16, "10.1.9.9", True)]
)
def test_ipv4_masks_group_addresses(clock, mask, other, shared):
    with override_settings(RATELIMIT_IPV4_MASK=mask):
        assert not is_ratelimited(rf.get("/", REMOTE_ADDR="10.1.1.1"), group="m", key="ip", rate="1/m", increment=True)
        assert is_ratelimited(rf.get("/", REMOTE_ADDR=other), group="m", key="ip", rate="1/m", increment=True) == shared


def test_a_spoofed_forwarded_for_is_ignored_without_trusted_proxies(clock):
    first = rf.get("/", HTTP_X_FORWARDED_FOR="198.51.100.1")
    second = rf.get("/", HTTP_X_FORWARDED_FOR="198.51.100.2")
    assert not is_ratelimited(first, group="x", key="ip", rate="1/m", increment=True)
    assert is_ratelimited(second, group="x", key="ip", rate="1/m", increment=True)


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
def test_a_failed_store_limits_unless_fail_open(redis_store):
    caches = {
        "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
        "down": {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": "redis://127.0.0.1:1/0",
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1},
        },
    }
    with override_settings(CACHES=caches, RATELIMIT_USE_CACHE="down"):
        assert is_ratelimited(rf.get("/"), group="f", key="ip", rate="10/m", increment=True)
        assert usage(group="f") == {"count": 0, "limit": 0, "should_limit": True, "time_left": -1}
        with override_settings(RATELIMIT_FAIL_OPEN=True):
            assert not is_ratelimited(rf.get("/"), group="f", key="ip", rate="10/m", increment=True)
            assert usage(group="f") is None


@pytest.mark.django_db(transaction=True)
def test_a_dummy_cache_limits_nothing_and_bad_settings_are_errors():
    caches = {"default": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"}}
    with override_settings(CACHES=caches, RATELIMIT_USE_CACHE="default"):
        assert [is_ratelimited(rf.get("/"), group="d", key="ip", rate="1/m", increment=True) for _ in range(3)] == [
            False
        ] * 3
    with pytest.raises(ImproperlyConfigured, match="key must be specified"):
        is_ratelimited(rf.get("/"), group="d", rate="1/m")
    with pytest.raises(ImproperlyConfigured, match="invalid ratelimit rate 'often'"):
        is_ratelimited(rf.get("/"), group="d", key="ip", rate="often")


def test_unsafe_and_all_are_the_documented_sentinels():
    assert ALL == (None,) and UNSAFE == ["DELETE", "PATCH", "POST", "PUT"]
    assert ratelimit.UNSAFE is UNSAFE and is_ratelimited.ALL is ALL and get_usage.UNSAFE is UNSAFE


def _ids(**overrides):
    with override_settings(TOKENBUCKET=BASE_SETTINGS, **overrides):
        return sorted(
            m.id for m in run_checks() if m.id.startswith("django_tokenbucket.") and m.id.split(".")[1][1:3] == "04"
        )


def test_checks_report_the_ratelimit_settings():
    assert _ids() == []
    assert _ids(RATELIMIT_USE_CACHE="nope") == ["django_tokenbucket.E040"]
    assert _ids(RATELIMIT_USE_CACHE="default") == ["django_tokenbucket.W040"]  # locmem: kept in the database
    assert _ids(RATELIMIT_USE_CACHE="redis") == []
    assert _ids(RATELIMIT_IPV4_MASK=33, RATELIMIT_IPV6_MASK="64") == ["django_tokenbucket.E041"] * 2
    assert _ids(RATELIMIT_EXCEPTION_CLASS="no.such.Class") == ["django_tokenbucket.E042"]
