"""Runtime overrides (issue 30): ``limiter.override``, ``exempt``, ``block`` and their
async twins, applied by every decision, seen by other processes within MAX_AGE, and
free on the decision path in steady state.

On every backend of the deny cache's suite (the database on TOKENBUCKET_TEST_DB, and
Redis), sync and async, at a pinned time; the cases across OS processes run on the real
clock with a short MAX_AGE.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from datetime import UTC, datetime, timedelta
from functools import partial
from io import StringIO
from types import SimpleNamespace

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.conf import settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.test import RequestFactory, override_settings
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from prometheus_client import REGISTRY

from django_tokenbucket import LimitRequest, deny_cache, limiter, overrides
from django_tokenbucket import waits as waits_module
from django_tokenbucket.backends import get_backend
from django_tokenbucket.cleanup import cleanup
from django_tokenbucket.keys import Redacted, encode_key
from django_tokenbucket.models import LimitOverride, OverridesVersion
from django_tokenbucket.override_operations import expire, resave
from django_tokenbucket.overrides import rows as override_rows
from django_tokenbucket.overrides import snapshot as override_snapshot
from django_tokenbucket.request_keys import request_key
from django_tokenbucket.testing import frozen_clock

from .concurrency import hammer, run_processes
from .settings import TOKENBUCKET as BASE_SETTINGS
from .test_conformance import store_overrides

T0 = 1_700_000_000.0
LIMITS = {
    "login": {"rate": 3, "period": 60},
    "burst": {"rate": 3, "period": 60, "capacity": 6},
    "reservable": {"rate": 3, "period": 60, "max_reserved": 3},
    "window": {"kind": "fixed window", "rate": 3, "period": 60, "start": 0},
    "hot": {"rate": 4, "period": 60, "shards": 2},
    "shadowed": {"rate": 3, "period": 60, "shadow": True},
    "other": {"rate": 3, "period": 60},
    "exact": {"rate": 100, "period": 3600},
}
#: Long enough that no case below waits for a refresh it does not ask for.
MAX_AGE = 600


class AsyncAPI:
    """The limiter's async twins, called as the sync methods are."""

    def __getattr__(self, name: str):
        twin = getattr(limiter, f"a{name}", None)
        return async_to_sync(twin) if twin is not None else getattr(limiter, name)


@pytest.fixture(params=["sync", "async"])
def api(request):
    return limiter if request.param == "sync" else AsyncAPI()


def _settings(backend_overrides: dict, max_age: float = MAX_AGE, **more) -> dict:
    return {**BASE_SETTINGS, **backend_overrides, "LIMITS": LIMITS, "OVERRIDES": {"MAX_AGE": max_age}, **more}


def _current(**changes) -> dict:
    """The backend fixture's settings, changed."""
    return {**settings.TOKENBUCKET, **changes}


@pytest.fixture(params=["database", "redis"])
def backend(request, transactional_db):
    with override_settings(TOKENBUCKET=_settings(store_overrides(request.param, request))):
        yield request.param


@pytest.fixture
def clock(backend):
    with frozen_clock(T0) as frozen:
        yield frozen


@pytest.fixture
def store_calls(backend, monkeypatch):
    """How many decisions reached the store: the real backend's methods, counted."""
    store = get_backend()
    calls = {"n": 0}
    for method in ("decide", "adecide") if store.asyncio_native else ("decide",):
        real = getattr(store, method)

        def counted(*args, _real=real, **kwargs):
            calls["n"] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(store, method, counted)
    return calls


def exhaust(api, name="login", key="k", tokens=3):
    for _ in range(tokens):
        assert api.limit(name, key).ok
    assert not api.limit(name, key).ok


# -- each action -------------------------------------------------------------------


def test_exempt_lets_every_call_through_and_spends_nothing(api, clock, store_calls):
    exhaust(api)
    row = api.exempt("login", "k", reason="partner launch", created_by="ops")
    assert (row.action, row.reason, row.created_by, row.label) == ("exempt", "partner launch", "ops", "k")
    calls = store_calls["n"]
    for _ in range(10):
        status = api.limit("login", "k")
        assert status.ok and status.override == "exempt"
        assert status.value is None and status.retry_after is None
    assert store_calls["n"] == calls, "an exempt call asks the store nothing"
    # Another key of the limit is not exempt.
    assert api.limit("login", "other-key").override is None
    assert api.clear_override("login", "k") == 1
    assert api.clear_override("login", "k") == 0
    # Nothing was counted while exempt: the bucket is as it was left.
    status = api.limit("login", "k")
    assert not status.ok and status.override is None
    assert api.get_value("login", "k") == 0


