"""Overrides against an attacker (docs/security.md, "Third round", issue 47, items 1, 2
and 5), as the operator fighting one would meet them: a block typed as the access log
shows an address or a header reaches that client's requests, and an override smaller
than a view's count refuses the request, never a 500.

Every test here failed on 4c6264d, the code before the fixes. Run on the database
(SQLite, PostgreSQL or MariaDB, whichever the run uses) and on Redis.
"""

from __future__ import annotations

import io
import logging
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.core.management import call_command
from django.http import HttpResponse
from django.test import RequestFactory, override_settings

from django_tokenbucket import RateLimited, limiter, registry
from django_tokenbucket.compat.ratelimit.decorators import ratelimit as compat_ratelimit
from django_tokenbucket.compat.ratelimit.exceptions import Ratelimited
from django_tokenbucket.decorators import ratelimit
from django_tokenbucket.testing import frozen_clock

from .settings import TOKENBUCKET as BASE_SETTINGS

rf = RequestFactory()
T0 = 1_700_000_000.0
BACKENDS = {
    "database": {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend"},
    "redis": {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend"},
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, transactional_db):
    overrides = dict(BACKENDS[request.param])
    if request.param == "redis":
        overrides.update(request.getfixturevalue("redis_store"))
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **overrides}):
        with frozen_clock(T0):
            yield request.param


def ok(response) -> bool:
    return response.status_code == 200


# -- 1. a block on an address reaches the requests of that address ------------------------


@ratelimit("guarded_ip", key="ip", rate="50/m")
def guarded_ip(request):
    return HttpResponse("ok")


@compat_ratelimit(group="compat_guarded", key="ip", rate="50/m")
def compat_guarded_ip(request):
    return HttpResponse("ok")


def compat_ok(request) -> bool:
    try:
        return ok(compat_guarded_ip(request))
    except Ratelimited:
        return False


# (what the operator types, the client's REMOTE_ADDR as the server sees it)
TYPED_ADDRESSES = [
    ("2001:db8:51:7::abcd", "2001:db8:51:7::1"),  # the /64 the client rotates in
    ("::ffff:198.51.100.9", "198.51.100.9"),  # what a dual-stack server logs
    ("[2001:db8:51:7::abcd]:443", "2001:db8:51:7::99"),  # a proxy's bracketed form
    ("fe80::1%eth0", "fe80::2"),  # a zone id
    ("64:ff9b::198.51.100.10", "198.51.100.10"),  # NAT64
    (" 198.51.100.11 ", "198.51.100.11"),
]


@pytest.mark.parametrize(("typed", "remote"), TYPED_ADDRESSES)
def test_1_a_block_from_the_command_reaches_the_address_it_names(backend, typed, remote):
    request = rf.get("/", REMOTE_ADDR=remote)
    assert ok(guarded_ip(request))
    call_command("tokenbucket", "block", "guarded_ip", "--key", f"ip={typed}", stdout=_null())
    assert guarded_ip(rf.get("/", REMOTE_ADDR=remote)).status_code == 429
    # Another client is untouched.
    assert ok(guarded_ip(rf.get("/", REMOTE_ADDR="203.0.113.50")))


@pytest.mark.parametrize(("typed", "remote"), TYPED_ADDRESSES[:3])
def test_1_a_block_from_the_api_reaches_the_address_it_names(backend, typed, remote):
    limiter.block("guarded_ip", ("ip", typed))
    assert guarded_ip(rf.get("/", REMOTE_ADDR=remote)).status_code == 429


@pytest.mark.parametrize(("typed", "remote"), TYPED_ADDRESSES[:2])
def test_1_a_block_on_a_limit_of_the_django_ratelimit_layer_reaches_its_address(backend, typed, remote):
    assert registry.is_compat_limit("compat_guarded:50/60s")
    assert compat_ok(rf.get("/", REMOTE_ADDR=remote))  # the limit is decided once, as on a live site
    call_command("tokenbucket", "block", "compat_guarded:50/60s", "--key", f"ip={typed}", stdout=_null())
    assert not compat_ok(rf.get("/", REMOTE_ADDR=remote))
    assert compat_ok(rf.get("/", REMOTE_ADDR="203.0.113.50"))


def test_1_a_typed_address_that_is_none_is_refused_with_the_reason(backend):
    with pytest.raises(Exception, match="'not-an-address' is not an IP address"):
        call_command("tokenbucket", "block", "guarded_ip", "--key", "ip=not-an-address", stdout=_null())


# -- 2. a header's name is the same header in any case ------------------------------------


@ratelimit("guarded_header", key="header:x-api-key", rate="50/m")
def guarded_header(request):
    return HttpResponse("ok")


