"""``@ratelimit`` through Django's test clients, against the real database; the RateLimit
headers' syntax under hostile limit names and what they disclose (RELIABILITY-PLAN R2,
S8), and what requests refused with 401 or 403 cost."""

from __future__ import annotations

import logging
import re

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core import checks
from django.core.exceptions import ImproperlyConfigured
from django.db import connections
from django.http import HttpResponseForbidden
from django.test import override_settings
from django.views import View
from rest_framework.authentication import BaseAuthentication
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.permissions import IsAuthenticated
from rest_framework.response import Response
from rest_framework.views import APIView

from django_tokenbucket import limiter
from django_tokenbucket.algorithms import MICRO
from django_tokenbucket.backends import get_backend
from django_tokenbucket.decorators import declared_limits, ratelimit
from django_tokenbucket.http import ratelimit_headers
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock
from django_tokenbucket.throttling import AnonRateThrottle

from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "unreachable"])

T0 = 1_700_000_000.0


@pytest.fixture(autouse=True)
def clock():
    with frozen_clock(T0) as frozen:
        yield frozen


def statuses(client, path, n, **extra):
    return [client.get(path, **extra).status_code for _ in range(n)]


def statuses_of_posts(client, username, n):
    return [client.post("/login/", {"username": username}).status_code for _ in range(n)]


def test_blocks_with_429_retry_after_and_no_store(client, clock):
    assert statuses(client, "/inline-ip/", 2) == [200, 200]
    clock.advance(10)
    response = client.get("/inline-ip/", HTTP_ACCEPT="application/json")
    assert response.status_code == 429
    assert response["Retry-After"] == "20"  # a token every 30 s, 10 s already passed
    assert response["Cache-Control"] == "no-store"
    assert response.json() == {"detail": "Too many requests. Retry in 20 seconds.", "retry_after": 20}
    plain = client.get("/inline-ip/")
    assert plain["Content-Type"].startswith("text/plain") and b"Retry in 20 seconds" in plain.content


def test_retry_after_is_rounded_up_and_at_least_one(client, clock):
    statuses(client, "/inline-ip/", 2)
    clock.advance(29.9)
    assert client.get("/inline-ip/")["Retry-After"] == "1"
    clock.advance(0.1)
    assert client.get("/inline-ip/").status_code == 200


def test_default_name_is_the_views_dotted_path(client):
    client.get("/inline-ip/")
    assert list(RateLimit.objects.values_list("name", flat=True)) == ["tests.views.inline_ip"]


def test_each_address_has_its_own_bucket(client):
    assert statuses(client, "/inline-ip/", 3, REMOTE_ADDR="10.0.0.1") == [200, 200, 429]
    assert statuses(client, "/inline-ip/", 2, REMOTE_ADDR="10.0.0.2") == [200, 200]


def test_block_false_runs_the_view_and_tells_it(client):
    bodies = [client.get("/soft/").json() for _ in range(3)]
    assert [b["limited"] for b in bodies] == [False, False, True]
    assert [b["value"] for b in bodies] == [1, 0, 0]


def test_user_key_separates_users_and_anonymous_addresses(client, django_user_model):
    alice = django_user_model.objects.create_user("alice", password="x")
    bob = django_user_model.objects.create_user("bob", password="x")
    client.force_login(alice)
    assert [client.get("/soft/").json()["limited"] for _ in range(3)] == [False, False, True]
    client.force_login(bob)
    assert client.get("/soft/").json()["limited"] is False
    client.logout()
    assert client.get("/soft/", REMOTE_ADDR="10.1.1.1").json()["limited"] is False
    assert client.get("/soft/", REMOTE_ADDR="10.1.1.2").json()["limited"] is False


def test_post_field_key_and_method_filter(client):
    for _ in range(5):
        assert client.post("/login/", {"username": "alice"}).status_code == 200
    assert client.post("/login/", {"username": "alice"}).status_code == 429
    assert client.post("/login/", {"username": "bob"}).status_code == 200
    assert client.get("/login/").status_code == 200  # GET is not counted (method=UNSAFE)