def test_block_refuses_until_it_expires_and_spends_nothing(api, clock, store_calls):
    api.block("login", "k", until=timedelta(seconds=90), reason="credential stuffing")
    calls = store_calls["n"]
    status = api.limit("login", "k")
    assert not status.ok and status.override == "block"
    assert status.retry_after == 90
    clock.advance(30)
    assert api.limit("login", "k").retry_after == 60
    assert api.check("login", "k").retry_after == 60
    with pytest.raises(Exception) as raised:
        api.limit("login", "k", throws=True)
    assert raised.value.retry_after == 60
    assert store_calls["n"] == calls, "a blocked call asks the store nothing"
    # Expired: ignored at once, without waiting for a refresh, and nothing was spent.
    clock.advance(60)
    status = api.limit("login", "k")
    assert status.ok and status.override is None and status.value == 2
    assert api.overrides("login") == []


def test_a_block_that_never_expires_has_no_retry_after(api, clock):
    api.block("login", "k")
    status = api.limit("login", "k")
    assert not status.ok and status.retry_after is None and status.override == "block"
    clock.advance(10 * 365 * 86400)
    assert not api.limit("login", "k").ok


def test_limit_replaces_the_numbers_given_and_reinterprets_the_bucket(api, clock):
    exhaust(api)
    # The capacity equals the rate in LIMITS, so it follows the new rate.
    api.override("login", "k", rate="10/m")
    status = api.check("login", "k")
    assert status.override == "limit" and (status.capacity, status.rate, status.period) == (10, 10, 60)
    # The bucket is the same one, reinterpreted: empty, and refilling at 10 a minute.
    assert status.value == 0 and status.retry_after == 6
    clock.advance(60)
    for _ in range(10):
        assert api.limit("login", "k").ok
    denied = api.limit("login", "k")
    assert not denied.ok and denied.override == "limit"
    # Another key keeps the limit's own numbers.
    assert api.check("login", "other").capacity == 3
    assert api.clear_override("login", "k") == 1
    assert api.check("login", "k").capacity == 3


def test_limit_keeps_a_capacity_set_apart_and_takes_each_number(api, clock):
    api.override("burst", "k", rate=30)
    status = api.check("burst", "k")
    assert (status.rate, status.period, status.capacity) == (30, 60, 6)
    api.override("burst", "k", capacity=50, period=timedelta(minutes=2))
    status = api.check("burst", "k")
    assert (status.rate, status.period, status.capacity) == (3, 120, 50)
    # A count the limit's own capacity refuses is within the override's.
    assert api.limit("burst", "k", count=40).ok
    api.override("reservable", "k", max_reserved=30)
    assert api.limit("reservable", "k", count=20, reserve=True).ok


def test_every_action_on_a_fixed_window_and_a_sharded_limit(api, clock):
    api.override("window", "k", rate=5)
    assert sum(api.limit("window", "k").ok for _ in range(8)) == 5
    api.block("hot", "k")
    assert not api.limit("hot", "k").ok
    api.exempt("hot", "k")
    assert all(api.limit("hot", "k").ok for _ in range(10))
    api.override("hot", "k", rate=8)
    # Two shards of 4 each; a call takes from two random ones, so the last tokens of a
    # shard may go unused (shards.py): between one shard's worth and all of them.
    assert 4 <= sum(api.limit("hot", "k").ok for _ in range(12)) <= 8
    assert api.check("hot", "k").capacity == 8


def test_a_block_on_a_shadow_limit_refuses_nothing(api, clock):
    api.block("shadowed", "k")
    status = api.limit("shadowed", "k")
    assert status.ok and status.would_deny and status.override == "block"


def test_get_status_reads_the_bucket_and_says_which_override_applies(api, clock):
    exhaust(api)
    api.block("login", "k", until=timedelta(seconds=5))
    status = api.get_status("login", "k")
    assert (status.ok, status.value, status.retry_after, status.override) == (False, 0, 5, "block")
    api.exempt("login", "k")
    status = api.get_status("login", "k")
    assert (status.ok, status.value, status.override) == (True, 0, "exempt")


