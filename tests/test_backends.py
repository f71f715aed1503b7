"""Several backends in one project: a Redis limit and a database limit side by side."""

from __future__ import annotations

import re
from io import StringIO

import pytest
from asgiref.sync import sync_to_async
from django.conf import settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections, transaction
from django.test import override_settings
from django_redis import get_redis_connection

from django_tokenbucket import LimitRequest, limiter
from django_tokenbucket.backends import get_backend
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock

from .redis_servers import delete_keys
from .test_admin import CHANGELIST, client_for, make_user

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.redis]

T0 = 1_700_000_000.0
DATABASE = "django_tokenbucket.backends.database.DatabaseBackend"
REDIS = "django_tokenbucket.backends.redis.RedisBackend"
TWO_STORES = {
    "BACKENDS": {
        "default": {"BACKEND": DATABASE},
        "fast": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "redis"}},
    },
    "LIMITS": {
        "orders": "3/m",  # billing-grade: rolls back with the order
        "api": {"rate": "3/m", "backend": "fast"},
        "api_hot": {"rate": "40/m", "backend": "fast", "shards": 4},
        "orders_hot": {"rate": "40/m", "shards": 4},
    },
}


@pytest.fixture(autouse=True)
def two_stores():
    delete_keys()
    with override_settings(TOKENBUCKET=TWO_STORES), frozen_clock(T0):
        yield
    delete_keys()


def redis_keys() -> int:
    # This process's keys only: concurrent runs share the server.
    return len(list(get_redis_connection("redis").scan_iter(match=f"{settings.REDIS_KEY_PREFIX}:*")))


def test_each_limit_is_decided_on_its_own_backend():
    assert [limiter.limit("orders", "alice").ok for _ in range(4)] == [True, True, True, False]
    assert [limiter.limit("api", "alice").ok for _ in range(4)] == [True, True, True, False]
    # The database holds the orders bucket only; Redis the api bucket only.
    assert list(RateLimit.objects.values_list("name", flat=True)) == ["orders"]
    assert redis_keys() == 1
    assert type(get_backend("fast")).__name__ == "RedisBackend" and limiter.backend().database_alias() == "default"


def test_a_rollback_takes_back_the_database_limit_only():
    with pytest.raises(RuntimeError), transaction.atomic():
        limiter.limit("orders", "bob", count=3)
        limiter.limit("api", "bob", count=3)
        raise RuntimeError("the order failed")
    assert limiter.get_value("orders", "bob") == 3  # rolled back with the order
    assert limiter.get_value("api", "bob") == 0  # Redis has no transaction to join


def test_limits_on_two_backends_are_never_decided_together():
    message = re.escape("rate limits decided together must be stored on one backend, and these are not")
    with pytest.raises(ImproperlyConfigured, match=message) as raised:
        limiter.limit_many([LimitRequest("orders", "carol"), LimitRequest("api", "carol")])
    assert "'default': 'orders'; 'fast': 'api'" in str(raised.value)
    # Refused before either store was asked: nothing spent.
    assert limiter.get_value("orders", "carol") == 3 and limiter.get_value("api", "carol") == 3
    assert limiter.limit_many([("api", "carol"), ("api_hot", "carol")]).ok


def test_an_unknown_alias_is_an_error_naming_the_limit():
    with pytest.raises(ImproperlyConfigured, match=r"no rate-limit backend 'fats'"):
        limiter.limit("typo", "k", config={"rate": "1/s", "backend": "fats"})


def run(*args: str) -> str:
    out = StringIO()
    call_command("tokenbucket", *args, stdout=out)
    return out.getvalue()


@pytest.mark.parametrize("name", ["api", "orders", "api_hot", "orders_hot"])
def test_the_command_shows_and_resets_a_key_on_its_backend(name):
    capacity = 40 if name.endswith("hot") else 3
    limiter.limit(name, "dave", count=2)
    shown = run("show", name, "dave")
    assert f"tokens now:   {capacity - 2}" in shown
    # Sharded or not, the database says whether the key has rows; Redis keeps none to count.
    assert ("stored row:   yes" in shown) == name.startswith("orders")
    assert "Reset" in run("reset", name, "dave")
    assert limiter.get_value(name, "dave") == capacity
    with pytest.raises(CommandError, match="nothing matched"):
        run("reset", name, "dave")


def test_resetting_every_key_needs_a_backend_that_lists_them():
    limiter.limit("api", "erin")
    with pytest.raises(CommandError, match=r"'api' is stored on RedisBackend; give a key"):
        run("reset", "api", "--yes")
    limiter.limit("orders", "erin")
    assert "Reset 1 key(s) of orders" in run("reset", "orders", "--yes")


@pytest.fixture
async def close_async_connections():
    yield
    # The database work of an async test ran in asgiref's thread: its connection, left
    # open there, would keep the test database from being dropped.
    await sync_to_async(connections.close_all)()


async def test_the_async_api_in_an_event_loop_on_both_stores(close_async_connections):
    # Sequential awaits in one loop; the database's in Django's thread, Redis' as well
    # until its backend has an asyncio client.
    for name in ("orders", "api"):
        statuses = [await limiter.alimit(name, "frank") for _ in range(4)]
        assert [status.ok for status in statuses] == [True, True, True, False]
        assert await limiter.aget_value(name, "frank") < 1
        await limiter.areset(name, "frank")
        assert (await limiter.acheck(name, "frank", count=3)).ok
    with pytest.raises(ImproperlyConfigured, match="must be stored on one backend"):
        await limiter.alimit_many([("orders", "frank"), ("api", "frank")])


def test_the_admin_says_which_limits_it_cannot_list():
    limiter.limit("api", "gina")
    limiter.limit("orders", "gina")
    page = client_for(make_user("root", superuser=True)).get(CHANGELIST).content.decode()
    assert "The limits on backend “fast” (RedisBackend) are not stored in this database" in page
    assert "not listed here: api, api_hot." in page and "tokenbucket show|reset NAME --key SPEC=VALUE" in page
    assert page.count('class="tb-elsewhere"') == 1  # the default alias is the database: listed


def test_check_reports_a_view_whose_throttles_span_two_backends():
    limits = {**TWO_STORES["LIMITS"], "api_burst": {"rate": "5/s", "backend": "fast"}, "api_sustained": "100/h"}
    with override_settings(TOKENBUCKET={**TWO_STORES, "LIMITS": limits}):
        errors = [m for m in run_checks() if m.id == "django_tokenbucket.E026"]
    assert len(errors) == 1, errors
    assert errors[0].msg.startswith("tests.views.BurstSustained's throttles take from limits stored on different")
    assert "'fast': 'api_burst'; 'default': 'api_sustained'" in errors[0].msg


def test_a_runtime_error_names_the_alias_setting_to_fix():
    backends = {**TWO_STORES["BACKENDS"], "fast": {"BACKEND": REDIS, "OPTIONS": {"CACHE": "ratelimt"}}}
    with override_settings(TOKENBUCKET={**TWO_STORES, "BACKENDS": backends}):
        with pytest.raises(ImproperlyConfigured, match=re.escape("TOKENBUCKET['BACKENDS']['fast']['OPTIONS']['CACHE'] = 'ratelimt'")):
            limiter.limit("api", "hank")
        assert limiter.limit("orders", "hank").ok  # the other store is unaffected