def test_a_named_limit_is_read_from_the_settings_in_force_on_each_request(client):
    """An inline limit is parsed once per view; one named in LIMITS is not: its entry may change."""
    assert client.post("/login/", {"username": "carol"}).status_code == 200
    stricter = {**BASE_SETTINGS, "LIMITS": {**BASE_SETTINGS["LIMITS"], "login": {"rate": 1, "period": 3600}}}
    with override_settings(TOKENBUCKET=stricter):
        assert client.post("/login/", {"username": "dave"}).status_code == 200
        assert client.post("/login/", {"username": "dave"}).status_code == 429
    assert statuses_of_posts(client, "erin", 2) == [200, 200]  # 5 a minute again


def test_missing_field_falls_back_to_the_address_not_a_shared_bucket(client):
    for _ in range(5):
        client.post("/login/", {}, REMOTE_ADDR="10.2.0.1")
    assert client.post("/login/", {}, REMOTE_ADDR="10.2.0.1").status_code == 429
    assert client.post("/login/", {}, REMOTE_ADDR="10.2.0.2").status_code == 200


def test_dotted_path_key(client):
    assert client.get("/dotted/", HTTP_X_TENANT="a").status_code == 200
    assert client.get("/dotted/", HTTP_X_TENANT="a").status_code == 429
    assert client.get("/dotted/", HTTP_X_TENANT="b").status_code == 200


def test_a_key_function_returning_none_exempts_the_request(client):
    assert statuses(client, "/exemptable/", 2) == [200, 429]
    assert statuses(client, "/exemptable/?staff=1", 3) == [200, 200, 200]


def test_weighted_count(client):
    assert client.get("/weighted/?cost=7").json()["value"] == 3
    assert client.get("/weighted/?cost=4").status_code == 429
    assert client.get("/weighted/?cost=3").status_code == 200


async def test_async_view(async_client):
    try:
        codes = [(await async_client.get("/async/")).status_code for _ in range(3)]
    finally:
        # The database work ran in asgiref's worker thread, on its own connection.
        await sync_to_async(connections.close_all)()
    assert codes == [200, 200, 429]


def test_async_wrapper_stays_a_coroutine_function():
    from asgiref.sync import iscoroutinefunction

    from . import views

    assert iscoroutinefunction(views.async_view)


def test_class_decorator_limits_every_method(client):
    assert client.get("/class/").status_code == 200
    assert client.post("/class/").status_code == 200
    assert client.get("/class/").status_code == 429
    assert RateLimit.objects.get().name == "tests.views.ClassView"


def test_method_decorator(client):
    assert statuses(client, "/method/", 2) == [200, 429]
    assert RateLimit.objects.get().name == "tests.views.MethodDecorated.get"


def test_shadow_mode_never_blocks_but_says_it_would(client):
    bodies = [client.get("/shadowed/") for _ in range(3)]
    assert [b.status_code for b in bodies] == [200, 200, 200]
    assert [b.json()["would_deny"] for b in bodies] == [False, True, True]
    assert [b.json()["limited"] for b in bodies] == [False, False, False]


def test_rate_limited_raised_in_a_view_becomes_429(client):
    assert client.get("/raises/?who=a").status_code == 200
    response = client.get("/raises/?who=a")
    assert response.status_code == 429 and response["Retry-After"] == "60"
    assert response["Cache-Control"] == "no-store"


@pytest.mark.parametrize("path", ["/inline-ip/", "/raises/?who=flood"], ids=["decorator", "RateLimited raised"])
def test_a_flood_of_429s_is_not_a_flood_of_log_lines(client, caplog, path):
    """Django logs every 4xx response at WARNING; the 429s of this library are left out, or
    a flood would write a line per request. The limiter's own INFO line says, once, that
    the key started being denied. LOG_DENIED_REQUESTS brings Django's lines back."""

    def lines(logger: str) -> list[logging.LogRecord]:
        return [record for record in caplog.records if record.name == logger]

    with override_settings(TOKENBUCKET=BASE_SETTINGS), caplog.at_level(logging.INFO):
        codes = statuses(client, path, 12)
    assert codes.count(429) >= 10
    assert lines("django.request") == []
    denials = lines("django_tokenbucket")
    assert len(denials) == 1 and "started denying key" in denials[0].getMessage()

    caplog.clear()
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "LOG_DENIED_REQUESTS": True}), caplog.at_level(logging.INFO):
        assert statuses(client, path, 2) == [429, 429]
    assert [(record.levelname, record.status_code) for record in lines("django.request")] == [("WARNING", 429)] * 2