def test_acquire_and_reserve_use_the_overridden_numbers(api, clock):
    api.override("reservable", "k", rate=60, max_reserved=60)
    status = api.acquire("reservable", "k", count=60, timeout=120)
    assert status.ok and status.override == "limit"
    api.exempt("reservable", "k")
    assert api.acquire("reservable", "k", count=3).override == "exempt"
    api.block("reservable", "k", until=timedelta(seconds=7))
    with pytest.raises(Exception) as raised:
        api.acquire("reservable", "k")
    assert raised.value.retry_after == 7


def test_an_acquire_timeout_bounds_an_overridden_max_reserved(clock, monkeypatch):
    limiter.override("reservable", "k", max_reserved=1000)
    # The limiter's wait is recorded rather than slept (tests/test_acquire.py sleeps for
    # real): the clock is pinned, so the second call finds the same debt either way, and a
    # minute less per backend and env.
    waits: list[float] = []
    monkeypatch.setattr(waits_module, "time", SimpleNamespace(sleep=waits.append))
    # 3/min: a timeout of 60 s repays at most 3 tokens of debt, whatever the override allows.
    assert limiter.acquire("reservable", "k", count=6, timeout=60).ok
    assert waits == [pytest.approx(60)]
    with pytest.raises(Exception):
        limiter.acquire("reservable", "k", count=6, timeout=60)
    assert len(waits) == 1


def test_limit_many_a_block_refuses_the_whole_call_and_an_exemption_takes_no_part(api, clock, store_calls):
    api.block("login", "k")
    calls = store_calls["n"]
    result = api.limit_many([LimitRequest("login", "k"), LimitRequest("other", "k")])
    assert not result.ok and store_calls["n"] == calls
    assert [s.override for s in result] == ["block", None]
    assert api.get_value("other", "k") == 3, "the other limit spent nothing"
    api.exempt("login", "k")
    result = api.limit_many([LimitRequest("login", "k"), LimitRequest("other", "k")])
    assert result.ok and [s.override for s in result] == ["exempt", None]
    assert api.get_value("other", "k") == 2
    api.override("login", "k", rate=5)
    result = api.limit_many([LimitRequest("login", "k"), LimitRequest("other", "k")])
    assert result.ok and [(s.override, s.value) for s in result] == [("limit", 4), (None, 1)]


# -- precedence, keys, expiry ----------------------------------------------------------


def test_a_key_override_wins_over_the_limit_wide_one(api, clock):
    api.block("login", until=timedelta(minutes=5), reason="incident")
    api.exempt("login", "partner")
    api.override("login", "tenant", rate=6)
    assert api.limit("login", "someone").override == "block"
    assert api.limit("login", "partner").override == "exempt"
    status = api.limit("login", "tenant")
    assert status.ok and status.override == "limit" and status.capacity == 6
    # A key's override that expired falls back to the limit's.
    api.exempt("login", "brief", until=timedelta(seconds=10))
    clock.advance(11)
    assert api.limit("login", "brief").override == "block"
    rows = api.overrides("login")
    assert sorted((row.label, row.action) for row in rows) == [("", "block"), ("partner", "exempt"), ("tenant", "limit")]
    assert {row.every_key for row in rows} == {True, False}
    assert len(api.overrides()) == 3
    assert api.clear_override("login") == 1
    assert api.limit("login", "someone").override is None


def test_an_override_replaces_the_previous_one_of_its_key(api, clock):
    api.block("login", "k")
    api.exempt("login", "k", until=timedelta(hours=1))
    assert LimitOverride.objects.filter(name="login").count() == 1
    assert api.limit("login", "k").override == "exempt"


def test_a_request_data_key_is_normalised_as_the_decorator_does(api, clock):
    """An override for "Alice@Example.com " reaches the bucket that the login attempts
    of alice@example.com use, and shows no value in its label."""
    row = api.block("login", ("post:username", "Alice@Example.com "))
    assert "alice" not in row.label.lower()
    request = RequestFactory().post("/login/", {"username": "ALICE@example.com"})
    key = request_key(request, "post:username")
    assert key == ("post:username", Redacted("alice@example.com"))
    assert api.limit("login", key).override == "block"
    assert api.limit("login", ("post:username", "bob@example.com")).override is None
    # Ints and their digits are one key, as for buckets.
    api.exempt("login", ("user", 42))
    assert api.limit("login", ("user", "42")).override == "exempt"


