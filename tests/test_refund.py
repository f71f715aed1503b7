"""Giving unused tokens back: the pure arithmetic, then ``limiter.refund`` on each backend.

Expected numbers are worked out by hand. Time is pinned; no test sleeps.
"""

from __future__ import annotations

import pytest
from django.db import transaction
from django.test import override_settings

from django_tokenbucket import limiter
from django_tokenbucket.algorithms import (
    MICRO,
    State,
    fixed_window,
    fixed_window_refund,
    token_bucket,
    token_bucket_refund,
)
from django_tokenbucket.testing import frozen_clock

from .settings import TOKENBUCKET as BASE_SETTINGS

M = MICRO
T = 1_700_000_000_000_000
TB = {"rate": 10 * M, "period": 60 * M, "capacity": 10 * M}  # one token per 6 s
#: Windows of 60 s starting at T.
FW = {"rate": 5 * M, "period": 60 * M, "capacity": 5 * M, "offset": T % (60 * M)}


# -- algorithms ----------------------------------------------------------------------


def test_refund_refills_first_then_adds():
    # 2 tokens at T; 3 s later half a token has come back; 4 more are returned.
    state = token_bucket_refund(State(2 * M, T), T + 3 * M, 4 * M, **TB)
    assert state == State(6_500_000, T + 3 * M)


def test_refund_keeps_the_refill_phase():
    # 1 micro-token per 6 us: after 10 us one is credited and 4 us of progress remain.
    state = token_bucket_refund(State(0, T), T + 10, 1 * M, **TB)
    assert state == State(1 * M + 1, T + 6)
    # The next micro-token arrives 2 us later, as it would have without the refund.
    assert token_bucket(state, T + 12, 0, **TB).value == 1 * M + 2


def test_refund_is_capped_at_capacity():
    assert token_bucket_refund(State(9 * M, T), T, 5 * M, **TB).value == 10 * M
    assert token_bucket_refund(None, T, 1, **TB).value == 10 * M


def test_refund_pays_a_debt_back():
    # Reserved 6 ahead (-6), used 2: returning 4 leaves a debt of 2, paid in 12 s.
    state = token_bucket_refund(State(-6 * M, T), T, 4 * M, **TB)
    assert state == State(-2 * M, T)
    assert token_bucket(state, T, 0, reserve=True, **TB).retry_after == 12 * M


def test_refund_equals_never_having_taken_the_tokens():
    # Take 7, give 3 back later: the same as taking 4, at every later moment.
    took_7 = token_bucket(State(10 * M, T), T, 7 * M, **TB).state
    took_4 = token_bucket(State(10 * M, T), T, 4 * M, **TB).state
    refunded = token_bucket_refund(took_7, T + 5 * M, 3 * M, **TB)
    for later in (T + 5 * M, T + 11 * M, T + 30 * M, T + 90 * M):
        assert token_bucket(refunded, later, 0, **TB).value == token_bucket(took_4, later, 0, **TB).value


def test_refund_after_a_clock_went_back_mints_nothing_extra():
    assert token_bucket_refund(State(2 * M, T), T - 60 * M, 1 * M, **TB) == State(3 * M, T - 60 * M)


def test_fixed_window_refund_goes_to_the_current_window():
    # 1 left in the window [T, T+60); 2 windows later: +10 capped at 5, then +1 stays 5.
    assert fixed_window_refund(State(1 * M, T), T + 130 * M, 1 * M, **FW) == State(5 * M, T + 120 * M)
    # Within the window: 1 + 2 = 3.
    assert fixed_window_refund(State(1 * M, T), T + 30 * M, 2 * M, **FW) == State(3 * M, T)
    # A reservation's debt: -3 with 4 back is 1, in the same window.
    state = fixed_window_refund(State(-3 * M, T), T + 1, 4 * M, **FW)
    assert state == State(1 * M, T)
    assert fixed_window(state, T + 2, 1 * M, **FW).allowed