def test_store_failure_answers_503_not_500(client):
    failing = {**BASE_SETTINGS, "OPTIONS": {"DATABASE": "unreachable"}, "RETRY_ATTEMPTS": 1}
    with override_settings(TOKENBUCKET=failing):
        response = client.get("/probe/", HTTP_ACCEPT="application/json")
        assert response.status_code == 503 and response["Cache-Control"] == "no-store"
        with override_settings(TOKENBUCKET={**failing, "FAIL_OPEN": True}):
            assert client.get("/probe/").status_code == 200


def test_response_is_replaceable(client):
    custom = {**BASE_SETTINGS, "RESPONSE": "tests.test_decorators.teapot"}
    with override_settings(TOKENBUCKET=custom):
        statuses(client, "/inline-ip/", 2)
        response = client.get("/inline-ip/")
    assert response.status_code == 418 and response["Retry-After"] == "30"
    # The factory is imported once, and only while it is the setting.
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "RESPONSE": "tests.test_decorators.teapot_that_knows_better"}):
        response = client.get("/inline-ip/")
    assert response.status_code == 418 and response["Retry-After"] == "3600"  # the factory's own is kept
    response = client.get("/inline-ip/")
    assert response.status_code == 429 and response["Retry-After"] == "30" and b"Too many requests" in response.content


def teapot(request, status):
    from django.http import HttpResponse

    return HttpResponse("slow down", status=418)


def teapot_that_knows_better(request, status):
    response = teapot(request, status)
    response["Retry-After"] = "3600"
    return response


class TestRateLimitHeaders:
    @pytest.fixture(autouse=True)
    def headers_on(self):
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, "HEADERS": True}):
            yield

    def test_on_allowed_and_denied_responses(self, client, clock):
        first = client.get("/inline-ip/")
        assert first["RateLimit-Policy"] == '"tests.views.inline_ip";q=2;w=60'
        assert first["RateLimit"] == '"tests.views.inline_ip";r=1;t=30'
        client.get("/inline-ip/")
        clock.advance(5)
        denied = client.get("/inline-ip/")
        assert denied.status_code == 429
        assert denied["RateLimit"] == '"tests.views.inline_ip";r=0;t=25'
        assert int(denied["Retry-After"]) >= 25

    def test_stacked_decorators_report_every_limit(self, client, clock):
        for _ in range(4):
            assert client.post("/stacked/", {"username": "bob"}).status_code == 200
        allowed = client.post("/stacked/", {"username": "bob"})
        # Only the requester's own bucket: "login" is keyed by the username the request
        # named, which may be someone else's account.
        assert allowed["RateLimit-Policy"] == '"ten_per_minute";q=10;w=60'
        assert allowed["RateLimit"] == '"ten_per_minute";r=5;t=30'
        refused = [client.post("/stacked/", {"username": "bob"}) for _ in range(3)]
        # A refused request names the limits that refused it: here "login" alone, which
        # is not shown, so none (issue 49: the same on every refusal, whether the store
        # or memory refused it).
        assert [r.status_code for r in refused] == [429] * 3
        assert not any(r.has_header("RateLimit") for r in refused)

    def test_identical_refusals_name_the_same_limits(self, clock):
        """Issue 49: the first 429 of two stacked limits (decided by the store) named both,
        the next ones (refused from memory) only the one that refused."""
        view = ratelimit("burst_two", key="ip", rate="2/m")(
            ratelimit("sustained_ten", key="ip", rate="10/h")(lambda request: HttpResponse("ok"))
        )
        codes, headers = [], []
        for _ in range(6):
            response = view(RequestFactory().get("/", REMOTE_ADDR="198.51.100.70"))
            codes.append(response.status_code)
            headers.append((response.get("RateLimit-Policy"), response.get("RateLimit")))
        assert codes == [200, 200, 429, 429, 429, 429]
        assert headers[2][0] == '"burst_two";q=2;w=60'
        assert len(set(headers[2:])) == 1, headers[2:]

    def test_off_by_default(self, client):
        with override_settings(TOKENBUCKET=BASE_SETTINGS):
            assert not client.get("/inline-ip/").has_header("RateLimit")