def test_until_takes_a_datetime_and_a_naive_one_is_in_the_current_timezone(api, clock):
    ends = datetime.fromtimestamp(T0 + 100, tz=UTC)
    api.block("login", "k", until=ends)
    assert api.limit("login", "k").retry_after == 100
    api.block("login", "j", until=timezone.make_naive(ends + timedelta(seconds=20)))
    assert api.limit("login", "j").retry_after == 120


class Rollback(Exception):
    pass


@pytest.mark.every_database  # the override rows in a rolled-back transaction, on either store
def test_a_change_inside_a_transaction_applies_at_once_and_not_after_its_rollback(api, clock):
    with pytest.raises(Rollback), transaction.atomic():
        limiter.block("login", "k")
        assert api.limit("login", "k").override == "block"
        raise Rollback
    assert api.limit("login", "k").override is None
    with transaction.atomic():
        limiter.exempt("login", "k")
        with pytest.raises(Rollback), transaction.atomic():  # a savepoint rolled back
            limiter.block("login", "k")
            raise Rollback
        assert api.limit("login", "k").override == "exempt"
    assert api.limit("login", "k").override == "exempt"



def test_an_edit_goes_through_the_checks_of_a_new_override(clock):
    # resave (the admin's change form, "expire now") writes through overrides.make: its checks,
    # the version stamp bumped.
    row = limiter.block("login", "k", reason="abuse")
    with pytest.raises(ValueError, match="rate limit 'login': reason must be a str"):
        resave(row, reason=None)
    revision = OverridesVersion.objects.get().revision
    assert expire(row) and OverridesVersion.objects.get().revision == revision + 1
    assert limiter.limit("login", "k").override is None
    row.refresh_from_db()
    assert row.reason == "abuse" and not expire(row)  # ended already: nothing written

# -- bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (lambda: limiter.block("nope", "k"), ImproperlyConfigured, "'nope'"),
        (lambda: limiter.override("login", "k", rate="ten/m"), ValueError, "'login'"),
        (lambda: limiter.override("login", "k", rate=0), ValueError, "rate must be positive"),
        (lambda: limiter.override("login", "k", rate="5/m", period=60), ValueError, "not both"),
        (lambda: limiter.override("login", "k"), ValueError, "at least one of"),
        (lambda: limiter.override("login", "k", capacity=0.5), ValueError, "could never admit"),
        (lambda: limiter.override("login", "k", capacity=-1), ValueError, "capacity must be positive"),
        (lambda: limiter.override("login", "k", max_reserved=-1), ValueError, "max_reserved"),
        (lambda: limiter.override("hot", "k", rate=0.000003), ValueError, "shards"),
        (lambda: limiter.block("login", "k", until=timedelta(seconds=-1)), ValueError, "not in the future"),
        (lambda: limiter.block("login", "k", until=timedelta(0)), ValueError, "not in the future"),
        (lambda: limiter.block("login", "k", until=60), ValueError, "datetime or a timedelta"),
        (lambda: limiter.exempt("login", 1.5), ValueError, "'login'"),
        (lambda: limiter.exempt("login", "k", reason=None), ValueError, "reason"),
        (lambda: limiter.exempt("login", "k", created_by="x" * 151), ValueError, "created_by"),
        (lambda: limiter.exempt("login", "k", rate=5), TypeError, "rate"),
        # Past what a datetime or a limit holds: refused in words, never an OverflowError.
        (lambda: limiter.override("login", "k", period=timedelta.max), ValueError, "period"),
        (lambda: limiter.override("login", "k", rate=1, period=1e300), ValueError, "period is too large"),
        (lambda: limiter.override("login", "k", rate="1/99999999999999999999d"), ValueError, "period"),
        (lambda: limiter.block("login", "k", until=timedelta.max), ValueError, "more than 100 years"),
        (lambda: limiter.block("login", "k", until=datetime.max), ValueError, "more than 100 years"),
        (lambda: overrides.make("login", "k", "allow"), ValueError, "not an override's action"),
    ],
)
def test_bad_input_is_a_clear_error_naming_the_limit(clock, call, error, words):
    with pytest.raises(error) as raised:
        call()
    message = str(raised.value)
    assert words in message
    if error is not TypeError:  # (a keyword exempt() does not take: Python's own message)
        assert any(f"{name!r}" in message for name in ("login", "hot", "nope")), message
    assert not LimitOverride.objects.exists()


