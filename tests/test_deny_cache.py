"""The deny cache (issue 35): a key the store denied is answered from this process'
memory until min(retry_after, MAX_AGE), and nothing else is.

On every backend of the conformance suite, sync and async. The limiter's clock is pinned
(the cache follows a pinned clock as the stores do), so cached answers can be compared
with the store's exactly; the cases across OS processes run on the real clocks. Store
calls are counted by wrapping the real backend's methods, which still do the work.
"""

from __future__ import annotations

import io
import multiprocessing
import random
import time
import tracemalloc

import pytest
from asgiref.sync import async_to_sync
from django.conf import settings
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.db import connections, transaction
from django.test import override_settings
from django.urls import reverse

from django_tokenbucket import LimitRequest, deny_cache, limiter, operations
from django_tokenbucket.algorithms import MICRO, Decision
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.base import Outcome, Request, decide_all
from django_tokenbucket.keys import encode_key
from django_tokenbucket.testing import frozen_clock

from .concurrency import in_another_thread
from .settings import TOKENBUCKET as BASE_SETTINGS
from .test_conformance import BACKENDS, store_overrides

T0 = 1_700_000_000.0
LIMITS = {
    "login": {"rate": 3, "period": 60},
    "window": {"kind": "fixed window", "rate": 3, "period": 60, "start": 0},
    "unlock": {"rate": 3, "period": 60, "deny_cache": False},
    "shadowed": {"rate": 3, "period": 60, "shadow": True},
    "hot": {"rate": 4, "period": 60, "shards": 2},
    "daily": {"rate": 100, "period": 86400},
    "slow": {"rate": 1, "period": 3600},
}
#: Long enough for the pinned clock's steps below (the cross-process case sets its own).
MAX_AGE = 720


class AsyncAPI:
    """The limiter's async twins, called as the sync methods are."""

    def __getattr__(self, name: str):
        twin = getattr(limiter, f"a{name}", None)
        return async_to_sync(twin) if twin is not None else getattr(limiter, name)


@pytest.fixture(params=["sync", "async"])
def api(request):
    return limiter if request.param == "sync" else AsyncAPI()


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, transactional_db):
    overrides = store_overrides(request.param, request)
    settings_dict = {**BASE_SETTINGS, **overrides, "LIMITS": LIMITS, "DENY_CACHE": {"MAX_AGE": MAX_AGE}}
    with override_settings(TOKENBUCKET=settings_dict):
        yield request.param


@pytest.fixture
def clock(backend):
    with frozen_clock(T0) as frozen:
        yield frozen


@pytest.fixture
def store_calls(backend, monkeypatch):
    """How many decisions reached the store: the real backend's methods, counted."""
    return counted_store_calls(monkeypatch)


def counted_store_calls(monkeypatch) -> dict:
    store = get_backend()
    calls = {"n": 0}
    # A backend without an asyncio client runs ``decide`` in a thread for ``adecide``.
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
    denied = api.limit(name, key)
    assert not denied.ok and not denied.cached
    return denied


def fields(status):
    return (status.ok, status.value, status.retry_after, status.reset_after, status.timestamp, status.count)


def test_a_denied_key_is_answered_from_memory_as_the_store_would(api, clock, store_calls):
    exhaust(api)
    clock.advance(7.25)
    before = store_calls["n"]
    cached = api.limit("login", "k")
    assert store_calls["n"] == before  # the store was not asked
    assert cached.cached and not cached.ok
    deny_cache.clear()
    stored = api.check("login", "k")
    assert not stored.cached
    # value to the micro-token the refill rounds (a millionth of a token); waits exactly
    assert cached.value == pytest.approx(stored.value, abs=1e-6)
    assert cached.retry_after == stored.retry_after
    assert cached.reset_after == stored.reset_after
    assert cached.timestamp == stored.timestamp