class TestDeclarations:
    def test_inline_limit_needs_a_rate_or_a_name(self):
        with pytest.raises(ImproperlyConfigured, match="rate="):
            ratelimit(capacity=3)
        with pytest.raises(ImproperlyConfigured, match="needs the name"):
            ratelimit()

    def test_bad_key_spec_fails_at_decoration(self):
        with pytest.raises(ImproperlyConfigured, match="unknown rate-limit key"):
            ratelimit("login", key="cookie:x")

    def test_bad_inline_rate_fails_at_decoration(self):
        with pytest.raises(ImproperlyConfigured, match="10/M"):
            ratelimit(rate="10/M")(lambda request: None)

    def test_undefined_limit_name_fails_the_system_check(self, monkeypatch):
        from django_tokenbucket import decorators

        # The registration is global: undo it so that later check runs stay clean.
        monkeypatch.setattr(decorators, "_declared", dict(decorators._declared))

        @ratelimit("no_such_limit_anywhere")
        def view(request):
            raise AssertionError

        errors = [e for e in checks.run_checks() if e.id == "django_tokenbucket.E011"]
        assert len(errors) == 1 and "no_such_limit_anywhere" in errors[0].msg
        assert "no_such_limit_anywhere" in declared_limits()


@pytest.fixture
def django_user_model():
    return get_user_model()


# -- stacked inline limits and request.limited ---------------------------------------------

from django.http import HttpResponse  # noqa: E402
from django.test import RequestFactory  # noqa: E402

rf = RequestFactory()


def test_request_limited_is_set_even_when_the_request_is_not_counted():
    @ratelimit(key="ip", rate="1/m", method="POST", block=False)
    def view(request):
        return HttpResponse(f"{request.limited} {request.ratelimit}")

    assert view(rf.get("/")).content == b"False None"  # GET is not counted, and the view can still read both
    assert view(rf.post("/")).content.startswith(b"False Status(")
    assert view(rf.post("/")).content.startswith(b"True Status(")

    @ratelimit(key=lambda request: None, rate="1/m", block=False)
    def exempt(request):
        return HttpResponse(str(request.limited))

    assert exempt(rf.get("/")).content == b"False"


def test_stacked_inline_limits_never_share_a_bucket():
    @ratelimit(key="ip", rate="1/m", method="GET", block=False)
    @ratelimit(key="ip", rate="1/m", method="POST", block=False)
    def by_method(request):
        return HttpResponse(str(request.limited))

    # One GET and one POST each get their own bucket (django-ratelimit's test_stacked_methods).
    assert [by_method(r).content for r in (rf.get("/"), rf.post("/"), rf.get("/"), rf.post("/"))] == [
        b"False", b"False", b"True", b"True"
    ]

    @ratelimit(key="ip", rate="100/m", block=False)
    @ratelimit(key="ip", rate="10/s", block=False)
    def burst(request):
        return HttpResponse(str(request.limited))

    assert [burst(rf.get("/")).content for _ in range(11)] == [b"False"] * 10 + [b"True"]
    names = set(RateLimit.objects.filter(name__contains="burst").values_list("name", flat=True))
    assert names == {f"{__name__}.{burst.__qualname__}", f"{__name__}.{burst.__qualname__}[100/m,ip]"}


def test_stacked_decorators_naming_one_limit_share_it():
    @ratelimit("login", key="ip", block=False)
    @ratelimit("login", key="ip", block=False)
    def twice(request):
        return HttpResponse(str(request.limited))

    # Both take from "login" (5/m): each request spends two of its tokens.
    assert [twice(rf.get("/")).content for _ in range(3)] == [b"False", b"False", b"True"]


# -- async views on each backend ---------------------------------------------------------


@pytest.fixture(params=["database", "redis"])
def async_backend(request):
    """The inline limits of the async views on each backend; yields the backend's name."""
    overrides = {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend"}
    if request.param == "redis":
        overrides = request.getfixturevalue("redis_store")
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **overrides}):
        yield request.param


async def _codes(async_client, path: str, n: int, **extra) -> list[int]:
    return [(await async_client.get(path, **extra)).status_code for _ in range(n)]


def _assert_no_thread_on_redis(name: str) -> None:
    if name == "redis":
        # Every decision was awaited on the asyncio client: none ran in a worker thread.
        calls = get_backend().async_calls
        assert calls["asyncio"] > 0 and calls["thread"] == 0, calls


