"""django_tokenbucket.compat.ratelimit: django-ratelimit's API, decided by our backends.

django-ratelimit's own tests run against it in the ``compat`` tox env
(tests/upstream/run.py); these pin what its tests do not: exact windows on every
backend, stacked limits that never share a bucket, the store failing, the checks.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from unittest import mock

import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.http import HttpResponse
from django.test import RequestFactory, override_settings
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View
from rest_framework.decorators import api_view

from django_tokenbucket import RateLimited, limiter
from django_tokenbucket.compat.ratelimit import ALL, UNSAFE
from django_tokenbucket.compat.ratelimit.core import _limiter, get_usage, is_ratelimited
from django_tokenbucket.compat.ratelimit.decorators import ratelimit
from django_tokenbucket.compat.ratelimit.exceptions import Ratelimited
from django_tokenbucket.middleware import RateLimitMiddleware
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock

from .redis_servers import delete_keys
from .settings import CACHES as TEST_CACHES
from .settings import TOKENBUCKET as BASE_SETTINGS

rf = RequestFactory()
T0 = 1_700_000_000.0

STORES = {
    "database": {},  # unset: the default cache, a LocMemCache, so TOKENBUCKET's backend, the database
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
    assert _ids(**USES_LAYER) == ["django_tokenbucket.W040"]  # unset: the default cache, locmem: the database
    assert _ids(RATELIMIT_USE_CACHE="nope") == ["django_tokenbucket.E040"]
    assert _ids(RATELIMIT_USE_CACHE="default") == ["django_tokenbucket.W040"]  # locmem: kept in the database
    assert _ids(RATELIMIT_USE_CACHE="redis") == []
    redis = {"RATELIMIT_USE_CACHE": "redis"}
    assert _ids(**redis, RATELIMIT_IPV4_MASK=33, RATELIMIT_IPV6_MASK="64") == ["django_tokenbucket.E041"] * 2
    assert _ids(**redis, RATELIMIT_EXCEPTION_CLASS="no.such.Class") == ["django_tokenbucket.E042"]


@ratelimit(key="ip", rate="5/m")
def routed_view(request):
    return HttpResponse("ok")


@method_decorator(ratelimit(key="ip", rate="5/m"), name="dispatch")
class RoutedClassView(View):
    def get(self, request):
        return HttpResponse("ok")


@api_view(["GET"])
@ratelimit(key="ip", rate="5/m")
def routed_api_view(request):
    return HttpResponse("ok")


urlpatterns = [path("f/", routed_view)]
class_urls = ModuleType("class_urls")
class_urls.urlpatterns = [path("c/", RoutedClassView.as_view())]
api_urls = ModuleType("api_urls")
api_urls.urlpatterns = [path("a/", routed_api_view)]
#: A project that routes a URL to a view decorated by the layer: it uses the layer.
USES_LAYER = {"ROOT_URLCONF": __name__}


@pytest.mark.parametrize(
    "uses",
    [
        {"ROOT_URLCONF": __name__},
        {"ROOT_URLCONF": class_urls},
        {"ROOT_URLCONF": api_urls},
        {"MIDDLEWARE": ["django_tokenbucket.compat.ratelimit.middleware.RatelimitMiddleware"]},
        {"RATELIMIT_ENABLE": True},
    ],
    ids=["function-view", "method-decorator", "api-view", "middleware", "a-setting"],
)
def test_a_project_that_uses_the_layer_hears_where_its_limits_are(uses):
    assert _ids() == []  # the test URLconf routes to no view of the layer: not a user of it
    assert _ids(**uses) == ["django_tokenbucket.W040"]  # the default cache is a LocMemCache


# -- RATELIMIT_USE_CACHE unset means the default cache, as in django-ratelimit (issue 33, 10) --

DUMMY = {"BACKEND": "django.core.cache.backends.dummy.DummyCache"}
DJANGO_REDIS = TEST_CACHES["redis"]  # django-redis on this run's Redis database and key prefix
BUILTIN_REDIS = {
    "BACKEND": "django.core.cache.backends.redis.RedisCache",
    "LOCATION": DJANGO_REDIS["LOCATION"],
    "KEY_PREFIX": DJANGO_REDIS["KEY_PREFIX"],
}


def hits(n, rate="1/m"):
    return [is_ratelimited(rf.get("/"), group="u", key="ip", rate=rate, increment=True) for _ in range(n)]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("use_cache", [{}, {"RATELIMIT_USE_CACHE": "default"}], ids=["unset", "default"])
def test_a_dummy_default_cache_limits_nothing_whether_use_cache_is_set_or_not(use_cache):
    with override_settings(CACHES={"default": DUMMY}, **use_cache):
        assert hits(3) == [False] * 3
        assert not RateLimit.objects.exists()
        assert _ids(**USES_LAYER) == []  # nothing kept anywhere, as with django-ratelimit: nothing to say


@pytest.mark.django_db(transaction=True)
@pytest.mark.redis
@pytest.mark.parametrize("use_cache", [{}, {"RATELIMIT_USE_CACHE": "default"}], ids=["unset", "default"])
def test_a_django_redis_default_cache_holds_the_limits_whether_use_cache_is_set_or_not(redis_store, use_cache):
    with override_settings(CACHES={"default": DJANGO_REDIS, "redis": DJANGO_REDIS}, **use_cache):
        with frozen_clock(T0):
            assert hits(3, rate="2/m") == [False, False, True]
        store = _limiter()
        assert store is not limiter and store.backend().cache_alias == "default"
        assert not RateLimit.objects.exists()  # nothing went to the database...
        assert delete_keys("default") > 0  # ...and the window is in that Redis
        assert _ids(**USES_LAYER) == []


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("use_cache", [{}, {"RATELIMIT_USE_CACHE": "default"}], ids=["unset", "default"])
def test_djangos_own_redis_cache_keeps_the_limits_in_the_database_and_check_says_so(use_cache):
    with override_settings(CACHES={"default": BUILTIN_REDIS}, **use_cache):
        with frozen_clock(T0):
            assert hits(2) == [False, True]
        assert _limiter() is limiter and RateLimit.objects.exists()
        with override_settings(TOKENBUCKET=BASE_SETTINGS, **USES_LAYER):
            (warning,) = [m for m in run_checks() if m.id == "django_tokenbucket.W040"]
        assert "CACHES['default']" in warning.msg and "django.core.cache.backends.redis.RedisCache" in warning.msg
        assert ("unset" in warning.msg) == (not use_cache)
        assert "django_redis.cache.RedisCache" in warning.hint


# -- django-ratelimit 4.1's names, at the same places (issue 33, 11) -----------------------

#: Every public (not underscored) name of django-ratelimit 4.1.0's modules, read from its
#: source: what it defines and what it imports, since tests patch either. Left out: the
#: standard modules its core counts windows with (hashlib, socket, time, zlib), which mean
#: nothing here: a patch of core.time fails at once rather than moving nothing
#: (docs/migrating.md says to use testing.frozen_clock).
DJANGO_RATELIMIT_4_1 = {
    "": ["ALL", "UNSAFE", "VERSION", "__version__"],
    "core": [
        "ALL", "EXPIRATION_FUDGE", "ImproperlyConfigured", "UNSAFE", "caches", "functools", "get_header",
        "get_usage", "import_string", "ipaddress", "is_ratelimited", "rate_re", "re", "settings", "user_or_ip",
    ],
    "decorators": ["ALL", "Ratelimited", "UNSAFE", "import_string", "is_ratelimited", "ratelimit", "settings", "wraps"],
    "exceptions": ["PermissionDenied", "Ratelimited"],
    "middleware": ["Ratelimited", "RatelimitMiddleware", "import_string", "settings"],
}  # fmt: skip
COMPAT = "django_tokenbucket.compat.ratelimit"


@pytest.mark.parametrize(
    "module, name", [(module, name) for module, names in DJANGO_RATELIMIT_4_1.items() for name in names]
)
def test_every_public_name_of_django_ratelimit_is_at_the_same_place(module, name):
    assert hasattr(importlib.import_module(f"{COMPAT}.{module}".rstrip(".")), name)


def test_the_names_mean_what_they_meant():
    compat = importlib.import_module(COMPAT)
    core = importlib.import_module(f"{COMPAT}.core")
    decorators = importlib.import_module(f"{COMPAT}.decorators")
    exceptions = importlib.import_module(f"{COMPAT}.exceptions")
    middleware = importlib.import_module(f"{COMPAT}.middleware")
    assert compat.VERSION == (4, 1, 0) and compat.__version__ == "4.1.0"
    assert decorators.is_ratelimited is core.is_ratelimited and decorators.Ratelimited is exceptions.Ratelimited
    assert middleware.Ratelimited is exceptions.Ratelimited and issubclass(Ratelimited, exceptions.PermissionDenied)
    assert core.get_header(rf.get("/", HTTP_X_API_KEY="k1"), "X-Api-Key") == "k1"
    assert core.get_header(rf.get("/"), "X-Api-Key") == ""
    assert core.rate_re.match("100/10m").groups() == ("100", "10", "m") and core.EXPIRATION_FUDGE == 5
    assert core.__all__ == ["get_usage", "is_ratelimited"] and decorators.__all__ == ["ratelimit"]


@pytest.mark.django_db(transaction=True)
def test_patching_the_decorators_is_ratelimited_decides_for_the_decorator():
    @ratelimit(key="ip", rate="0/m")  # always over its limit, unless the patch says otherwise
    def closed(request):
        return HttpResponse("ok")

    @ratelimit(key="ip", rate="100/m", block=False)
    def open_(request):
        return request.limited

    target = f"{COMPAT}.decorators.is_ratelimited"
    with mock.patch(target, return_value=False) as patched:
        assert closed(rf.get("/")).status_code == 200
    assert patched.call_args.kwargs == {
        "request": mock.ANY, "group": None, "fn": mock.ANY, "key": "ip", "rate": "0/m", "method": ALL, "increment": True,
    }  # fmt: skip
    with mock.patch(target, return_value=True):
        assert open_(rf.get("/")) is True
        with pytest.raises(Ratelimited):
            ratelimit(key="ip", rate="100/m")(lambda request: HttpResponse())(rf.get("/"))
    assert open_(rf.get("/")) is False
    with pytest.raises(Ratelimited):
        closed(rf.get("/"))


@pytest.mark.django_db(transaction=True)
def test_patching_core_get_usage_decides_for_is_ratelimited_and_the_decorator():
    @ratelimit(key="ip", rate="100/m", block=False)
    def view(request):
        return request.limited

    over = {"count": 101, "limit": 100, "should_limit": True, "time_left": 30}
    with mock.patch(f"{COMPAT}.core.get_usage", return_value=over):
        assert is_ratelimited(rf.get("/"), group="p", key="ip", rate="100/m", increment=True)
        assert view(rf.get("/")) is True
    assert view(rf.get("/")) is False