def test_overrides_off_refuses_to_make_one(backend):
    with override_settings(TOKENBUCKET=_current(OVERRIDES=False)):
        with pytest.raises(ImproperlyConfigured, match="overrides are off"):
            limiter.block("login", "k")


def test_checks_reject_a_bad_setting():
    for value, words in [
        ("yes", "must be False or a dict"),
        ({"MAX_AGE": 0}, "MAX_AGE"),
        ({"TTL": 1}, "'TTL'"),
        ({"KEEP_EXPIRED": -1}, "KEEP_EXPIRED"),
        ({"KEEP_EXPIRED": "30d"}, "KEEP_EXPIRED"),
        ({"KEEP_EXPIRED": 10**12}, "100 years"),
    ]:
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, "OVERRIDES": value}):
            errors = [m for m in run_checks() if m.id == "django_tokenbucket.E052"]
            assert len(errors) == 1 and words in errors[0].msg, (value, errors)
            with pytest.raises(ImproperlyConfigured, match="OVERRIDES"):
                overrides.active()
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "OVERRIDES": False}):
        assert [m for m in run_checks() if m.id == "django_tokenbucket.E052"] == []


def test_cleanup_deletes_the_overrides_expired_longer_ago_than_keep_expired(transactional_db):
    """A table of temporary blocks must not only grow; an expired override stays for the
    admin's history for KEEP_EXPIRED, and its deletion changes no decision."""
    kept_an_hour = {**BASE_SETTINGS, "LIMITS": LIMITS, "OVERRIDES": {"MAX_AGE": MAX_AGE, "KEEP_EXPIRED": 3600}}
    with override_settings(TOKENBUCKET=kept_an_hour), frozen_clock(T0) as clock:
        limiter.block("login", "old", until=timedelta(seconds=10), reason="last month's incident")
        limiter.block("other", "old", until=timedelta(seconds=10))
        limiter.exempt("login", "recent", until=timedelta(seconds=3000))
        limiter.block("login", "forever")
        clock.advance(3700)  # "old" expired 3,690 s ago, "recent" 700 s ago
        assert limiter.limit("login", "old").override is None
        assert cleanup(names=["login"], dry_run=True).overrides_removed == 1
        assert LimitOverride.objects.count() == 4
        report = cleanup(names=["login"])
        assert report.overrides_removed == 1 and report.as_dict()["overrides_removed"] == 1
        assert sorted(LimitOverride.objects.values_list("name", "label")) == [
            ("login", "forever"),
            ("login", "recent"),
            ("other", "old"),
        ]
        out = StringIO()
        call_command("tokenbucket", "cleanup", stdout=out)
        assert "Deleted 1 override(s) expired longer ago than OVERRIDES['KEEP_EXPIRED']" in out.getvalue()
        assert limiter.limit("login", "forever").override == "block"
        assert limiter.limit("login", "old").ok and limiter.limit("login", "old").override is None

    for setting in ({"MAX_AGE": MAX_AGE, "KEEP_EXPIRED": None}, False):
        with override_settings(TOKENBUCKET={**kept_an_hour, "OVERRIDES": setting}), frozen_clock(T0 + 10**8):
            assert cleanup().overrides_removed == 0
    assert LimitOverride.objects.count() == 2


def test_exempt_and_blocked_calls_are_counted_by_their_outcome(backend, clock):
    def count(outcome):
        labels = {"limit": "login", "backend": "default", "outcome": outcome}
        return REGISTRY.get_sample_value("tokenbucket_decisions_total", labels) or 0.0

    with override_settings(TOKENBUCKET=_current(METRICS="prometheus")):
        before = {outcome: count(outcome) for outcome in ("exempt", "blocked", "allowed")}
        limiter.exempt("login", "k")
        limiter.limit("login", "k")
        limiter.check("login", "k")  # not applied: not counted
        limiter.block("login", "k")
        limiter.limit("login", "k")
        limiter.limit("login", "k")
        after = {outcome: count(outcome) for outcome in before}
    assert {outcome: after[outcome] - before[outcome] for outcome in before} == {
        "exempt": 1,
        "blocked": 2,
        "allowed": 0,
    }