def test_memory_never_admits_and_ends_when_the_call_would_succeed(api, clock, store_calls):
    denied = exhaust(api)
    # "login" gains a micro-token every 20 µs: memory answers a pinned clock at those steps
    # only, where its figures are exact (test_a_pinned_clock_is_answered_exactly_or_not_at_all).
    clock.advance(denied.retry_after - 20e-6)
    assert api.limit("login", "k").cached
    clock.advance(20e-6)
    before = store_calls["n"]
    status = api.limit("login", "k")
    assert status.ok and not status.cached and store_calls["n"] == before + 1


def test_an_entry_ends_at_max_age(api, clock, store_calls):
    exhaust(api, "slow", tokens=1)  # a wait of an hour
    clock.advance(MAX_AGE - 0.0036)  # a micro-token every 3.6 ms
    assert api.limit("slow", "k").cached
    clock.advance(0.0036)
    before = store_calls["n"]
    status = api.limit("slow", "k")
    assert not status.ok and not status.cached and store_calls["n"] == before + 1
    assert api.limit("slow", "k").cached  # learnt again


def test_a_pinned_clock_is_answered_exactly_or_not_at_all(api, clock, store_calls):
    exhaust(api)
    clock.advance(1e-6)  # a twentieth of a micro-token: the store's rounding cannot be known
    before = store_calls["n"]
    status = api.limit("login", "k")
    assert not status.cached and store_calls["n"] == before + 1
    clock.advance(20e-6)  # a whole micro-token after the denial just learnt again
    assert api.limit("login", "k").cached


def test_a_smaller_count_or_a_reservation_goes_to_the_store(api, clock, store_calls):
    for _ in range(2):
        assert api.limit("login", "k").ok
    assert not api.limit("login", "k", count=2).ok  # one token left: 2 are denied
    before = store_calls["n"]
    assert api.limit("login", "k", count=3).cached  # a larger count: from memory
    assert store_calls["n"] == before
    smaller = api.limit("login", "k", count=1)
    assert smaller.ok and not smaller.cached and store_calls["n"] == before + 1
    reserved = api.limit("login", "k", count=2, reserve=True)
    assert reserved.ok and not reserved.cached


def test_a_larger_count_waits_as_the_store_says_within_a_microsecond(api, clock):
    for _ in range(3):
        assert api.limit("login", "k").ok
    assert not api.limit("login", "k").ok
    clock.advance(1.5)
    cached = api.check("login", "k", count=2)
    deny_cache.clear()
    stored = api.check("login", "k", count=2)
    assert cached.cached and not stored.cached
    assert stored.retry_after <= cached.retry_after <= stored.retry_after + 1e-6


def test_fixed_windows_are_cached_until_the_window_that_admits(api, clock):
    clock.set(6_000_000_000.0)  # a window start (start=0, 60 s windows)
    exhaust(api, "window")
    clock.advance(30)
    cached = api.limit("window", "k")
    assert cached.cached and cached.value == 0 and cached.retry_after == pytest.approx(30)
    clock.advance(30)
    assert api.limit("window", "k").ok


def test_shadow_sharded_and_opted_out_limits_are_never_cached(api, clock, store_calls):
    exhaust(api, "unlock")
    assert not api.limit("unlock", "k").cached
    for _ in range(4):
        api.limit("shadowed", "k")
    assert not api.limit("shadowed", "k").cached
    for _ in range(6):
        api.limit("hot", "k")
    assert not api.limit("hot", "k").cached
    assert deny_cache.size() == 0


def test_the_setting_false_turns_it_off(api, clock):
    with override_settings(TOKENBUCKET={**_current(), "DENY_CACHE": False}):
        exhaust(api)
        assert not api.limit("login", "k").cached
        assert deny_cache.size() == 0


@pytest.mark.parametrize("how", ["reset", "refund", "refund_encoded"])
def test_a_reset_or_refund_here_is_seen_at_once(api, clock, store_calls, how):
    exhaust(api)
    assert api.limit("login", "k").cached
    if how == "reset":
        api.reset("login", "k")
    elif how == "refund":
        api.refund("login", "k", 1)
    else:
        # What the Celery reservations call to give tokens back.
        limiter.refund_encoded(limiter.resolve("login"), encode_key("k"), MICRO, "k")
    status = api.limit("login", "k")
    assert status.ok and not status.cached


