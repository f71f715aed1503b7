"""What only the database backend does: transactions, locking, its clock, failures, and
decisions that time zones and DST leave alone (RELIABILITY-PLAN K6). Its portable path
under faults is tests/test_database_faults.py."""

from __future__ import annotations

import logging
import random
from collections import Counter
from datetime import UTC, datetime

import pytest
from django.conf import settings
from django.db import OperationalError, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_tokenbucket import BackendUnavailable, limiter
from django_tokenbucket.backends.database import retrying
from django_tokenbucket.keys import encode_key
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock

from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

T0 = 1_700_000_000.0


def row(name: str = "ten_per_minute") -> RateLimit:
    return RateLimit.objects.get(name=name)


def test_state_is_two_numbers_in_one_row():
    with frozen_clock(T0):
        limiter.limit("ten_per_minute", "alice", count=3)
    stored = row()
    assert (stored.value, stored.ts) == (7_000_000, int(T0 * 1_000_000))
    assert stored.tokens == 7 and stored.label == "alice" and len(stored.key) == 64
    assert stored.updated_at.timestamp() == T0


def test_a_denial_writes_nothing():
    with frozen_clock(T0) as clock:
        limiter.limit("ten_per_minute", "k", count=10)
        before = row()
        clock.advance(1)
        with CaptureQueriesContext(connections["default"]) as queries:
            assert not limiter.limit("ten_per_minute", "k").ok
    assert (row().value, row().ts) == (before.value, before.ts)
    assert not [q for q in queries.captured_queries if q["sql"].lstrip().upper().startswith(("UPDATE", "INSERT"))]


def test_rollback_of_the_callers_transaction_unspends_tokens():
    with frozen_clock(T0):
        limiter.limit("ten_per_minute", "tx", count=2)
        with pytest.raises(ZeroDivisionError):
            with transaction.atomic():
                assert limiter.limit("ten_per_minute", "tx", count=5).value == 3
                1 / 0
        assert limiter.get_value("ten_per_minute", "tx") == 8


def test_rolled_back_savepoint_unspends_only_its_own_tokens():
    with frozen_clock(T0):
        with transaction.atomic():
            limiter.limit("ten_per_minute", "sp", count=2)
            try:
                with transaction.atomic():
                    limiter.limit("ten_per_minute", "sp", count=5)
                    raise RuntimeError
            except RuntimeError:
                pass
        assert limiter.get_value("ten_per_minute", "sp") == 8


def test_first_use_inside_a_rolled_back_transaction_leaves_no_row():
    with frozen_clock(T0):
        with pytest.raises(RuntimeError), transaction.atomic():
            limiter.limit("ten_per_minute", "new")
            raise RuntimeError
    assert not RateLimit.objects.exists()


@pytest.mark.only_on("postgres", "mariadb")  # SQLite has no server clock: the app's is used
def test_time_comes_from_the_database_clock():
    with CaptureQueriesContext(connections["default"]) as queries:
        status = limiter.limit("ten_per_minute", "clock")
    sql = " ".join(q["sql"] for q in queries.captured_queries).lower()
    server_side = ("django_tokenbucket_decide_v" in sql) or ("django_tokenbucket_single_v" in sql)
    assert ("clock_timestamp()" in sql) or ("sysdate(6)" in sql) or server_side
    stored = row()
    assert stored.ts == round(status.timestamp * 1_000_000)


def test_app_clock_setting_uses_this_hosts_time():
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "CLOCK": "app"}):
        with CaptureQueriesContext(connections["default"]) as queries:
            limiter.limit("ten_per_minute", "app")
    sql = " ".join(q["sql"] for q in queries.captured_queries).lower()
    assert "clock_timestamp()" not in sql and "sysdate" not in sql


class TestStoreFailures:
    """A database that refuses connections (see ``unreachable`` in tests/settings.py)."""

    @pytest.fixture
    def unreachable(self):
        options = {"DATABASE": "unreachable"}
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, "OPTIONS": options, "RETRY_ATTEMPTS": 2}):
            yield
        connections["unreachable"].close()

    def test_fail_closed_by_default(self, unreachable, caplog):
        with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
            with pytest.raises(BackendUnavailable, match="ten_per_minute"):
                limiter.limit("ten_per_minute", "k")
        [record] = caplog.records
        assert "ten_per_minute" in record.getMessage() and "fail closed" in record.getMessage()

    def test_fail_open_allows_and_logs(self, unreachable, caplog):
        with override_settings(TOKENBUCKET={**settings.TOKENBUCKET, "FAIL_OPEN": True}):
            with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
                status = limiter.limit("ten_per_minute", "k")
        assert status.ok and status.failed_open and status.value is None
        [record] = caplog.records
        assert "FAIL_OPEN" in record.getMessage() and "ten_per_minute" in record.getMessage()

    def test_reading_and_resetting_never_fail_open(self, unreachable):
        with override_settings(TOKENBUCKET={**settings.TOKENBUCKET, "FAIL_OPEN": True}):
            with pytest.raises(BackendUnavailable):
                limiter.get_value("ten_per_minute", "k")
            with pytest.raises(BackendUnavailable):
                limiter.reset("ten_per_minute", "k")