# -- the deny cache ----------------------------------------------------------------


def test_a_remembered_denial_hides_no_override(api, clock, store_calls):
    exhaust(api)
    assert api.limit("login", "k").cached
    api.exempt("login", "k")
    assert api.limit("login", "k").ok
    api.clear_override("login", "k")
    assert not api.limit("login", "k").ok
    assert api.limit("login", "k").cached
    # A raised rate is not hidden by the denial remembered under the old one.
    api.override("login", "k", rate=3, capacity=5)
    status = api.limit("login", "k")
    assert not status.cached and status.override == "limit"
    # Nor is a change to every key of the limit.
    exhaust(api, key="j")
    assert api.limit("login", "j").cached
    api.override("login", capacity=10)
    assert not api.limit("login", "j").cached


def test_a_block_or_an_exemption_is_never_remembered(api, clock):
    api.block("login", "k")
    for _ in range(3):
        assert not api.limit("login", "k").cached
    assert deny_cache.size() == 0
    api.clear_override("login", "k")
    assert api.limit("login", "k").ok


def test_a_denial_under_an_override_is_remembered_under_its_numbers(api, clock, store_calls):
    api.override("login", "k", rate=5)
    exhaust(api, tokens=5)
    calls = store_calls["n"]
    status = api.limit("login", "k")
    assert status.cached and status.override == "limit" and store_calls["n"] == calls


# -- seen everywhere, for free -------------------------------------------------------


@pytest.mark.every_database  # the overrides' queries, connections and forks, on either store
def test_steady_state_decisions_make_no_extra_query(backend, clock):
    limiter.block("other", "someone")
    limiter.override("login", "tenant", rate=30)
    limiter.limit("login", "warm")  # reads the overrides once

    def queries(key):
        with CaptureQueriesContext(connection) as captured:
            for _ in range(3):
                limiter.limit("login", key)
                async_to_sync(limiter.alimit)("login", key)
        return [q["sql"] for q in captured.captured_queries]

    for key in ("plain", "tenant"):
        sql = queries(key)
        assert not [q for q in sql if "override" in q.lower()], sql
        if backend == "redis":
            assert sql == [], "a Redis decision touches no database"
    with CaptureQueriesContext(connection) as captured:
        limiter.limit("other", "someone")
    assert captured.captured_queries == [], "a blocked call asks no store"


@pytest.mark.every_database  # the overrides' queries, connections and forks, on either store
def test_a_refresh_is_one_query_of_the_stamp_while_nothing_changed(backend, clock):
    with override_settings(TOKENBUCKET=_current(OVERRIDES={"MAX_AGE": 0.2})):
        limiter.block("other", "someone")
        limiter.limit("login", "k")
        time.sleep(0.25)
        with CaptureQueriesContext(connection) as captured:
            limiter.limit("login", "k")
            limiter.limit("login", "k")
        sql = [q["sql"] for q in captured.captured_queries if "override" in q["sql"].lower()]
        assert len(sql) == 1 and "overridesversion" in sql[0].lower(), sql


@pytest.mark.every_database  # the overrides' queries, connections and forks, on either store
def test_a_failed_read_keeps_the_overrides_held(backend, clock, monkeypatch, caplog):
    limiter.block("login", "k")
    assert limiter.limit("login", "k").override == "block"

    def broken():
        raise RuntimeError("database down")

    monkeypatch.setattr(override_snapshot, "_read", broken)
    overrides.invalidate()
    with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
        assert limiter.limit("login", "k").override == "block"
        assert async_to_sync(limiter.alimit)("login", "j").ok
    assert "could not be read" in caplog.text


def _change_in_another_process(conn, action):
    conn.recv()
    if action == "limit":
        limiter.override("login", "shared", rate=100)
    else:
        getattr(limiter, action)("login", "shared")
    connections.close_all()
    conn.send("done")