def test_a_config_change_misses(api, clock):
    exhaust(api)
    assert api.limit("login", "k").cached
    # The same config given inline is the same limit...
    assert api.limit("login", "k", config={"rate": 3, "period": 60}).cached
    # ...another one is not.
    with override_settings(TOKENBUCKET={**_current(), "LIMITS": {**LIMITS, "login": {"rate": 30, "period": 60}}}):
        # The bucket's state read under the new config: the store decides (and here denies).
        status = api.limit("login", "k")
        assert not status.cached and status.retry_after == 2.0


def _current() -> dict:
    return dict(settings.TOKENBUCKET)


def test_limit_many_is_denied_from_memory_and_spends_nothing(api, clock, store_calls):
    exhaust(api)
    before = store_calls["n"]
    result = api.limit_many([LimitRequest("daily", "k"), LimitRequest("login", "k")])
    assert store_calls["n"] == before
    assert not result.ok
    assert [s.cached for s in result] == [False, True]
    assert result[0].ok and result[0].value is None  # not asked
    deny_cache.clear()
    assert api.get_value("daily", "k") == 100  # nothing was spent


def test_limit_many_remembers_its_denials_but_not_a_key_asked_twice(api, clock):
    for _ in range(2):
        assert api.limit("login", "k").ok
    # One token left: each half alone is allowed, the pair is denied by the call itself.
    twice = api.limit_many([("login", "k", 1), ("login", "k", 1)])
    assert not twice.ok
    assert deny_cache.size() == 0
    assert api.limit("login", "k").ok
    result = api.limit_many([("daily", "k"), ("login", "k")])
    assert not result.ok and not result[1].cached
    assert api.limit_many([("daily", "k"), ("login", "k")])[1].cached


def test_replayed_traces_match_the_store(api, backend, clock):
    """Random calls on one key, each compared with the reference arithmetic
    (``decide_all`` on a model of the bucket), cached or not."""
    rng = random.Random(f"{backend}-{api.__class__.__name__}")
    for name in ("login", "window"):
        deny_cache.clear()
        limit = limiter.resolve(name)
        key = encode_key(f"trace-{name}")
        clock.set(T0 + rng.randrange(0, 60))
        model = {}
        cached = 0
        for step in range(80):
            clock.advance(rng.choice([0, 0.001, 0.37, 1.5, 7, 20.000001, 20.00002]))
            count = rng.choice([1, 1, 2, 3])
            apply = rng.random() < 0.8
            now = round(clock.now * MICRO)
            request = Request(limit, key, count * MICRO)
            [expected], writes = decide_all([request], {(name, key.digest): model.get((name, key.digest))}, now)
            status = (api.limit if apply else api.check)(name, f"trace-{name}", count)
            cached += status.cached
            assert status.ok == expected.allowed, (step, status, expected)
            assert status.value == pytest.approx(expected.value / MICRO, abs=1.5e-6), (step, status, expected)
            want = None if expected.retry_after is None else expected.retry_after / MICRO
            if status.cached:
                assert want - 1e-9 <= status.retry_after <= want + 1.5e-6, (step, status, expected)
            else:
                assert status.retry_after == want, (step, status, expected)
            assert status.reset_after == expected.full_after / MICRO, (step, status, expected)
            if apply:
                model.update(writes)
        assert cached > 5, f"{name}: only {cached} answers came from memory"


def test_admin_set_tokens_and_command_reset_forget_the_key(backend, clock):
    exhaust(limiter)
    assert limiter.limit("login", "k").cached
    call_command("tokenbucket", "reset", "login", "k", stdout=_Null())
    assert limiter.limit("login", "k").ok
    exhaust(limiter, tokens=2)
    assert limiter.limit("login", "k").cached
    digest = encode_key("k").digest
    # The layer the admin's actions and views go through.
    store = get_backend()
    if store.keeps_rows:
        operations.set_tokens(store, limiter.resolve("login"), digest, 2 * MICRO)
    else:
        operations.reset_buckets(store, "login", [digest])
    assert limiter.limit("login", "k").ok