@pytest.mark.only_on("postgres")
def test_serialization_failure_in_the_callers_transaction_propagates():
    """The limiter cannot retry a transaction it does not own: the caller must."""
    serializable = {**BASE_SETTINGS, "OPTIONS": {"DATABASE": "serializable"}}
    with override_settings(TOKENBUCKET=serializable), frozen_clock(T0):
        limiter.limit("ten_per_minute", "ser")
        with pytest.raises(OperationalError) as excinfo:
            with transaction.atomic(using="serializable"):
                # Take the snapshot, then let another transaction change the row.
                list(RateLimit.objects.using("serializable").all())
                RateLimit.objects.using("default").update(value=1_000_000)
                limiter.limit("ten_per_minute", "ser")
        assert getattr(excinfo.value.__cause__, "sqlstate", None) == "40001"
        # Outside a caller's transaction the limiter owns it, and simply succeeds.
        assert limiter.limit("ten_per_minute", "ser").value == 0
    connections["serializable"].close()


@pytest.mark.only_on("postgres")
def test_one_retry_policy_runs_a_collided_transaction_again_and_gives_up_after_retry_attempts():
    """``retrying`` (decisions and cleanup batches): a real serialization failure is run
    again; with ``RETRY_ATTEMPTS`` 1 it is raised, counted as given up."""
    with frozen_clock(T0):
        limiter.limit("ten_per_minute", "collide")
    runs = []

    def collide_on_first_run() -> int:
        runs.append(1)
        # The snapshot is taken by this read; another connection then changes the row,
        # and this transaction's write of it fails with SQLSTATE 40001.
        seen = RateLimit.objects.using("serializable").get(name="ten_per_minute")
        if len(runs) == 1:
            RateLimit.objects.using("default").filter(pk=seen.pk).update(value=seen.value + 1)
        return RateLimit.objects.using("serializable").filter(pk=seen.pk).update(value=seen.value - 1)

    retried, gave_up = Counter(), Counter()
    try:
        assert retrying("serializable", collide_on_first_run, retried=retried, gave_up=gave_up) == 1
        assert (len(runs), dict(retried), dict(gave_up)) == (2, {"40001": 1}, {})

        runs.clear()
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, "RETRY_ATTEMPTS": 1}):
            with pytest.raises(OperationalError):
                retrying("serializable", collide_on_first_run, retried=retried, gave_up=gave_up)
        assert (len(runs), dict(retried), dict(gave_up)) == (1, {"40001": 1}, {"40001": 1})
    finally:
        connections["serializable"].close()


# ---------------------------------------------------------------------------------------
# K6: time zones and DST
# ---------------------------------------------------------------------------------------


def stored(name: str, key: object) -> tuple[int, int] | None:
    row = RateLimit.objects.filter(name=name, key=encode_key(key).digest).values_list("value", "ts").first()
    return None if row is None else tuple(row)


def figure(line: str) -> None:
    print(f"\n{line}")


# 2026-11-01 01:00-02:00 happens twice in America/New_York (05:00-07:00 UTC).
DST_START = datetime(2026, 11, 1, 4, 50, tzinfo=UTC).timestamp()


def test_k6_time_zones_and_dst_change_no_decision():
    rng = random.Random(6)
    steps = [rng.choice([1, 7, 60, 240, 600]) for _ in range(60)]  # crosses 05:00-07:00 UTC
    limits = {
        "k6-bucket": {"rate": 3, "period": 3600, "capacity": 3},
        "k6-window": {"kind": "fixed window", "rate": 3, "period": 3600, "start": 0},
    }
    runs = {}
    for run, (zone, use_tz) in enumerate([("UTC", True), ("America/New_York", True), ("America/New_York", False)]):
        with override_settings(TIME_ZONE=zone, USE_TZ=use_tz), frozen_clock(DST_START) as clock:
            decisions = []
            for dt in steps:
                clock.advance(dt)
                for name, config in limits.items():
                    status = limiter.limit(name, f"run{run}", config=config)
                    decisions.append((name, status.ok, status.value, status.retry_after, status.reset_after))
            for name in limits:
                _value, ts = stored(name, f"run{run}")
                assert isinstance(ts, int)
            runs[(zone, use_tz)] = decisions
    # The trace did cross the whole repeated hour (it ends after 07:00 UTC).
    assert DST_START + sum(steps) > datetime(2026, 11, 1, 7, 0, tzinfo=UTC).timestamp()
    reference = runs[("UTC", True)]
    assert {ok for _, ok, _, _, _ in reference} == {True, False}  # both outcomes are compared
    diffs = {run: sum(a != b for a, b in zip(decisions, reference, strict=True)) for run, decisions in runs.items()}
    assert set(diffs.values()) == {0}, diffs
    figure(f"K6 {settings.DB}: {len(reference)} decisions across the 2026-11-01 repeated hour, diffs vs UTC {diffs}")