async def _close_thread_connections() -> None:
    # Planning (user lookups) and the database backend ran in asgiref's worker thread.
    await sync_to_async(connections.close_all)()


async def test_async_view_on_each_backend(async_client, async_backend):
    try:
        assert await _codes(async_client, "/async/", 3) == [200, 200, 429]
        assert await limiter.aget_value("tests.views.async_view", ("ip", "127.0.0.1"), {"rate": "2/m"}) == 0
    finally:
        await _close_thread_connections()
    _assert_no_thread_on_redis(async_backend)


async def test_async_view_keyed_by_user_loads_the_user_in_a_thread(async_client, async_backend):
    name, config = "tests.views.async_by_user", {"rate": "2/m"}
    try:
        alice = await get_user_model().objects.acreate(username="alice")
        bob = await get_user_model().objects.acreate(username="bob")
        await async_client.aforce_login(alice)
        assert await _codes(async_client, "/async/user/", 3) == [200, 200, 429]
        await async_client.aforce_login(bob)
        assert await _codes(async_client, "/async/user/", 1) == [200]
        assert await limiter.aget_value(name, ("user", alice.pk), config) == 0
        assert await limiter.aget_value(name, ("user", bob.pk), config) == 1
        # Anonymous requests are told apart by address, as on a sync view.
        await async_client.alogout()
        assert await _codes(async_client, "/async/user/", 1) == [200]
        assert await limiter.aget_value(name, ("ip", "127.0.0.1"), config) == 1
    finally:
        await _close_thread_connections()
    _assert_no_thread_on_redis(async_backend)


async def test_async_stacked_limits_are_all_or_nothing(async_client, async_backend):
    ip_limit = ("tests.views.async_stacked", {"rate": "3/m"})
    key_limit = ("tests.views.async_stacked[1/m]", {"rate": "1/m"})
    try:
        assert await _codes(async_client, "/async/stacked/", 1, headers={"X-Key": "k"}) == [200]
        # Refused by the X-Key limit: the address limit spends nothing.
        assert await _codes(async_client, "/async/stacked/", 2, headers={"X-Key": "k"}) == [429, 429]
        assert await limiter.aget_value(ip_limit[0], ("ip", "127.0.0.1"), ip_limit[1]) == 2
        assert await limiter.aget_value(key_limit[0], "k", key_limit[1]) == 0
        # A request the key function exempts takes from the address limit only.
        assert await _codes(async_client, "/async/stacked/", 3) == [200, 200, 429]
    finally:
        await _close_thread_connections()
    _assert_no_thread_on_redis(async_backend)


async def test_async_view_with_a_count_function(async_client, async_backend):
    try:
        response = await async_client.get("/async/weighted/?cost=4", headers={"X-Key": "w"})
        assert response.status_code == 200 and response.json()["value"] == 1
        assert await _codes(async_client, "/async/weighted/?cost=2", 1, headers={"X-Key": "w"}) == [429]
        assert await _codes(async_client, "/async/weighted/?cost=1", 1, headers={"X-Key": "w"}) == [200]
    finally:
        await _close_thread_connections()
    _assert_no_thread_on_redis(async_backend)


async def test_async_key_and_count_functions_are_awaited(async_client, async_backend):
    user_limit = ("tests.views.async_awaited_key[3/m]", {"rate": "3/m"})
    ip_limit = ("tests.views.async_awaited_key", {"rate": "10/m"})
    try:
        alice = await get_user_model().objects.acreate(username="alice")
        # Anonymous: the key function exempts the request from the user limit.
        assert await _codes(async_client, "/async/awaited/?cost=3", 1) == [200]
        await async_client.aforce_login(alice)
        assert await _codes(async_client, "/async/awaited/?cost=2", 2) == [200, 429]
        assert await limiter.aget_value(user_limit[0], ("user", alice.pk), user_limit[1]) == 1
        assert await limiter.aget_value(ip_limit[0], ("ip", "127.0.0.1"), ip_limit[1]) == 8
    finally:
        await _close_thread_connections()
    _assert_no_thread_on_redis(async_backend)


def test_an_async_key_or_count_on_a_sync_view_is_an_error_at_decoration():
    async def key(request):
        return "k"

    async def cost(request):
        return 1

    for options in ({"key": key}, {"count": cost}):
        with pytest.raises(ImproperlyConfigured, match=r"@ratelimit on .*view: an async def key=, count= or rate= can only"):

            @ratelimit(rate="1/m", **options)
            def view(request):
                return None