class _Null:
    def write(self, text: str) -> None:
        pass


def test_an_override_of_the_setting_forgets_everything(backend, clock):
    exhaust(limiter)
    assert deny_cache.size() == 1
    with override_settings(TOKENBUCKET=_current()):
        assert deny_cache.size() == 0


def test_memory_is_bounded_under_key_rotation(backend, clock):
    with override_settings(TOKENBUCKET={**_current(), "DENY_CACHE": {"MAX_KEYS": 5}}):
        for n in range(12):
            exhaust(limiter, key=f"rotating-{n}")
            assert deny_cache.size() == min(n + 1, 5)
        # the oldest went first; the newest are answered from memory
        assert not limiter.check("login", "rotating-0").cached
        assert limiter.check("login", "rotating-11").cached


def _reset_in_another_process(connection):
    connection.recv()
    limiter.reset("login", "shared")
    connections.close_all()
    connection.send("done")


@pytest.mark.parametrize("backend", ["database", "redis"], indirect=True)
def test_a_reset_in_another_process_is_seen_within_max_age(backend):
    max_age = 2.5
    current = {**_current(), "DENY_CACHE": {"MAX_AGE": max_age}}
    with override_settings(TOKENBUCKET=current):
        learnt = time.monotonic()
        exhaust(limiter, key="shared")
        connections.close_all()
        parent, child = multiprocessing.get_context("fork").Pipe()
        process = multiprocessing.get_context("fork").Process(target=_reset_in_another_process, args=(child,))
        process.start()
        parent.send("reset")
        assert parent.poll(60), "the other process did not reset"
        assert parent.recv() == "done"
        process.join(30)
        assert process.exitcode == 0
        # The denial outlives the reset in this process until MAX_AGE...
        assert time.monotonic() - learnt < max_age, "the machine is too slow for this case's margin"
        stale = limiter.check("login", "shared")
        assert stale.cached and not stale.ok
        # ...and not past it.
        time.sleep(max(0.0, learnt + max_age + 0.5 - time.monotonic()))
        fresh = limiter.limit("login", "shared")
        assert fresh.ok and not fresh.cached


def _report_size(connection):
    connection.send((deny_cache.size(), limiter.check("login", "k").cached))
    connections.close_all()


def test_a_forked_child_starts_empty(backend, clock):
    exhaust(limiter)
    assert limiter.check("login", "k").cached
    connections.close_all()
    parent, child = multiprocessing.get_context("fork").Pipe()
    process = multiprocessing.get_context("fork").Process(target=_report_size, args=(child,))
    process.start()
    assert parent.poll(60)
    assert parent.recv() == (0, False)
    process.join(30)
    assert process.exitcode == 0


def test_checks_reject_a_bad_setting_and_name_the_problem():
    for value, words in [
        ("yes", "must be False or a dict"),
        ({"MAX_AGE": 0}, "MAX_AGE"),
        ({"MAX_AGE": "1"}, "MAX_AGE"),
        ({"MAX_KEYS": 0}, "MAX_KEYS"),
        ({"MAX_KEYS": 1.5}, "MAX_KEYS"),
        ({"TTL": 1}, "'TTL'"),
    ]:
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, "DENY_CACHE": value}):
            errors = [m for m in run_checks() if m.id == "django_tokenbucket.E051"]
            assert len(errors) == 1 and words in errors[0].msg, (value, errors)
            with pytest.raises(ImproperlyConfigured, match="DENY_CACHE"):
                deny_cache.active()
    for value in (False, {}, {"MAX_AGE": 0.5, "MAX_KEYS": 10}):
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, "DENY_CACHE": value}):
            assert [m for m in run_checks() if m.id == "django_tokenbucket.E051"] == []


def test_a_bad_per_limit_opt_out_is_an_error():
    with pytest.raises(ImproperlyConfigured, match="deny_cache must be True or False"):
        limiter.resolve("x", config={"rate": "1/m", "deny_cache": "no"})


