"""The behaviour every backend must show, run against each of them.

Time is pinned with ``frozen_clock`` so the assertions are exact; no test sleeps.
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
from asgiref.sync import async_to_sync
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_tokenbucket import LimitRequest, MultiStatus, RateLimited
from django_tokenbucket import limiter as sync_limiter
from django_tokenbucket.backends import get_backend
from django_tokenbucket.testing import frozen_clock

from .settings import DB as _TEST_DB
from .settings import TOKENBUCKET as BASE_SETTINGS

DATABASE_BACKEND = "django_tokenbucket.backends.database.DatabaseBackend"
BACKENDS = {
    "database": {"BACKEND": DATABASE_BACKEND},
    # At the defaults: each call made by the backend itself within the default deadline
    # (backends/redis/bounded.py), on the test cache's client (it sets socket timeouts)...
    "redis": {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend"},
    # ...and on a cache that sets none, through the backend's own client (clients.py)...
    "redis-bare": {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis-bare"}},
    # ...and without a deadline: every call left to redis-py (TIMEOUT None, the opt-out).
    "redis-no-timeout": {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend", "OPTIONS": {"TIMEOUT": None}},
}


def store_overrides(name: str, request) -> dict:
    """The TOKENBUCKET overrides of backend ``name``; Redis' on this run's cache alias and keys."""
    overrides = dict(BACKENDS[name])
    if name.startswith("redis"):
        # The cache alias to use, and a clean slate of this run's keys (see conftest.py).
        store = request.getfixturevalue("redis_store")
        overrides = {**store, "OPTIONS": {**store["OPTIONS"], **overrides.get("OPTIONS", {})}}
    return overrides


if _TEST_DB == "postgres":
    # "database" takes the one-statement fast path there; this is the portable one.
    BACKENDS["database-portable"] = {"BACKEND": DATABASE_BACKEND, "OPTIONS": {"FAST_PATH": False}}

T0 = 1_700_000_000.0


class AsyncAPI:
    """The limiter's async twins (``alimit`` for ``limit``...), called as the sync methods are.

    Every case of this module runs through both, on every backend: the async API must
    give the same results.
    """

    def __getattr__(self, name: str):
        twin = getattr(sync_limiter, f"a{name}", None)
        return async_to_sync(twin) if twin is not None else getattr(sync_limiter, name)


limiter = sync_limiter


@pytest.fixture(params=["sync", "async"], autouse=True)
def api(request, monkeypatch):
    monkeypatch.setitem(globals(), "limiter", sync_limiter if request.param == "sync" else AsyncAPI())
    return request.param


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, transactional_db, api):
    overrides = store_overrides(request.param, request)
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **overrides}):
        options, default = overrides.get("OPTIONS", {}), None
        if request.param.startswith("redis"):
            from django_tokenbucket.backends.redis.bounded import DEFAULT_TIMEOUT as default
        assert getattr(get_backend(), "timeout", None) == options.get("TIMEOUT", default)
        yield request.param
        if request.param.startswith("redis") and api == "async":
            # The async twins reached Redis on its asyncio client only: never through a
            # thread, and the blocking client was never even made.
            used = get_backend()
            assert used.async_calls["thread"] == 0 and used._connection is None, used.async_calls


@pytest.fixture
def clock(backend):
    with frozen_clock(T0) as frozen:
        yield frozen


TEN_PER_MINUTE = {"rate": 10, "period": 60}


def test_fresh_bucket_is_full(clock):
    assert limiter.get_value("ten_per_minute", "fresh") == 10
    status = limiter.limit("ten_per_minute", "fresh")
    assert status.ok and status.value == 9 and status.retry_after is None
    assert status.capacity == 10 and status.period == 60 and status.rate == 10
    assert status.reset_after == pytest.approx(6.0)
    assert status.timestamp == T0


def test_denial_is_exact_and_changes_nothing(clock):
    for _ in range(10):
        assert limiter.limit("ten_per_minute", "k").ok
    clock.advance(1.5)
    denied = limiter.limit("ten_per_minute", "k")
    assert not denied.ok
    assert denied.value == pytest.approx(0.25)
    assert denied.retry_after == pytest.approx(4.5)
    # The denial consumed nothing: the refill goes on exactly as before it.
    assert limiter.get_value("ten_per_minute", "k") == pytest.approx(0.25)
    clock.advance(4.5 - 1e-6)
    assert not limiter.limit("ten_per_minute", "k").ok
    clock.advance(1e-6)
    assert limiter.limit("ten_per_minute", "k").ok


def test_weighted_count_and_refill_phase(clock):
    assert limiter.limit("ten_per_minute", "w", count=7).value == 3
    clock.advance(3)  # half a token
    status = limiter.limit("ten_per_minute", "w", count=3)
    assert status.ok and status.value == pytest.approx(0.5)
    clock.advance(3)  # the half token earned before the call is kept
    assert limiter.get_value("ten_per_minute", "w") == pytest.approx(1.0)


def test_fractional_counts(clock):
    for _ in range(4):
        assert limiter.limit("ten_per_minute", "f", count=2.5).ok
    denied = limiter.limit("ten_per_minute", "f", count=0.5)
    assert not denied.ok and denied.retry_after == pytest.approx(3.0)


def test_check_returns_what_limit_would_without_applying(clock):
    limiter.limit("ten_per_minute", "c", count=9)
    for count in (1, 2):
        checked = limiter.check("ten_per_minute", "c", count=count)
        assert limiter.get_value("ten_per_minute", "c") == 1
        applied = limiter.limit("ten_per_minute", "c", count=count)
        assert (checked.ok, checked.value, checked.retry_after) == (
            applied.ok,
            applied.value,
            applied.retry_after,
        )
        if applied.ok:
            limiter.reset("ten_per_minute", "c")
            limiter.limit("ten_per_minute", "c", count=9)


def test_a_result_has_no_truth_value(clock):
    # "if status:" reads as "allowed" in a view and as "present" in a RESPONSE callable or
    # a template; either guess silently breaks the other, so neither is made.
    limiter.limit("ten_per_minute", "t", count=10)
    denied, allowed = limiter.limit("ten_per_minute", "t"), limiter.limit("ten_per_minute", "u")
    many = limiter.limit_many([("ten_per_minute", "v")])
    for result, kind in ((denied, "Status"), (allowed, "Status"), (many, "MultiStatus")):
        with pytest.raises(TypeError, match=f"a {kind} has no truth value: test .ok for whether the call was allowed"):
            bool(result)
    assert (denied.ok, allowed.ok, many.ok, many.timestamp) == (False, True, True, many[0].timestamp)


def test_capacity_above_rate_allows_a_burst(clock):
    for _ in range(20):
        assert limiter.limit("burst", "b").ok
    assert not limiter.limit("burst", "b").ok
    clock.advance(60)
    assert limiter.get_value("burst", "b") == 10


def test_refill_stops_at_capacity(clock):
    limiter.limit("ten_per_minute", "cap", count=10)
    clock.advance(3600)
    assert limiter.get_value("ten_per_minute", "cap") == 10
    status = limiter.get_status("ten_per_minute", "cap")
    assert status.reset_after == 0


def test_reset_makes_the_bucket_fresh(clock):
    limiter.limit("ten_per_minute", "r", count=10)
    limiter.reset("ten_per_minute", "r")
    assert limiter.get_value("ten_per_minute", "r") == 10
    limiter.reset("ten_per_minute", "never-used")  # resetting an unknown key is harmless


def test_keys_and_names_are_separate_buckets(clock):
    limiter.limit("ten_per_minute", "alice", count=10)
    assert limiter.get_value("ten_per_minute", "bob") == 10
    assert limiter.get_value("ten_per_minute", None) == 10
    assert limiter.get_value("burst", "alice") == 20
    limiter.limit("ten_per_minute", None, count=4)
    assert limiter.get_value("ten_per_minute") == 6


def test_throws_raises_rate_limited(clock):
    limiter.limit("ten_per_minute", "t", count=10)
    with pytest.raises(RateLimited) as excinfo:
        limiter.limit("ten_per_minute", "t", throws=True)
    exc = excinfo.value
    assert (exc.name, exc.key) == ("ten_per_minute", "t")
    assert exc.retry_after == pytest.approx(6.0) and exc.status is not None and not exc.status.ok
    with pytest.raises(RateLimited):
        limiter.check("ten_per_minute", "t", throws=True)
    assert limiter.get_value("ten_per_minute", "t") == 0


def test_inline_config(clock):
    config = {"kind": "token bucket", "rate": "2/s", "capacity": 4}
    for _ in range(4):
        assert limiter.limit("inline", "i", config=config).ok
    denied = limiter.limit("inline", "i", config=config)
    assert not denied.ok and denied.retry_after == pytest.approx(0.5)
    assert limiter.get_value("inline", "i", config=config) == 0
    limiter.reset("inline", "i", config=config)
    assert limiter.get_value("inline", "i", config=config) == 4
    # Once seen, the limit is known by name, as the command and the admin know it.
    limiter.limit("inline", "i", config=config, count=3)
    assert limiter.get_value("inline", "i") == 1
    with pytest.raises(ImproperlyConfigured, match="never_seen_inline"):
        limiter.get_value("never_seen_inline", "i")


def test_unknown_limit_is_an_error(clock):
    with pytest.raises(ImproperlyConfigured, match="no_such_limit"):
        limiter.limit("no_such_limit", "k")


def test_impossible_count_is_an_error_and_changes_nothing(clock):
    limiter.limit("ten_per_minute", "big", count=3)
    for count in (11, 0, -1, float("nan"), True):
        with pytest.raises(ValueError, match="ten_per_minute"):
            limiter.limit("ten_per_minute", "big", count=count)
    assert limiter.get_value("ten_per_minute", "big") == 7


class TestFixedWindow:
    """``window``: 5 per 60 s windows starting on the minute (start=0)."""

    def test_window_refills_at_the_boundary_only(self, backend):
        with frozen_clock(T0 - T0 % 60 + 10) as clock:  # 10 s into a window
            for _ in range(5):
                assert limiter.limit("window", "a").ok
            denied = limiter.limit("window", "a")
            assert not denied.ok and denied.retry_after == pytest.approx(50.0)
            clock.advance(49.999999)
            assert not limiter.limit("window", "a").ok
            clock.advance(0.000001)
            assert limiter.limit("window", "a").value == 4

    def test_unused_tokens_roll_over_up_to_capacity(self, backend):
        config = {"kind": "fixed window", "rate": 5, "period": 60, "capacity": 8, "start": 0}
        with frozen_clock(T0 - T0 % 60) as clock:
            assert limiter.limit("rollover", "a", count=5, config=config).value == 3
            clock.advance(60)
            assert limiter.get_value("rollover", "a", config=config) == 8
            clock.advance(600)
            assert limiter.get_value("rollover", "a", config=config) == 8

    def test_windows_of_different_keys_start_at_different_offsets(self, backend):
        config = {"kind": "fixed window", "rate": 1, "period": 3600}
        with frozen_clock(T0):
            waits = set()
            for user in range(20):
                limiter.limit("staggered", user, config=config)
                waits.add(round(limiter.check("staggered", user, config=config).retry_after))
        assert len(waits) > 10  # not one thundering herd at the top of the hour

    def test_boundary_burst_admits_twice_the_rate(self, backend):
        # Documented property of fixed windows: 2L within a short interval around a boundary.
        with frozen_clock(T0 - T0 % 60 + 59.9) as clock:
            admitted = sum(limiter.limit("window", "edge").ok for _ in range(10))
            clock.advance(0.2)
            admitted += sum(limiter.limit("window", "edge").ok for _ in range(10))
        assert admitted == 10


class TestReservations:
    """``reservable``: 10 per 10 s, max_reserved 20."""

    def test_reserve_goes_negative_and_says_when(self, clock):
        assert limiter.limit("reservable", "r", count=10).value == 0
        status = limiter.limit("reservable", "r", count=5, reserve=True)
        assert status.ok and status.value == -5 and status.retry_after == pytest.approx(5.0)
        status = limiter.limit("reservable", "r", count=15, reserve=True)
        assert status.ok and status.value == -20 and status.retry_after == pytest.approx(20.0)
        denied = limiter.limit("reservable", "r", count=1, reserve=True)
        assert not denied.ok and denied.value == -20 and denied.retry_after == pytest.approx(1.0)
        assert limiter.get_value("reservable", "r") == -20
        clock.advance(20)
        assert limiter.get_value("reservable", "r") == pytest.approx(0)

    def test_without_reserve_a_debt_blocks(self, clock):
        limiter.limit("reservable", "d", count=15, reserve=True)
        denied = limiter.limit("reservable", "d")
        assert not denied.ok and denied.retry_after == pytest.approx(6.0)

    def test_count_above_capacity_plus_max_reserved_is_an_error(self, clock):
        with pytest.raises(ValueError, match="reservable"):
            limiter.limit("reservable", "e", count=31, reserve=True)
        assert limiter.limit("reservable", "e", count=30, reserve=True).ok

    def test_uncapped_reservations(self, clock):
        config = {"rate": 1, "period": 1}
        status = limiter.limit("uncapped", "u", count=1000, reserve=True, config=config)
        assert status.ok and status.value == -999 and status.retry_after == pytest.approx(999)


class TestSeveralLimits:
    def test_all_or_nothing(self, clock):
        """H5: a denial by one limit consumes none of the others."""
        limiter.limit("login", "u", count=5)
        result = limiter.limit_many([("burst", "u"), ("login", "u")])
        assert not result.ok
        assert [s.ok for s in result] == [True, False]
        assert result.retry_after == pytest.approx(12.0)
        assert limiter.get_value("burst", "u") == 20
        assert limiter.get_value("login", "u") == 0

    def test_all_allowed_consumes_all(self, clock):
        result = limiter.limit_many([LimitRequest("burst", "v", count=3), ("login", "v", 2)])
        assert result.ok and [s.value for s in result] == [17, 3]
        assert limiter.get_value("burst", "v") == 17 and limiter.get_value("login", "v") == 3

    def test_same_limit_twice_sees_its_own_consumption(self, clock):
        result = limiter.limit_many([("login", "x", 3), ("login", "x", 3)])
        assert not result.ok and limiter.get_value("login", "x") == 5
        result = limiter.limit_many([("login", "x", 3), ("login", "x", 2)])
        assert result.ok and limiter.get_value("login", "x") == 0

    def test_throws_names_the_binding_limit(self, clock):
        limiter.limit("login", "y", count=5)
        with pytest.raises(RateLimited) as excinfo:
            limiter.limit_many([("burst", "y"), ("login", "y")], throws=True)
        assert excinfo.value.name == "login"

    def test_check_many(self, clock):
        result = limiter.check_many([("burst", "z", 20), ("login", "z", 5)])
        assert result.ok and limiter.get_value("burst", "z") == 20

    def test_one_limit_decides_as_the_plan_for_several(self, clock, api):
        """``limit_many`` of one limit, a throttle's usual call, and the engine's entry for
        one limit (``limit``'s) decide the same calls alike, shadow mode and waits included."""

        def planned(item, *, apply=True, throws=False):
            engine = sync_limiter.engine
            asked = (item.name, "planned", item.count, item.reserve, item.config)
            if api == "sync":
                status = engine.decide_one(*asked, apply=apply, throws=throws)
            else:
                status = async_to_sync(engine.adecide_one)(*asked, apply=apply, throws=throws)
            return MultiStatus((status,))

        def as_planned(statuses):
            return [replace(status, key="planned") for status in statuses]

        shadow = {"rate": "5/m", "shadow": True}
        for name, config in (("login", None), ("shadow_one", shadow)):
            for count, reserve in ((2, False), (3, False), (1, False), (4, False), (1, True)):
                item = LimitRequest(name, "short", count, reserve, config)
                short, twin = limiter.limit_many([item]), planned(item)
                assert type(short) is type(twin) and as_planned(short) == list(twin)
                assert as_planned(limiter.check_many([item])) == list(planned(item, apply=False))
        item = LimitRequest("login", "short")
        with pytest.raises(RateLimited) as short_raised:
            limiter.limit_many([item], throws=True)
        with pytest.raises(RateLimited) as planned_raised:
            planned(item, throws=True)
        assert short_raised.value.retry_after == planned_raised.value.retry_after
        assert replace(short_raised.value.status, key="planned") == planned_raised.value.status


class TestClock:
    def test_clock_going_backwards_mints_nothing_and_locks_nobody_out(self, backend):
        with frozen_clock(T0) as clock:
            limiter.limit("ten_per_minute", "b", count=10)
            clock.advance(-3600)
            assert limiter.get_value("ten_per_minute", "b") == 0
            denied = limiter.limit("ten_per_minute", "b")
            assert not denied.ok and denied.retry_after == pytest.approx(6.0)
            clock.advance(6)
            assert limiter.limit("ten_per_minute", "b").ok

    def test_config_change_reinterprets_the_state(self, clock):
        limiter.limit("reconfigured", "k", count=20, config={"rate": 100, "period": 100})
        smaller = {"rate": 10, "period": 100}
        assert limiter.get_value("reconfigured", "k", config=smaller) == 10
        limiter.limit("reconfigured", "k", count=10, config=smaller)
        denied = limiter.limit("reconfigured", "k", config={"rate": 5, "period": 100})
        assert not denied.ok and denied.retry_after == pytest.approx(20.0)


class TestShards:
    """A limit spread over shards: exact in sum, two shards read per call, pooled when needed."""

    SHARDED = {"rate": 10, "period": 60, "shards": 4}  # shares of 10: 3, 3, 2, 2

    @pytest.fixture(autouse=True)
    def seeded(self):
        # The shards a call reads are random; a seed makes each run the same.
        state = random.getstate()
        random.seed(4)
        yield
        random.setstate(state)

    def test_admits_no_more_than_the_limit_and_the_sum_is_exact(self, clock):
        admitted = sum(limiter.limit("sharded", "k", config=self.SHARDED).ok for _ in range(30))
        assert 8 <= admitted <= 10
        assert limiter.get_value("sharded", "k", config=self.SHARDED) == 10 - admitted
        clock.advance(60)
        assert limiter.get_value("sharded", "k", config=self.SHARDED) == 10

    def test_two_shards_are_pooled_when_neither_holds_the_count(self, clock):
        even = {"rate": 8, "period": 60, "shards": 4}  # 2 tokens in each shard
        status = limiter.limit("pooled", "k", count=3, config=even)
        assert status.ok and status.capacity == 8
        assert limiter.get_value("pooled", "k", config=even) == 5
        # Four tokens is what two shards hold at most: more could never succeed.
        with pytest.raises(ValueError, match=r"'pooled'.*two of its 4 shards"):
            limiter.limit("pooled", "k", count=4.5, config=even)

    def test_a_denial_consumes_nothing_and_says_when(self, clock):
        one_each = {"rate": 4, "period": 60, "shards": 4}  # a token every 15 s per shard
        for _ in range(20):
            limiter.limit("drained", "k", config=one_each)
        assert limiter.get_value("drained", "k", config=one_each) == 0
        denied = limiter.limit("drained", "k", config=one_each)
        assert not denied.ok and denied.retry_after == pytest.approx(60.0)
        assert limiter.get_value("drained", "k", config=one_each) == 0

    def test_all_or_nothing_with_other_limits(self, clock):
        assert limiter.limit("ten_per_minute", "k", count=10).ok
        both = [LimitRequest("sharded", "k", config=self.SHARDED), LimitRequest("ten_per_minute", "k")]
        assert not limiter.limit_many(both).ok
        assert limiter.get_value("sharded", "k", config=self.SHARDED) == 10

    def test_reset_and_refund_reach_every_shard(self, clock):
        limiter.limit("sharded", "k", count=2, config=self.SHARDED)
        limiter.limit("sharded", "k", count=3, config=self.SHARDED)
        assert limiter.get_value("sharded", "k", config=self.SHARDED) == 5
        # Back into the shards with the most room, none above its share.
        assert limiter.refund("sharded", "k", count=4, config=self.SHARDED).value == 9
        assert limiter.refund("sharded", "k", count=4, config=self.SHARDED).value == 10
        limiter.limit("sharded", "k", count=2, config=self.SHARDED)
        limiter.reset("sharded", "k", config=self.SHARDED)
        assert limiter.get_value("sharded", "k", config=self.SHARDED) == 10