@ratelimit("guarded_header", key="header:X-Api-Key", rate="50/m")
def guarded_header_elsewhere(request):
    return HttpResponse("ok")


@pytest.mark.parametrize("typed", ["header:X-Api-Key", "header:x-api-key", "HEADER:X-API-KEY"])
def test_2_a_block_on_a_header_key_reaches_it_in_any_spelling_of_the_name(backend, typed):
    call_command("tokenbucket", "block", "guarded_header", "--key", f"{typed}=sk_x", stdout=_null())
    for view in (guarded_header, guarded_header_elsewhere):
        assert view(rf.get("/", HTTP_X_API_KEY="sk_x")).status_code == 429
        assert ok(view(rf.get("/", HTTP_X_API_KEY="sk_other")))


def test_2_two_views_spelling_one_header_differently_share_the_bucket(backend):
    first = ratelimit("two_headers", key="header:x-api-key", rate="2/m")(lambda request: HttpResponse("ok"))
    second = ratelimit("two_headers", key="header:X-API-Key", rate="2/m")(lambda request: HttpResponse("ok"))
    codes = [view(rf.get("/", HTTP_X_API_KEY="sk_y")).status_code for view in (first, second, first, second)]
    assert codes == [200, 200, 429, 429]


def _null() -> io.StringIO:
    return io.StringIO()


# -- 5. an override smaller than a view's count refuses the request, never a 500 ------------


@ratelimit("heavy", key="ip", rate="20/m", count=5)
def heavy(request):
    return HttpResponse("ok")


@pytest.mark.parametrize("every_key", [False, True], ids=["one key", "every key"])
def test_5_an_override_below_a_views_count_refuses_without_an_error(backend, caplog, every_key):
    assert ok(heavy(rf.get("/", REMOTE_ADDR="198.51.100.5")))
    key = None if every_key else ("ip", "198.51.100.5")
    limiter.override("heavy", key, capacity=2, until=timedelta(minutes=10))
    with caplog.at_level(logging.WARNING, logger="django.request"):
        responses = [heavy(rf.get("/", REMOTE_ADDR="198.51.100.5")) for _ in range(3)]
    assert [r.status_code for r in responses] == [429] * 3  # was 500: ValueError, count exceeds the capacity
    assert responses[0]["Retry-After"] == "600"  # when the override ends
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    # Nothing was spent while it refused: the bucket holds what the first request left.
    limiter.clear_override("heavy", key)
    assert limiter.get_value("heavy", ("ip", "198.51.100.5")) == 15


def test_5_without_an_end_the_refusal_says_it_never_succeeds(backend):
    limiter.override("heavy", None, capacity=2)
    status = limiter.limit("heavy", ("ip", "198.51.100.6"), count=5)
    assert not status.ok and status.retry_after is None and status.override == "limit"
    with pytest.raises(RateLimited):
        limiter.limit("heavy", ("ip", "198.51.100.6"), count=5, throws=True)
    multi = limiter.limit_many([("heavy", ("ip", "198.51.100.6"), 5), ("login", "other")])
    assert not multi.ok and limiter.get_value("login", "other") == 5  # all-or-nothing: nothing spent
    assert not async_to_sync(limiter.alimit)("heavy", ("ip", "198.51.100.6"), count=5).ok


def test_5_a_count_the_limit_itself_refuses_is_still_a_programming_error(backend):
    limiter.override("heavy", None, capacity=2)
    with pytest.raises(ValueError, match="exceeds the capacity"):
        limiter.limit("heavy", ("ip", "198.51.100.7"), count=50)


def test_5_the_command_and_the_admin_warn_of_an_override_below_a_views_count(backend, admin_client):
    assert ok(heavy(rf.get("/", REMOTE_ADDR="198.51.100.8")))
    out, err = io.StringIO(), io.StringIO()
    call_command(
        "tokenbucket", "override", "heavy", "--key", "ip=198.51.100.8", "--capacity", "2", stdout=out, stderr=err
    )
    assert "tests.test_attacks_overrides.heavy counts 5 per request, more than this override's capacity 2" in err.getvalue()
    # And which bucket it reached: the one the request above used.
    assert "It reaches the bucket ip=198.51.100.8" in out.getvalue() and "stored: requests have used it" in out.getvalue()
    response = admin_client.post(
        "/admin/django_tokenbucket/limitoverride/add/",
        {"name": "heavy", "key_text": "", "key_form": "auto", "action": "limit", "capacity": "1", "rate": "",
         "max_reserved": "", "duration": "", "expires_at_0": "", "expires_at_1": "", "reason": ""},
        follow=True,
    )
    shown = [str(m) for m in response.context["messages"]]
    assert any("heavy counts 5 per request, more than this override's capacity 1" in m for m in shown), shown