def test_bytes_per_entry(backend, clock):
    """What docs/security.md states: the memory of one remembered key (an entry, its
    dict slot, its key tuple and the key's digest string, which the entry keeps alive)."""
    keys = [f"k{n}" for n in range(2000)]
    config = limiter.resolve("login")
    store = get_backend()
    probe = limiter.check("login", "probe")
    outcome = Outcome([Decision(False, 0, 20 * MICRO, 60 * MICRO, None)], round(probe.timestamp * MICRO))
    tracemalloc.start()
    try:
        start = tracemalloc.take_snapshot()
        for key in keys:
            digest = encode_key(key).digest
            deny_cache.remember(
                deny_cache.active(),
                config,
                store,
                digest,
                MICRO,
                outcome,
                deny_cache.now(),
            )
        used = sum(stat.size_diff for stat in tracemalloc.take_snapshot().compare_to(start, "filename"))
    finally:
        tracemalloc.stop()
    assert deny_cache.size() == len(keys)
    per_entry = used / len(keys)
    print(f"deny cache: {per_entry:.0f} bytes per entry")
    assert 100 < per_entry < 1000
    del digest



@pytest.mark.parametrize("path", ["/inline-ip/", "/async/", "/class/", "/api/default/", "/api/burst/"])
def test_a_flood_on_a_view_is_refused_from_memory(client, clock, store_calls, path):
    """@ratelimit (sync, async, class-based) and DRF throttles (one, and two scopes decided
    together) reach the store no more once a key is known denied."""
    codes = [client.get(path).status_code for _ in range(4)]
    assert 429 in codes, codes
    before = store_calls["n"]
    flood = [client.get(path) for _ in range(5)]
    assert [response.status_code for response in flood] == [429] * 5
    assert all(response["Retry-After"] for response in flood)
    assert store_calls["n"] == before


def test_a_clock_behind_the_last_write_is_not_remembered(api, clock):
    clock.advance(10)
    exhaust(api)
    deny_cache.clear()
    clock.advance(-1)  # behind the bucket's last write, within the skew the store tolerates
    denied = api.limit("login", "k")
    assert not denied.ok and deny_cache.size() == 0


# Needs a read that waits for no lock while the refund is uncommitted: PostgreSQL's MVCC.
@pytest.mark.only_on("postgres")
@pytest.mark.parametrize("backend", ["database"], indirect=True)
def test_a_refund_inside_a_transaction_is_forgotten_again_at_commit(backend):
    with frozen_clock(T0):
        exhaust(limiter)
        with transaction.atomic():
            limiter.refund("login", "k", 1)
            # Another connection reads the bucket as committed, empty: this process learns a denial.
            denied = in_another_thread(lambda: limiter.check("login", "k"))
            assert not denied.ok and deny_cache.size() == 1
        status = limiter.limit("login", "k")
        assert status.ok and not status.cached


@pytest.mark.parametrize("backend", ["database"], indirect=True)
def test_the_admin_shows_how_many_keys_this_process_holds(backend, clock, admin_client):
    for key in ("a", "b"):
        exhaust(limiter, key=key)
    page = admin_client.get(reverse("admin:django_tokenbucket_ratelimit_changelist"))
    assert "answers 2 keys known to be denied from memory" in page.content.decode()
    with override_settings(TOKENBUCKET={**_current(), "DENY_CACHE": False}):
        page = admin_client.get(reverse("admin:django_tokenbucket_ratelimit_changelist"))
        assert "known to be denied from memory" not in page.content.decode()


def test_frozen_clock_starts_with_an_empty_memory(backend, clock):
    exhaust(limiter)
    assert deny_cache.size() == 1
    with frozen_clock(T0):
        assert deny_cache.size() == 0


# -- What a test suite (or a failed request) does to the store ---------------------------
#
# Issue 46: a project's own tests start each case afresh — Django's TestCase rolls the
# rows back, a setUp empties Redis — and memory must never contradict that. These run at
# the defaults: no DENY_CACHE in the settings.