@pytest.mark.every_database  # the overrides' queries, connections and forks, on either store
@pytest.mark.parametrize("action", ["block", "exempt", "limit"])
def test_a_change_in_another_process_is_seen_within_max_age(backend, action):
    max_age = 0.5
    expected = {"block": "block", "exempt": "exempt", "limit": "limit"}[action]
    with override_settings(TOKENBUCKET=_current(OVERRIDES={"MAX_AGE": max_age})):
        assert limiter.limit("login", "shared").override is None  # reads the (empty) overrides
        connections.close_all()
        context = multiprocessing.get_context("fork")
        parent, child = context.Pipe()
        process = context.Process(target=_change_in_another_process, args=(child, action))
        process.start()
        parent.send("go")
        assert parent.poll(60), "the other process did not answer"
        assert parent.recv() == "done"
        changed = time.monotonic()
        process.join(30)
        assert process.exitcode == 0
        while limiter.check("login", "shared").override != expected:
            assert time.monotonic() - changed < max_age + 0.5, "not seen within MAX_AGE"
            time.sleep(0.02)
        assert async_to_sync(limiter.acheck)("login", "shared").override == expected


def _report_override(conn):
    conn.send(limiter.check("login", "k").override)
    connections.close_all()


@pytest.mark.every_database  # the overrides' queries, connections and forks, on either store
def test_a_forked_child_reads_the_overrides_again(backend, clock):
    assert limiter.check("login", "k").override is None  # this process has read them
    # Written behind this process' back, as another process would.
    with transaction.atomic():
        revision = override_rows.bump(overrides.database_alias())
        LimitOverride.objects.create(name="login", key=encode_key("k").digest, action="block", revision=revision)
    assert limiter.check("login", "k").override is None, "MAX_AGE is not over here"
    connections.close_all()
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_report_override, args=(child,))
    process.start()
    assert parent.poll(60)
    assert parent.recv() == "block"
    process.join(30)
    assert process.exitcode == 0


def _areport_override(connection):
    # The asyncio path reads the overrides through sync_to_async's worker thread.
    status = asyncio.run(limiter.acheck("login", "k"))
    connection.send(status.override)
    connections.close_all()


@pytest.mark.every_database  # the overrides' queries, connections and forks, on either store
def test_a_forked_child_reads_the_overrides_on_the_asyncio_path_too(backend, clock):
    """The parent has used sync_to_async's one worker thread, which a fork does not copy:
    the child's first async decision must not wait for it for ever."""
    limiter.block("login", "k")
    assert async_to_sync(limiter.acheck)("login", "k").override == "block"  # reads in that thread
    overrides.invalidate()
    asyncio.run(overrides.arefresh_if_due())  # outside async_to_sync: in sync_to_async's own thread
    # That thread's connection, or the test database could not be dropped at the end.
    asyncio.run(sync_to_async(connections.close_all)())
    connections.close_all()
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_areport_override, args=(child,))
    process.start()
    try:
        assert parent.poll(30), "the child's first async decision hung"
        assert parent.recv() == "block"
    finally:
        process.join(30)
        if process.is_alive():
            process.kill()
    assert process.exitcode == 0


@pytest.mark.every_database  # the overrides' queries, connections and forks, on either store
def test_an_override_in_force_admits_exactly_its_numbers_across_processes(backend):
    """8 processes × 30 calls against a limit of 100 an override lowers to 37: exactly 37."""
    with frozen_clock(T0):
        limiter.override("exact", "hot", capacity=37)
        limiter.override("exact", capacity=1000)  # the key's own wins
        call = partial(limiter.limit, "exact", "hot")
        results = run_processes(hammer, 8, call, 30, None)
        assert sum(r["admitted"] for r in results) == 37
        assert not [e for r in results for e in r["errors"]]
        assert limiter.get_status("exact", "hot").value == 0


@pytest.mark.every_database  # the overrides' queries, connections and forks, on either store
def test_an_exemption_in_force_counts_nothing_across_processes(backend):
    with frozen_clock(T0):
        limiter.exempt("exact", "hot")
        call = partial(limiter.limit, "exact", "hot")
        results = run_processes(hammer, 4, call, 20, None)
        assert sum(r["admitted"] for r in results) == 80
        limiter.clear_override("exact", "hot")
        assert limiter.get_value("exact", "hot") == 100


def test_a_flush_of_the_tables_ends_the_overrides_held_at_once(backend, clock):
    """Issue 46: ``TransactionTestCase`` flushes the tables after each test (as does
    ``manage.py flush``): an override made before is gone from the database, and this
    process must not keep applying it for MAX_AGE (600 s here; 5 s by default)."""
    limiter.block("login", "k")
    assert not limiter.limit("login", "k").ok
    call_command("flush", interactive=False, verbosity=0)
    status = limiter.limit("login", "k")
    assert status.ok and status.override is None