def test_what_an_async_view_plans_on_the_event_loop(rf):
    from django.contrib.auth.models import AnonymousUser
    from django.utils.functional import SimpleLazyObject

    from django_tokenbucket.view_limits import ViewLimit as _ViewLimit
    from django_tokenbucket.view_limits import _plans_on_the_loop

    def limit(key, count=1):
        return _ViewLimit("x", key, {"rate": "1/m"}, None, count, True)

    request = rf.get("/")
    loads = []
    request.user = SimpleLazyObject(lambda: loads.append(1) or AnonymousUser())
    for key in ("ip", "header:X-Key", "get:q", "post:name", "username"):
        assert _plans_on_the_loop(request, limit(key))
    # The project's functions, and a user that is not loaded yet, may query the database.
    assert not _plans_on_the_loop(request, limit("tests.views._header_or_none"))
    assert not _plans_on_the_loop(request, limit(lambda request: "k"))

    async def awaited(request):
        return "k"

    assert _plans_on_the_loop(request, limit(awaited)) and _plans_on_the_loop(request, limit("ip", count=awaited))
    assert not _plans_on_the_loop(request, limit("ip", count=lambda request: 1))
    assert not _plans_on_the_loop(request, limit("user"))
    assert not _plans_on_the_loop(request, limit("user_or_ip"))
    assert loads == []  # asking did not load it
    request.user.is_authenticated
    assert _plans_on_the_loop(request, limit("user")) and _plans_on_the_loop(request, limit("user_or_ip"))
    without_auth = rf.get("/")  # no authentication middleware: no user to load
    assert _plans_on_the_loop(without_auth, limit("user_or_ip"))


@pytest.mark.parametrize("own_options", [False, True], ids=["Django's options()", "its own options()"])
def test_method_decorator_on_dispatch_keeps_preflights_free_where_django_answers_them(db, rf, own_options):
    """``method_decorator(ratelimit(...), name="dispatch")``, the usual way to decorate a
    class-based view, limits it as decorating the class does: a preflight that Django's
    ``options()`` answers runs none of the view's code and is not counted (issue 46)."""
    from django.utils.decorators import method_decorator

    @method_decorator(ratelimit(key="ip", rate="2/m"), name="dispatch")
    class Endpoint(View):
        def get(self, request):
            return HttpResponse("work")

        if own_options:

            def options(self, request):
                return HttpResponse("computed options")

    view = Endpoint.as_view()
    codes = [view(rf.options("/")).status_code for _ in range(3)]
    assert codes == ([200, 200, 429] if own_options else [200, 200, 200])
    if not own_options:
        assert [view(rf.get("/")).status_code for _ in range(3)] == [200, 200, 429]


def test_a_per_user_limit_keyed_none_for_anonymous_visitors_is_pointed_out_in_debug(client, caplog, settings):
    """Issue 49: ``key=request.user.pk`` (the old Quick start) is None for every visitor
    who is not signed in: one bucket for all of them. In DEBUG that is said once."""
    from django.contrib.auth import get_user_model

    settings.DEBUG = True
    user = get_user_model().objects.create_user("hinted", password="x")
    with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
        client.get("/keyed-by-pk/")  # anonymous: key None
        client.force_login(user)
        client.get("/keyed-by-pk/")  # signed in: key user.pk
        client.logout()
        client.get("/keyed-by-pk/")
        client.get("/keyed-by-pk/")
    warnings = [r.getMessage() for r in caplog.records if "both with a key and with key=None" in r.getMessage()]
    assert len(warnings) == 1 and "'keyed_by_pk'" in warnings[0] and "user_or_ip" in warnings[0]


def test_a_global_limit_is_not_pointed_out(client, caplog, settings):
    settings.DEBUG = True
    with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
        for _ in range(3):
            client.get("/global-budget/")
    assert not [r for r in caplog.records if "key=None" in r.getMessage()]


# ---------------------------------------------------------------------------------------
# R2: hostile limit names in the RateLimit headers
# ---------------------------------------------------------------------------------------


def figure(line: str) -> None:
    print(f"\n{line}")


