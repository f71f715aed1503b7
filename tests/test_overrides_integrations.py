"""Runtime overrides reach every entry point (issue 30): ``@ratelimit`` on sync and async
views, the DRF throttles, the django-ratelimit compatibility layer and Celery's
``schedule()`` — each action (block, exempt, other numbers), on the database backend
and on Redis. The limiter API itself is tests/test_overrides.py's.
"""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from django.test import Client, RequestFactory, override_settings
from rest_framework.test import APIClient

from django_tokenbucket import limiter
from django_tokenbucket.compat.ratelimit.core import is_ratelimited
from django_tokenbucket.testing import frozen_clock
from django_tokenbucket.view_limits import chain_of

from . import views
from .settings import TOKENBUCKET as BASE_SETTINGS
from .test_conformance import store_overrides

T0 = 1_700_000_000.0


@pytest.fixture(params=["database", "redis"])
def backend(request, transactional_db):
    settings = {**BASE_SETTINGS, **store_overrides(request.param, request), "OVERRIDES": {"MAX_AGE": 600}}
    with override_settings(TOKENBUCKET=settings), frozen_clock(T0):
        yield request.param


def codes(send, n):
    return [send().status_code for _ in range(n)]


# -- @ratelimit ---------------------------------------------------------------------------


def login_post(client):
    return client.post("/login/", {"username": "alice"})


def test_a_block_refuses_a_decorated_view_with_the_wait_until_it_ends(backend):
    client = Client()
    assert login_post(client).status_code == 200
    limiter.block("login", ("post:username", "Alice "), until=datetime.fromtimestamp(T0 + 90, tz=UTC))
    response = login_post(client)
    assert response.status_code == 429 and response["Retry-After"] == "90"
    assert login_post(Client()).status_code == 429  # the same key from anywhere
    assert client.post("/login/", {"username": "bob"}).status_code == 200  # another key is not blocked


def test_an_exemption_lets_a_decorated_view_through_past_its_limit_and_counts_nothing(backend):
    client = Client()
    limiter.exempt("login")  # every key
    assert codes(lambda: login_post(client), 8) == [200] * 8  # "login" is 5/m
    limiter.clear_override("login")
    assert codes(lambda: login_post(client), 6) == [200] * 5 + [429]  # nothing was spent meanwhile


def test_other_numbers_apply_to_a_decorated_view(backend):
    client = Client()
    limiter.override("login", ("post:username", "alice"), capacity=2)
    assert codes(lambda: login_post(client), 3) == [200, 200, 429]


def test_an_async_view_obeys_a_block_and_an_exemption(backend):
    name = chain_of(views.async_view)[0].name  # rate="2/m", by address
    client = Client()
    assert client.get("/async/").status_code == 200
    limiter.block(name)
    assert client.get("/async/").status_code == 429
    limiter.exempt(name)  # replaces the block
    assert codes(lambda: client.get("/async/"), 4) == [200] * 4


# -- DRF throttles ------------------------------------------------------------------------


def test_the_drf_throttles_obey_other_numbers_an_exemption_and_a_block(backend):
    # The view has DRF's two default throttles: "anon" (3/m) and "user" (5/m, by address
    # for anonymous clients), decided together. The overrides below are of "anon" alone.
    api = APIClient()
    limiter.override("anon", rate="1/m")  # every address
    assert codes(lambda: api.get("/api/default/"), 2) == [200, 429]
    limiter.exempt("anon")  # replaces it: "anon" is left out, "user" still counts
    assert codes(lambda: api.get("/api/default/"), 4) == [200, 200, 200, 200]
    assert api.get("/api/default/").status_code == 429  # "user": 5 taken, the refused one took none
    limiter.block("anon")
    response = APIClient(REMOTE_ADDR="192.0.2.9").get("/api/default/")
    assert response.status_code == 429  # a fresh address, blocked all the same


# -- the django-ratelimit compatibility layer ---------------------------------------------


def test_the_compat_layer_obeys_a_block_and_an_exemption(backend):
    rf = RequestFactory()

    def limited():
        return is_ratelimited(rf.get("/"), group="g", key="ip", rate="2/m", increment=True)

    assert limited() is False  # the limit "g:2/60s" is known from here on
    limiter.block("g:2/60s")
    assert limited() is True
    limiter.exempt("g:2/60s")
    assert [limited() for _ in range(4)] == [False] * 4
    limiter.clear_override("g:2/60s")
    assert [limited() for _ in range(2)] == [False, True]  # one was spent before the block


# -- Celery's schedule() ------------------------------------------------------------------


@pytest.mark.every_database  # the reservation is a row on either store
def test_schedule_obeys_a_block_and_other_numbers(backend, monkeypatch):
    # Imported here: the Celery integration is an extra, and the rest of this file needs none.
    from django_tokenbucket.celery import publishing, schedule

    from .celery_tasks import record_effect

    monkeypatch.setattr(publishing, "_send", lambda pk, eta, options: None)
    config = {"rate": 10, "period": 3600, "max_reserved": 10}
    assert schedule(record_effect.s("first"), "hourly", "k", config=config).ok
    limiter.block("hourly", "k")
    refused = schedule(record_effect.s("blocked"), "hourly", "k", config=config)
    assert not refused.ok and refused.reservation is None and refused.status.override == "block"
    limiter.override("hourly", "k", max_reserved=0)
    full = schedule(record_effect.s("now"), "hourly", "k", config=config, count=9)
    assert full.ok and full.reservation.count == 9 * 10**6 and full.status.override == "limit"
    later = schedule(record_effect.s("later"), "hourly", "k", config=config)
    assert not later.ok  # nothing left, and the override reserves nothing ahead
