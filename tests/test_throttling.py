"""The DRF throttles through DRF's APIClient, against the real database."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from django.contrib.auth import get_user_model
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from rest_framework.test import APIClient

from django_tokenbucket import limiter
from django_tokenbucket.request_keys import key_from_text
from django_tokenbucket.testing import frozen_clock

from .settings import REST_FRAMEWORK
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "unreachable"])

T0 = 1_700_000_000.0


@pytest.fixture(autouse=True)
def clock():
    with frozen_clock(T0) as frozen:
        yield frozen


@pytest.fixture
def api():
    return APIClient()


@pytest.fixture
def alice():
    return get_user_model().objects.create_user("alice", password="x")


def codes(api, path, n, **extra):
    return [api.get(path, **extra).status_code for _ in range(n)]


def test_anonymous_drop_in_with_exact_wait(api, clock):
    assert codes(api, "/api/default/", 3) == [200, 200, 200]
    clock.advance(5)
    response = api.get("/api/default/")
    assert response.status_code == 429
    assert response["Retry-After"] == "15"  # anon is 3/m: one token per 20 s
    assert response["Cache-Control"] == "no-store"  # added by RateLimitMiddleware
    assert "15 seconds" in response.json()["detail"]


def test_user_throttle_is_per_user(api, alice):
    api.force_authenticate(alice)
    assert codes(api, "/api/default/", 6) == [200] * 5 + [429]
    api.force_authenticate(None)
    assert api.get("/api/default/").status_code == 200  # anonymous: a bucket of its own


def test_the_python_api_knows_a_drf_scope_as_the_command_does(api, alice):
    # limiter.reset("user", ...) said "unknown rate limit 'user'" while
    # "tokenbucket reset user --key user=<pk>" worked (issue 33).
    api.force_authenticate(alice)
    assert codes(api, "/api/default/", 6) == [200] * 5 + [429]
    key = key_from_text(f"user={alice.pk}")
    assert limiter.get_value("user", key) == 0 and not limiter.check("user", key).ok
    limiter.reset("user", key)
    assert limiter.get_value("user", key) == 5
    assert codes(api, "/api/default/", 1) == [200]
    # Still an error naming what is known, for a name that is none of these.
    with pytest.raises(ImproperlyConfigured, match=r"unknown rate limit 'usr': .* DRF throttle scope .*'user'"):
        limiter.reset("usr", key)


def test_a_denial_by_one_throttle_spends_no_token_of_another(api, alice):
    """UserRateThrottle (5/m) and ScopedRateThrottle 'scarce' (1/m) on one view."""
    api.force_authenticate(alice)
    assert codes(api, "/api/two/", 4) == [200, 429, 429, 429]
    key = ("user", alice.pk)
    assert limiter.get_value("user", key, config={"rate": "5/m"}) == 4  # only the admitted request
    assert limiter.get_value("scarce", key, config={"rate": "1/m"}) == 0


def test_several_scopes_on_one_view_are_all_or_nothing(api, clock):
    """api_burst 3/m and api_sustained 5/h: the burst runs out first, then the hour."""
    assert codes(api, "/api/burst/", 4) == [200, 200, 200, 429]
    clock.advance(60)
    assert codes(api, "/api/burst/", 3) == [200, 200, 429]
    key = ("ip", "127.0.0.1")
    assert limiter.get_value("api_sustained", key, config={"rate": "5/h"}) == pytest.approx(0, abs=0.1)
    clock.advance(60)
    response = api.get("/api/burst/")
    assert response.status_code == 429
    # The binding limit is the hourly one: a token every 12 minutes.
    assert response["Retry-After"] == "600"  # 5/6 of a token short at one per 720 s


def test_rates_are_read_at_request_time(api):
    rates = {**REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "anon": "1/m"}
    with override_settings(REST_FRAMEWORK={**REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": rates}):
        assert codes(api, "/api/default/", 2) == [200, 429]


def test_a_limits_entry_for_the_scope_adds_capacity(api):
    limits = {**BASE_SETTINGS["LIMITS"], "anon": {"rate": "3/m", "capacity": 6}}
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "LIMITS": limits}):
        assert codes(api, "/api/function/", 7) == [200] * 6 + [429]


def test_none_rate_switches_a_scope_off(api):
    rates = {**REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "anon": None}
    with override_settings(REST_FRAMEWORK={**REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": rates}):
        assert codes(api, "/api/default/", 5) == [200] * 5


def test_custom_throttle_with_cost(api):
    assert codes(api, "/api/costly/", 4, HTTP_X_TENANT="acme") == [200, 200, 200, 429]
    assert api.get("/api/costly/", HTTP_X_TENANT="other").status_code == 200
    assert api.get("/api/costly/").status_code == 200  # no tenant: not throttled


def test_throttle_classes_decorator_on_function_views(api):
    assert codes(api, "/api/function/", 4) == [200, 200, 200, 429]


def test_action_throttle_classes(api, alice):
    api.force_authenticate(alice)
    assert codes(api, "/api/things/special/", 6) == [200] * 5 + [429]
    assert codes(api, "/api/things/", 8) == [200] * 8


def test_spoofed_forwarded_for_is_ignored_by_default(api):
    """S1: a client rotating X-Forwarded-For still has one bucket."""
    results = [api.get("/api/default/", HTTP_X_FORWARDED_FOR=f"6.6.6.{i}").status_code for i in range(10)]
    assert results == [200] * 3 + [429] * 7


def test_drf_num_proxies_is_honoured(api):
    with override_settings(REST_FRAMEWORK={**REST_FRAMEWORK, "NUM_PROXIES": 1}):
        for client in ("1.1.1.1", "2.2.2.2"):
            assert codes(api, "/api/default/", 4, HTTP_X_FORWARDED_FOR=f"6.6.6.6, {client}") == [200] * 3 + [429]


def test_store_failure_is_503(api):
    failing = {**BASE_SETTINGS, "OPTIONS": {"DATABASE": "unreachable"}, "RETRY_ATTEMPTS": 1}
    with override_settings(TOKENBUCKET=failing):
        assert api.get("/api/default/").status_code == 503


def test_ratelimit_headers_through_the_middleware(api):
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "HEADERS": True}):
        response = api.get("/api/default/")
    # Anonymous requests meet both default throttles, as with DRF's own classes.
    assert response["RateLimit-Policy"] == '"anon";q=3;w=60, "user";q=5;w=60'
    assert response["RateLimit"] == '"anon";r=2;t=20, "user";r=4;t=12'


HANDLER = "django_tokenbucket.throttling.exception_handler"


def test_rate_limited_in_an_api_view_is_a_403_with_the_key_under_drfs_own_handler(api):
    """Why the handler exists: DRF answers any PermissionDenied itself, message and all."""
    codes = [api.post("/api/inside/", {"username": "mallory"}).status_code for _ in range(5)]
    assert codes == [200] * 5
    response = api.post("/api/inside/", {"username": "mallory"})
    assert response.status_code == 403 and "secret-account" in response.json()["detail"]


def test_the_exception_handler_answers_429_with_the_wait_and_no_key(api, clock):
    with override_settings(REST_FRAMEWORK={**REST_FRAMEWORK, "EXCEPTION_HANDLER": HANDLER}):
        assert [api.post("/api/inside/", {"username": "mallory"}).status_code for _ in range(5)] == [200] * 5
        clock.advance(1.5)  # login is 5/m: the next token comes 12 s after the burst
        response = api.post("/api/inside/", {"username": "mallory"})
        assert response.status_code == 429
        assert response["Retry-After"] == "11"  # 10.5 s, rounded up
        assert response["Cache-Control"] == "no-store"
        assert "secret-account" not in response.content.decode()
        assert api.post("/api/inside/", {"username": "trent"}).status_code == 200
        # Everything else is still DRF's: a 405 stays a 405.
        assert api.get("/api/inside/").status_code == 405


def test_the_exception_handler_answers_503_when_the_store_fails(api):
    failing = {**BASE_SETTINGS, "OPTIONS": {"DATABASE": "unreachable"}, "RETRY_ATTEMPTS": 1}
    with override_settings(REST_FRAMEWORK={**REST_FRAMEWORK, "EXCEPTION_HANDLER": HANDLER}, TOKENBUCKET=failing):
        response = api.post("/api/inside/", {"username": "mallory"})
    assert response.status_code == 503
    assert response.json()["detail"] == "Rate limiting is temporarily unavailable."


# -- DRF's SimpleRateThrottle API: subclasses written for DRF work unchanged ------------

from django.core.checks import run_checks  # noqa: E402
from rest_framework.response import Response  # noqa: E402
from rest_framework.test import APIRequestFactory  # noqa: E402
from rest_framework.views import APIView  # noqa: E402

from django_tokenbucket.registry import known_limits  # noqa: E402
from django_tokenbucket.throttling import SimpleRateThrottle, UserRateThrottle  # noqa: E402


class TenantCacheKeyThrottle(SimpleRateThrottle):
    """Written for DRF: a class-level rate and get_cache_key()."""

    scope = "tenant_key"
    rate = "2/min"

    def get_cache_key(self, request, view):
        tenant = request.headers.get("X-Tenant")
        return self.cache_format % {"scope": self.scope, "ident": tenant} if tenant else None


class TenantView(APIView):
    throttle_classes = [TenantCacheKeyThrottle]

    def get(self, request):
        return Response("ok")


def call(view, **headers):
    return view.as_view()(APIRequestFactory().get("/", headers=headers))


def test_a_drf_style_subclass_with_get_cache_key_and_rate(clock):
    assert [call(TenantView, **{"X-Tenant": "acme"}).status_code for _ in range(3)] == [200, 200, 429]
    response = call(TenantView, **{"X-Tenant": "acme"})
    assert response["Retry-After"] == "30"  # 2/min: a token every 30 s
    assert call(TenantView, **{"X-Tenant": "other"}).status_code == 200
    assert call(TenantView).status_code == 200  # get_cache_key() None: not throttled
    # The bucket is the scope's, keyed by what get_cache_key returned.
    assert limiter.get_value("tenant_key", "throttle_tenant_key_acme", config={"rate": "2/min"}) == 0
    throttle = TenantCacheKeyThrottle()
    assert (throttle.num_requests, throttle.duration) == (2, 60)


def test_a_replaced_timer_decides_at_its_time(transactional_db):
    class Timed(TenantCacheKeyThrottle):
        now_seconds = 1000.0

        def timer(self):
            return self.now_seconds

    class View(TenantView):
        throttle_classes = [Timed]

    assert [call(View, **{"X-Tenant": "t"}).status_code for _ in range(3)] == [200, 200, 429]
    Timed.now_seconds += 30
    assert call(View, **{"X-Tenant": "t"}).status_code == 200


@pytest.mark.parametrize("rate, codes_expected", [("3/sec", [200] * 3 + [429]), ("2/min", [200] * 2 + [429] * 2), ("1/hr", [200] + [429] * 3)])
def test_drfs_documented_spellings(api, rate, codes_expected):
    rates = {**REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "anon": rate}
    with override_settings(REST_FRAMEWORK={**REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": rates}):
        assert codes(api, "/api/function/", 4) == codes_expected


def test_a_bad_rate_is_a_503_and_a_check_error_not_a_500(api, caplog):
    rates = {**REST_FRAMEWORK["DEFAULT_THROTTLE_RATES"], "anon": "garbage"}
    with override_settings(REST_FRAMEWORK={**REST_FRAMEWORK, "DEFAULT_THROTTLE_RATES": rates}):
        response = api.get("/api/function/")
        assert response.status_code == 503
        assert "throttle 'anon' cannot decide: throttle 'anon': invalid rate 'garbage'" in caplog.text
        errors = [m for m in run_checks() if m.id == "django_tokenbucket.E030"]
    assert len(errors) == 1 and "['DEFAULT_THROTTLE_RATES']['anon']" in errors[0].msg


def test_checks_report_throttle_class_rates_and_scopes_without_rates(transactional_db):
    class BadRate(UserRateThrottle):
        scope = "bad_rate_scope"
        rate = "10/fortnight"

    class NoRate(UserRateThrottle):
        scope = "scope_with_no_rate"

    BadRate.__qualname__ = NoRate.__qualname__ = "Module"  # as if defined at module level
    classes = [f"{__name__}.NoRate"]
    try:
        globals()["NoRate"] = NoRate
        with override_settings(REST_FRAMEWORK={**REST_FRAMEWORK, "DEFAULT_THROTTLE_CLASSES": classes}):
            found = {m.id: m.msg for m in run_checks() if m.id.startswith("django_tokenbucket.E03")}
    finally:
        del globals()["NoRate"]
        # Back to what they are, so that the checks of later tests skip them again.
        BadRate.__qualname__ = NoRate.__qualname__ = "test.<locals>.Throttle"
    assert "invalid rate '10/fortnight'" in found["django_tokenbucket.E031"]
    assert "'scope_with_no_rate'" in found["django_tokenbucket.E032"]


def test_allow_request_works_for_views_that_are_not_apiviews(alice, clock):
    from django.http import HttpRequest
    from rest_framework.request import Request

    class PlainView:
        pass

    request = Request(HttpRequest())
    request.user = alice
    throttle = UserRateThrottle()
    assert [UserRateThrottle().allow_request(request, PlainView()) for _ in range(6)] == [True] * 5 + [False]
    assert throttle.get_cache_key(request, PlainView()) == f"throttle_user_{alice.pk}"


def test_scopes_are_known_without_rest_framework_in_installed_apps():
    from django.conf import settings

    apps = [app for app in settings.INSTALLED_APPS if app != "rest_framework"]
    with override_settings(INSTALLED_APPS=apps):
        known = known_limits(load_views=False)
    assert known["anon"].source == "DRF throttle rates" and known["tenant_key"].config.rate == 2 * 10**6


def test_the_throttles_import_first_in_a_fresh_process():
    # DEFAULT_THROTTLE_CLASSES names our classes, and importing rest_framework.views
    # reads it: a project whose first import is ours must not see a half-made module.
    code = "import django; django.setup(); import django_tokenbucket.throttling as t; print(t.AnonRateThrottle.scope)"
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.settings"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout.strip() == "anon", done.stderr[-2000:]