_SF_STRING = r'"(?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*"'
_SF_PARAMS = r"(?:;[a-z*][a-z0-9_.*-]*=-?\d{1,15})*"
_SF_LIST = re.compile(rf"{_SF_STRING}{_SF_PARAMS}(?:[ \t]*,[ \t]*{_SF_STRING}{_SF_PARAMS})*")


def parse_sf_list(value: str) -> list[tuple[str, dict[str, int]]]:
    """Parse an RFC 9651 list of sf-string items with integer parameters; raise on anything else."""
    assert value.isascii() and _SF_LIST.fullmatch(value), value
    members = []
    for match in re.finditer(rf"({_SF_STRING})({_SF_PARAMS})", value):
        name = re.sub(r'\\(["\\])', r"\1", match.group(1)[1:-1])
        params = {k: int(v) for k, v in re.findall(r";([a-z*][a-z0-9_.*-]*)=(-?\d+)", match.group(2))}
        members.append((name, params))
    return members


HOSTILE_NAMES = ['a"b', "back\\slash", 'x";q=999', 'y", "z";r=99', "semi;colon,comma", "é-limit", "名前", "\\"]


def test_r2_hostile_names_give_parseable_headers():
    with frozen_clock(T0):
        statuses = [limiter.limit(name, "k", count=2, config={"rate": 5, "period": 60}) for name in HOSTILE_NAMES]
    headers = ratelimit_headers(statuses)
    response = HttpResponse()
    for header, value in headers.items():
        response[header] = value  # no BadHeaderError
    policies = parse_sf_list(headers["RateLimit-Policy"])
    limits = parse_sf_list(headers["RateLimit"])
    assert len(policies) == len(limits) == len(HOSTILE_NAMES)  # nothing injected a member
    for (name, policy), (_, current), original in zip(policies, limits, HOSTILE_NAMES, strict=True):
        assert policy == {"q": 5, "w": 60} and current == {"r": 3, "t": 24}
        if original.isascii():
            assert name == original  # ASCII names round-trip exactly
    figure(f"R2 {settings.DB}: {len(HOSTILE_NAMES)} hostile names, header parse failures 0, injected members 0")


# ---------------------------------------------------------------------------------------
# S8: no global capacity in the headers
# ---------------------------------------------------------------------------------------


def test_s8_a_global_limit_is_not_disclosed_in_the_headers():
    with frozen_clock(T0):
        per_client = limiter.limit("s8-client", "203.0.113.9", config={"rate": 5, "period": 60})
        service_wide = limiter.limit("s8-global", None, config={"rate": 100000, "period": 60})
    assert ratelimit_headers([service_wide]) == {}
    headers = ratelimit_headers([per_client, service_wide])
    assert [name for name, _ in parse_sf_list(headers["RateLimit-Policy"])] == ["s8-client"]
    assert "100000" not in "".join(headers.values())


class _GuessableAuthentication(BaseAuthentication):
    """Rejects every credential it is given, as a wrong API token would be."""

    def authenticate(self, request):
        if request.META.get("HTTP_AUTHORIZATION"):
            raise AuthenticationFailed("bad credentials")
        return None


class _MembersOnly(APIView):
    authentication_classes = [_GuessableAuthentication]
    permission_classes = [IsAuthenticated]
    throttle_classes = [AnonRateThrottle]

    def get(self, request):
        return Response({})


@ratelimit("s8-forbidden", key="ip", rate="5/m")
def _forbidden(request):
    return HttpResponseForbidden()


def test_s8_what_requests_refused_with_401_or_403_cost():
    """DRF authenticates and checks permissions before it throttles, so its throttles never
    see a refused request; ``@ratelimit`` decides before the view runs, so it counts them."""
    factory = RequestFactory()
    with frozen_clock(T0):
        for headers in ({}, {"HTTP_AUTHORIZATION": "Token guess"}, {"HTTP_AUTHORIZATION": "Token guess-2"}):
            assert _MembersOnly.as_view()(factory.get("/members/", **headers)).status_code in (401, 403)
        assert not RateLimit.objects.filter(name="anon").exists()  # no token spent, no row
        for _ in range(2):
            assert _forbidden(factory.get("/forbidden/")).status_code == 403
        assert list(RateLimit.objects.filter(name="s8-forbidden").values_list("value", flat=True)) == [3 * MICRO]
