"""Cleanup (RELIABILITY-PLAN S6, property 7): only idle rows go, in batches, past locked rows."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection, connections, transaction
from django.test import override_settings
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from django_tokenbucket import deny_cache, limiter
from django_tokenbucket.algorithms import MICRO, State
from django_tokenbucket.cleanup import cleanup
from django_tokenbucket.keys import encode_key
from django_tokenbucket.limits import parse_limit
from django_tokenbucket.live import cleanup_span, is_idle
from django_tokenbucket.models import RateLimit
from django_tokenbucket.registry import INLINE, SETTINGS, THROTTLE_RATES, known_limits
from django_tokenbucket.testing import frozen_clock

from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True)

T0 = 1_700_000_000.0
NOW = round(T0 * MICRO)


def store(name: str, key: object, value: int, ts: int) -> RateLimit:
    encoded = encode_key(key)
    return RateLimit.objects.create(name=name, key=encoded.digest, label=encoded.label, value=value, ts=ts)


def labels() -> set[str]:
    return set(RateLimit.objects.values_list("label", flat=True))


def test_deletes_exactly_the_idle_rows():
    minute = 60 * MICRO
    store("ten_per_minute", "full-long-ago", 10 * MICRO, NOW - 10 * minute)
    store("ten_per_minute", "empty-long-ago", 0, NOW - minute)  # refilled exactly now
    store("ten_per_minute", "refilled-recently", 9 * MICRO, NOW - 6 * MICRO)  # full, but not a candidate yet
    store("ten_per_minute", "used-just-now", 3 * MICRO, NOW)
    store("ten_per_minute", "one-us-short", 0, NOW - minute + 1)
    store("reservable", "in-debt", -20 * MICRO, NOW - 15 * MICRO)  # 10 per 10 s: still 5 short
    # "window": 5 per 60 s, windows at multiples of 60 s (start=0).
    window_start = NOW - NOW % minute
    store("window", "window-full-on-phase", 5 * MICRO, window_start - minute)
    # Stored under another start: the window from ``window_start`` credits it, so it reads
    # as a fresh key's window and goes too.
    store("window", "window-full-off-phase", 5 * MICRO, window_start - minute + 1)
    store("window", "window-used-this-window", 2 * MICRO, window_start)
    store("gone_from_settings", "orphan", 0, 0)

    with frozen_clock(T0):
        report = cleanup()
    assert labels() == {
        "refilled-recently",
        "used-just-now",
        "one-us-short",
        "in-debt",
        "window-used-this-window",
        "orphan",
    }
    assert report.deleted == {"ten_per_minute": 2, "window": 2}
    assert report.kept == 1  # "in-debt" was a candidate, and not idle
    assert report.unknown == {"gone_from_settings": 1}
    assert report.complete and report.batches >= 3

    with frozen_clock(T0):
        report = cleanup(remove_unknown=True)
    assert report.deleted == {"gone_from_settings": 1}
    assert "orphan" not in labels()


def test_a_row_written_by_a_decision_becomes_idle_once_full():
    with frozen_clock(T0) as clock:
        limiter.limit("burst", "k", count=20)  # 10 per 60 s, capacity 20: full again after 120 s
        clock.advance(119.999999)
        cleanup()
        assert labels() == {"k"}
        clock.advance(0.000001)
        cleanup()
        assert labels() == set()
        assert limiter.limit("burst", "k").value == 19  # and it starts as a fresh key would


def test_batches_are_bounded_and_the_run_completes():
    for i in range(25):
        store("login", f"k{i}", 5 * MICRO, 0)
    with frozen_clock(T0):
        report = cleanup(batch_size=10, names=["login"], pause=0)
    assert report.deleted == {"login": 25} and report.batches == 3  # 10 + 10 + 5
    with pytest.raises(ValueError, match="batch_size"):
        cleanup(batch_size=1001)
    with pytest.raises(ValueError, match="batch_size"):
        cleanup(batch_size=0)


def test_rows_that_are_not_idle_do_not_stall_the_batches():
    # A full batch of candidates in debt, then idle rows: keyset pagination moves past them.
    for i in range(5):
        store("reservable", f"debt{i}", -20 * MICRO, NOW - 11 * MICRO + i)
    for i in range(5):
        store("reservable", f"idle{i}", 10 * MICRO, NOW - 10 * MICRO + i - 5)
    with frozen_clock(T0):
        report = cleanup(batch_size=5, pause=0)
    assert report.kept == 5 and report.deleted == {"reservable": 5}
    assert labels() == {f"debt{i}" for i in range(5)}


def test_on_sqlite_batches_leave_waiting_writers_a_gap(monkeypatch):
    slept = []
    monkeypatch.setattr("django_tokenbucket.backends.database.cleanup.time.sleep", slept.append)
    for i in range(3):
        store("login", f"k{i}", 5 * MICRO, 0)
    with frozen_clock(T0):
        assert cleanup(batch_size=1, names=["login"]).deleted == {"login": 3}
    # SQLite's waiting writers poll: without a gap the next batch would take the lock first.
    assert slept == ([0.1, 0.1, 0.1] if connection.vendor == "sqlite" else [])


def test_dry_run_and_time_budget_delete_nothing():
    store("login", "idle", 5 * MICRO, 0)
    with frozen_clock(T0):
        dry = cleanup(dry_run=True)
        assert dry.deleted == {"login": 1} and dry.dry_run
        stopped = cleanup(max_seconds=0)
    assert not stopped.complete and stopped.deleted_total == 0
    assert labels() == {"idle"}


def test_names_restrict_the_run():
    store("login", "a", 5 * MICRO, 0)
    store("ten_per_minute", "b", 10 * MICRO, 0)
    with frozen_clock(T0):
        report = cleanup(names=["login"])
    assert report.deleted == {"login": 1} and labels() == {"b"}


def test_inline_limits_and_throttle_scopes_are_not_unknown(client):
    with frozen_clock(T0):
        client.get("/inline-ip/")  # @ratelimit(key="ip", rate="2/m"): an inline limit
    known = known_limits()
    assert known["tests.views.inline_ip"].source == INLINE
    assert known["anon"].source == THROTTLE_RATES and known["login"].source == SETTINGS
    store("anon", ("ip", "192.0.2.1"), 3 * MICRO, 0)  # a DRF scope from DEFAULT_THROTTLE_RATES
    with frozen_clock(T0 + 3600):
        report = cleanup()
    assert report.unknown == {}
    assert report.deleted == {"tests.views.inline_ip": 1, "anon": 1}


def test_limits_removed_from_settings_are_reported_not_dropped():
    with frozen_clock(T0):
        limiter.limit("login", "k")
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "LIMITS": {}}), frozen_clock(T0 + 3600):
        report = cleanup()
        assert report.unknown == {"login": 1} and report.deleted_total == 0
        assert labels() == {"k"}


def test_celery_task_runs_cleanup():
    from django_tokenbucket.tasks import cleanup_rate_limits

    store("login", "idle", 5 * MICRO, 0)
    assert cleanup_rate_limits.name == "django_tokenbucket.cleanup"
    with frozen_clock(T0):
        result = cleanup_rate_limits.apply(kwargs={"batch_size": 10}).get()
    assert result["deleted"] == {"login": 1} and result["complete"] is True
    assert labels() == set()


@pytest.mark.only_on("postgres", "mariadb")
def test_rows_locked_by_live_traffic_are_skipped_not_waited_for():
    for key in ("locked", "free1", "free2"):
        store("login", key, 5 * MICRO, 0)
    locked = threading.Event()
    release = threading.Event()

    def hold_lock():
        try:
            with transaction.atomic():
                list(RateLimit.objects.select_for_update().filter(label="locked"))
                locked.set()
                release.wait(timeout=30)
        finally:
            connection.close()

    holder = threading.Thread(target=hold_lock)
    holder.start()
    try:
        assert locked.wait(timeout=10)
        started = time.monotonic()
        with frozen_clock(T0):
            report = cleanup()
        elapsed = time.monotonic() - started
    finally:
        release.set()
        holder.join(timeout=30)
    assert elapsed < 5, f"cleanup waited for a locked row ({elapsed:.1f} s)"
    assert report.deleted == {"login": 2}
    assert labels() == {"locked"}
    with frozen_clock(T0):
        assert cleanup().deleted == {"login": 1}  # once released, it goes too


@pytest.mark.only_on("mariadb")
def test_cleanup_batches_run_at_read_committed_on_mysql():
    store("login", "idle", 5 * MICRO, 0)
    seen = []

    def watch(execute, sql, params, many, context):
        seen.append(sql)
        return execute(sql, params, many, context)

    with connections["default"].execute_wrapper(watch), frozen_clock(T0):
        cleanup()
    assert any("SET TRANSACTION ISOLATION LEVEL READ COMMITTED" in sql for sql in seen)
    assert labels() == set()


# -- the property: deleting what cleanup selects changes no future decision -----------------

amounts = st.integers(min_value=1, max_value=10**4).map(lambda n: n * 10_000)  # up to 100 tokens


@st.composite
def specs(draw):
    kind = draw(st.sampled_from(["token bucket", "fixed window"]))
    rate = draw(amounts)
    spec = {
        "kind": kind,
        "rate": rate / MICRO,
        "period": draw(st.sampled_from([1, 3, 60])),
        "capacity": draw(st.one_of(st.none(), amounts)),
        "max_reserved": draw(st.one_of(st.none(), amounts)),
    }
    if kind == "fixed window":
        spec["start"] = draw(st.one_of(st.none(), st.integers(0, 100)))
    return {k: (v / MICRO if k in ("capacity", "max_reserved") and v else v) for k, v in spec.items()}


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_deleting_what_cleanup_selects_changes_no_future_decision(data):
    RateLimit.objects.all().delete()
    deny_cache.clear()  # the rows went behind the limiter's back, and the clock is pinned to T0 again
    spec = data.draw(specs(), "config")
    limit = parse_limit("prop", spec)
    span = cleanup_span(limit)
    lowest = -(limit.max_reserved if limit.max_reserved is not None else limit.capacity)
    keys = [f"k{i}" for i in range(data.draw(st.integers(1, 4), "keys"))]
    states = {}
    for key in keys:
        # Biased towards the boundaries: empty, full, just short of full; idle for
        # exactly the cleanup span, a microsecond less or more.
        value = data.draw(
            st.one_of(st.integers(lowest, limit.capacity), st.sampled_from([0, limit.capacity - 1, limit.capacity])),
            f"value {key}",
        )
        age = data.draw(
            st.one_of(
                st.integers(-limit.period, 2 * span + limit.period),
                st.sampled_from([span - 1, span, span + 1, 3 * span]),
            ),
            f"age {key}",
        )
        ts = NOW - age
        if limit.kind == "fixed window" and data.draw(st.booleans(), f"on phase {key}"):
            # Stored windows start on the key's phase, unless the config changed since.
            offset = limit.window_offset(encode_key(key).digest)
            ts -= (ts - offset) % limit.period
        states[key] = State(value, ts)
        store("prop", key, value, ts)

    with frozen_clock(T0):
        report = cleanup(limits={"prop": limit}, batch_size=2, pause=0)
    remaining = set(RateLimit.objects.values_list("label", flat=True))
    for key, state in states.items():
        candidate = state.ts <= NOW - span
        idle = is_idle(limit, state, encode_key(key).digest, NOW)
        assert (key not in remaining) == (candidate and idle)
        event(f"{limit.kind}: {'deleted' if key not in remaining else 'kept ' + ('idle' if idle else 'busy')}")
    assert report.deleted_total == len(keys) - len(remaining)

    # Replay the same future on every key: through the database (after cleanup) and
    # through the pure algorithm from the state as it was before cleanup.
    events = data.draw(
        st.lists(
            st.tuples(
                st.integers(0, 2 * limit.period), st.integers(1, limit.capacity // 10_000), st.booleans()
            ),
            min_size=1,
            max_size=6,
        ),
        "events",
    )
    for key, state in states.items():
        digest = encode_key(key).digest
        now = NOW
        reference: State | None = state
        with frozen_clock(T0) as clock:
            for dt, count, reserve in events:
                now += dt
                clock.set(now / MICRO)
                expected = limit.decide(reference, now, count * 10_000, digest, reserve)
                if expected.allowed:
                    reference = expected.state
                elif expected.state is not None:
                    reference = expected.state
                status = limiter.limit("prop", key, count=count / 100, reserve=reserve, config=spec)
                assert status.ok == expected.allowed
                assert status.value == expected.value / MICRO
                assert status.retry_after == (None if expected.retry_after is None else expected.retry_after / MICRO)
                assert status.reset_after == expected.full_after / MICRO


def test_cleanup_trims_denial_analytics_past_their_retention_but_not_on_a_dry_run():
    from django_tokenbucket.backends.base import KEY_MINUTES_KEPT, MINUTES_KEPT, DeniedKeyCount, MinuteCounts
    from django_tokenbucket.backends.database import DatabaseBackend
    from django_tokenbucket.models import AnalyticsMinute, DeniedKeyMinute

    now = int(T0 // 60)
    digest = encode_key("k").digest
    DatabaseBackend({}).write_analytics(
        [MinuteCounts("login", now - MINUTES_KEPT - 1, 1, 1), MinuteCounts("login", now, 1, 1)],
        [DeniedKeyCount("login", digest, "k", 1, now - KEY_MINUTES_KEPT - 1), DeniedKeyCount("login", digest, "k", 1, now)],
    )
    with frozen_clock(T0):
        dry = cleanup(dry_run=True)
        assert dry.analytics_trimmed == 0 and AnalyticsMinute.objects.count() == 2 and DeniedKeyMinute.objects.count() == 2
        report = cleanup()
    assert report.analytics_trimmed == 2 and report.as_dict()["analytics_trimmed"] == 2
    assert list(AnalyticsMinute.objects.values_list("minute", flat=True)) == [now]
    assert list(DeniedKeyMinute.objects.values_list("minute", flat=True)) == [now]
    with frozen_clock(T0):
        assert cleanup().analytics_trimmed == 0