@pytest.fixture(params=["database", "redis"])
def default_store(request, transactional_db):
    """The store at the default DENY_CACHE; ``emptied()`` does to it what a test's
    teardown and the next setUp do (the rollback itself empties the database)."""
    overrides = store_overrides(request.param, request)
    settings_dict = {**BASE_SETTINGS, **overrides, "LIMITS": LIMITS}
    assert "DENY_CACHE" not in settings_dict
    with override_settings(TOKENBUCKET=settings_dict):
        yield request.param


def emptied(store: str) -> None:
    if store == "redis":
        from .redis_servers import delete_keys

        delete_keys()  # what cache.clear() does to a project's test Redis


class _RolledBack(Exception):
    pass


def test_a_denial_learnt_in_a_transaction_that_rolls_back_is_not_remembered(default_store):
    assert deny_cache.active() is not None  # on by default
    with pytest.raises(_RolledBack):
        with transaction.atomic():
            exhaust(limiter)
            raise _RolledBack
    emptied(default_store)
    status = limiter.limit("login", "k")
    assert status.ok and not status.cached
    assert deny_cache.size() == 0


def test_a_denial_learnt_in_a_transaction_is_remembered_once_it_commits(default_store, monkeypatch):
    store_calls = counted_store_calls(monkeypatch)
    with transaction.atomic():
        exhaust(limiter)
        before = store_calls["n"]
        again = limiter.limit("login", "k")
        # Not yet: the transaction may still be rolled back.
        assert not again.ok and not again.cached and store_calls["n"] == before + 1
        assert deny_cache.size() == 0
    assert deny_cache.size() == 1
    before = store_calls["n"]
    cached = limiter.limit("login", "k")
    assert not cached.ok and cached.cached and store_calls["n"] == before


def test_a_denial_learnt_in_a_savepoint_rolled_back_is_not_remembered(default_store):
    with transaction.atomic():
        with pytest.raises(_RolledBack):
            with transaction.atomic():
                exhaust(limiter, key="inner")
                raise _RolledBack
        exhaust(limiter, key="outer")
    emptied(default_store) if default_store == "redis" else None
    if default_store == "database":
        # The savepoint's rows went with it; the outer transaction's stand.
        assert limiter.limit("login", "inner").ok
    assert deny_cache.size() == 1 and not limiter.check("login", "outer").ok


def test_a_long_transaction_holds_at_most_max_keys_denials_awaiting_its_commit(default_store):
    with override_settings(TOKENBUCKET={**_current(), "DENY_CACHE": {"MAX_KEYS": 3}}):
        with transaction.atomic():
            for n in range(6):
                exhaust(limiter, key=f"k{n}")
            assert len(deny_cache._awaiting_commit) == 3
        assert deny_cache.size() == 3


def test_a_flushed_database_is_not_contradicted_by_memory(default_store):
    exhaust(limiter)
    assert deny_cache.size() == 1
    # What TransactionTestCase does after each test (and `manage.py flush`).
    call_command("flush", interactive=False, verbosity=0)
    emptied(default_store)
    assert deny_cache.size() == 0
    assert limiter.limit("login", "k").ok


def test_a_projects_own_test_cases_start_afresh_at_the_defaults(default_store):
    """Two TestCase classes of a project, each expecting a fresh bucket: the second used
    to get the first one's denial from memory (DRF's, django-ratelimit's and openwisp's
    own suites, swapped to these classes)."""
    import unittest

    from django.test import TestCase, TransactionTestCase

    class Afresh:
        def setUp(self):
            emptied(default_store)  # the project's cache.clear()

        def test_first(self):
            exhaust(limiter)

        def test_second(self):
            exhaust(limiter)

    class InTestCase(Afresh, TestCase):
        pass

    class InTransactionTestCase(Afresh, TransactionTestCase):
        pass

    loader = unittest.TestLoader()
    suite = unittest.TestSuite(loader.loadTestsFromTestCase(case) for case in (InTestCase, InTransactionTestCase))
    result = unittest.TextTestRunner(verbosity=0, stream=io.StringIO()).run(suite)
    assert result.testsRun == 4
    assert not result.failures and not result.errors, result.failures + result.errors