def test_negative_refund_is_an_error():
    with pytest.raises(ValueError, match="negative"):
        token_bucket_refund(State(0, T), T, -1, **TB)
    with pytest.raises(ValueError, match="negative"):
        fixed_window_refund(State(0, T), T, -1, **FW)


# -- limiter.refund on each backend ----------------------------------------------------

BACKENDS = {
    "database": "django_tokenbucket.backends.database.DatabaseBackend",
    "redis": "django_tokenbucket.backends.redis.RedisBackend",
}
T0 = 1_700_000_000.0


@pytest.fixture(params=sorted(BACKENDS))
def backend(request, transactional_db):
    overrides = {"BACKEND": BACKENDS[request.param]}
    if request.param == "redis":
        overrides.update(request.getfixturevalue("redis_store"))
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **overrides}), frozen_clock(T0) as clock:
        yield clock


def test_limiter_refund_returns_tokens(backend):
    limiter.limit("ten_per_minute", "k", count=7)
    backend.advance(3)  # +0.5
    status = limiter.refund("ten_per_minute", "k", count=2.5)
    assert status.ok and status.value == pytest.approx(6.0) and status.count == 2.5
    assert limiter.get_value("ten_per_minute", "k") == pytest.approx(6.0)
    assert status.reset_after == pytest.approx(24.0)


def test_limiter_refund_is_capped_and_a_fresh_key_stays_full(backend):
    limiter.limit("ten_per_minute", "k", count=1)
    assert limiter.refund("ten_per_minute", "k", count=5).value == 10
    assert limiter.get_value("ten_per_minute", "k") == 10
    assert limiter.refund("ten_per_minute", "never-used", count=3).value == 10
    assert limiter.get_value("ten_per_minute", "never-used") == 10
    # Full means full: the next 10 pass and the 11th does not.
    assert all(limiter.limit("ten_per_minute", "k").ok for _ in range(10))
    assert not limiter.limit("ten_per_minute", "k").ok


def test_limiter_refund_shortens_a_reservation_debt(backend):
    assert limiter.limit("reservable", "k", count=25, reserve=True).retry_after == pytest.approx(15.0)
    status = limiter.refund("reservable", "k", count=10)
    assert status.value == pytest.approx(-5.0) and status.retry_after == pytest.approx(5.0)


def test_limiter_refund_on_a_fixed_window(backend):
    for _ in range(5):
        limiter.limit("window", "k")
    assert limiter.refund("window", "k", count=2).value == 2
    assert limiter.limit("window", "k", count=2).ok
    assert not limiter.limit("window", "k").ok


def test_limiter_refund_of_an_inline_limit(backend):
    config = {"rate": "3/m"}
    limiter.limit("inline", "k", count=3, config=config)
    assert limiter.refund("inline", "k", count=1, config=config).value == 1


@pytest.mark.parametrize("count", [0, -1, float("nan"), "1", 1e-7])
def test_limiter_refund_rejects_bad_counts(backend, count):
    with pytest.raises(ValueError, match="ten_per_minute"):
        limiter.refund("ten_per_minute", "k", count=count)


@pytest.mark.django_db(transaction=True)
def test_database_refund_joins_the_callers_transaction():
    with frozen_clock(T0):
        limiter.limit("ten_per_minute", "tx", count=8)
        with pytest.raises(RuntimeError), transaction.atomic():
            assert limiter.refund("ten_per_minute", "tx", count=5).value == 7
            raise RuntimeError
        assert limiter.get_value("ten_per_minute", "tx") == 2
        with transaction.atomic():
            limiter.refund("ten_per_minute", "tx", count=5)
        assert limiter.get_value("ten_per_minute", "tx") == 7


@pytest.mark.django_db(transaction=True)
def test_a_backend_without_refund_says_so():
    from django_tokenbucket.backends.base import BaseBackend

    class ReadOnly(BaseBackend):
        def decide(self, requests, *, apply):
            raise AssertionError

        def reset(self, config, key):
            raise AssertionError

    with pytest.raises(NotImplementedError, match="ReadOnly cannot return tokens"):
        ReadOnly({}).refund(limiter.resolve("login"), None, 1)  # type: ignore[arg-type]
