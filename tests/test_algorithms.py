"""Worked examples for the pure algorithms (token bucket and fixed window).

Every expected number below is worked out by hand from the documented semantics, not
copied from the implementation. Units: amounts in micro-tokens, times in microseconds.
The properties these examples illustrate are checked in general in test_properties.py.
Last, integer micro-tokens against float seconds over 10^5 requests (RELIABILITY-PLAN K7).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import pytest

from django_tokenbucket.algorithms import (
    MICRO,
    Decision,
    State,
    fixed_window,
    fresh_fixed_window,
    fresh_token_bucket,
    token_bucket,
)
from django_tokenbucket.limits import parse_limit

M = MICRO
#: A moment in 2023, in microseconds since the epoch.
T = 1_700_000_000_000_000

# ---------------------------------------------------------------------------------------
# Token bucket: 10 tokens a minute, capacity 10. One token per 6 s, so one micro-token
# per 6 us.
# ---------------------------------------------------------------------------------------

TB: dict[str, Any] = {"rate": 10 * M, "period": 60 * M, "capacity": 10 * M}
TOKEN = 6 * M  # microseconds to earn one token

# (id, state, now, count, overrides of TB, expected decision)
TOKEN_BUCKET_CASES = [
    # -- fresh bucket and plain consumption --------------------------------------------
    ("fresh-peek", None, T, 0, {}, Decision(True, 10 * M, None, 0, State(10 * M, T))),
    ("fresh-at-epoch", None, 0, 0, {}, Decision(True, 10 * M, None, 0, State(10 * M, 0))),
    ("fresh-take-one", None, T, M, {}, Decision(True, 9 * M, None, TOKEN, State(9 * M, T))),
    # weighted: 3.5 tokens take 21 s to come back
    ("fresh-weighted", None, T, 3_500_000, {}, Decision(True, 6_500_000, None, 21 * M, State(6_500_000, T))),
    ("fresh-take-all", None, T, 10 * M, {}, Decision(True, 0, None, 60 * M, State(0, T))),
    # -- denial: exact retry_after, nothing stored -------------------------------------
    ("empty-denied", State(0, T), T, M, {}, Decision(False, 0, TOKEN, 60 * M, None)),
    ("half-token-denied", State(0, T), T + 3 * M, M, {}, Decision(False, M // 2, 3 * M, 57 * M, None)),
    # 1 us short of a whole token: 999_999 micro-tokens (floor of 999_999.83...)
    (
        "one-us-short",
        State(0, T),
        T + TOKEN - 1,
        M,
        {},
        Decision(False, 999_999, 1, 54 * M + 1, None),
    ),
    ("exactly-refilled", State(0, T), T + TOKEN, M, {}, Decision(True, 0, None, 60 * M, State(0, T + TOKEN))),
    ("weighted-denied", State(2 * M, T), T, 3_500_000, {}, Decision(False, 2 * M, 9 * M, 48 * M, None)),
    # -- refill capped at capacity -------------------------------------------------------
    ("capped", State(4 * M, T), T + 10**9, M, {}, Decision(True, 9 * M, None, TOKEN, State(9 * M, T + 10**9))),
    # -- count=0 reads without consuming -------------------------------------------------
    ("peek-partial", State(4 * M, T), T + 3 * M, 0, {},
        Decision(True, 4_500_000, None, 33 * M, State(4_500_000, T + 3 * M))),
    # -- the refill phase is kept --------------------------------------------------------
    # 9 us earn 1.5 micro-tokens: 1 is credited, and the value is dated back to T+6 (the
    # moment the whole micro-token was complete) so the half is not lost.
    ("phase-kept", State(0, T), T + 9, 1, {}, Decision(True, 0, None, 60 * M - 3, State(0, T + 6))),
    ("phase-used", State(0, T + 6), T + 12, 1, {}, Decision(True, 0, None, 60 * M, State(0, T + 12))),
    # -- reservations ----------------------------------------------------------------------
    (
        "reserve-into-debt",
        None,
        T,
        12 * M,
        {"reserve": True, "max_reserved": 5 * M},
        Decision(True, -2 * M, 2 * TOKEN, 12 * TOKEN, State(-2 * M, T)),
    ),
    (
        "reserve-to-exactly-max",
        State(-2 * M, T),
        T,
        3 * M,
        {"reserve": True, "max_reserved": 5 * M},
        Decision(True, -5 * M, 5 * TOKEN, 15 * TOKEN, State(-5 * M, T)),
    ),
    # one micro-token beyond the cap: wait for that micro-token (6 us)
    (
        "reserve-beyond-max-denied",
        State(-5 * M, T),
        T,
        1,
        {"reserve": True, "max_reserved": 5 * M},
        Decision(False, -5 * M, 6, 15 * TOKEN, None),
    ),
    (
        "reserve-max-zero-is-no-debt",
        State(0, T),
        T,
        1,
        {"reserve": True, "max_reserved": 0},
        Decision(False, 0, 6, 60 * M, None),
    ),
    (
        "reserve-uncapped",
        None,
        T,
        1000 * M,
        {"reserve": True, "max_reserved": None},
        Decision(True, -990 * M, 990 * TOKEN, 1000 * TOKEN, State(-990 * M, T)),
    ),
    (
        "reserve-uncapped-deeper",
        State(-990 * M, T),
        T,
        10**9 * M,
        {"reserve": True},
        Decision(True, -(10**9 + 990) * M, (10**9 + 990) * TOKEN, (10**9 + 1000) * TOKEN, State(-(10**9 + 990) * M, T)),
    ),
    # in debt, without reserve: wait for the debt and the count
    ("debt-no-reserve-denied", State(-2 * M, T), T, 1, {}, Decision(False, -2 * M, 2 * TOKEN + 6, 12 * TOKEN, None)),
    ("debt-paid-back", State(-2 * M, T), T + 2 * TOKEN, 0, {},
        Decision(True, 0, None, 60 * M, State(0, T + 2 * TOKEN))),
    (
        "debt-partly-paid-peek",
        State(-2 * M, T),
        T + TOKEN,
        0,
        {},
        Decision(False, -M, TOKEN, 11 * TOKEN, None),
    ),
    # -- capacity reduced below the stored value clamps (RELIABILITY-PLAN B11) -------------
    ("b11-peek", State(10 * M, T), T, 0, {"capacity": 4 * M}, Decision(True, 4 * M, None, 0, State(4 * M, T))),
    (
        "b11-take-later",
        State(10 * M, T),
        T + M,
        M,
        {"capacity": 4 * M},
        Decision(True, 3 * M, None, TOKEN, State(3 * M, T + M)),
    ),
    # the clamp comes before the count: 10 stored, capacity 4, take 6 -> -2, not 4
    (
        "b11-reserve",
        State(10 * M, T),
        T,
        6 * M,
        {"capacity": 4 * M, "reserve": True, "max_reserved": 5 * M},
        Decision(True, -2 * M, 2 * TOKEN, 6 * TOKEN, State(-2 * M, T)),
    ),
    ("b11-below-unaffected", State(3 * M, T), T, 0, {"capacity": 4 * M},
        Decision(True, 3 * M, None, TOKEN, State(3 * M, T))),
    # -- reconfigured rate applies to the time since the stored state ----------------------
    (
        "rate-doubled",
        State(0, T),
        T + TOKEN,
        M,
        {"rate": 20 * M},
        Decision(True, M, None, 27 * M, State(M, T + TOKEN)),
    ),
    # -- a clock behind the stored time ------------------------------------------------------
    # Up to CLOCK_SKEW_TOLERANCE (5 s) behind: a host whose clock lags another's. It decides
    # at the stored time (no credit, nothing moves back), and its waits are longer by the lag.
    (
        "clock-lags-allowed",
        State(2 * M, T),
        T - 4 * M,
        M,
        {},
        Decision(True, M, None, 9 * TOKEN + 4 * M, State(M, T)),
    ),
    # denied: one token (6 s) after T is 11 s away on a clock 5 s behind; nothing is stored
    ("clock-lags-denied", State(0, T), T - 5 * M, M, {}, Decision(False, 0, TOKEN + 5 * M, 65 * M, None)),
    # the phase (T+6 holds 0.5 micro-token's worth at T+9) is kept: T+12 is 7 us away
    ("clock-lags-1us", State(0, T + 6), T + 5, 1, {}, Decision(False, 0, 7, 60 * M + 1, None)),
    # full already: a zero wait stays zero
    (
        "clock-lags-b11",
        State(10 * M, T),
        T - 1,
        0,
        {"capacity": 4 * M},
        Decision(True, 4 * M, None, 0, State(4 * M, T)),
    ),
    # Further back: the clock jumped. No credit, and no lockout: the refill restarts from now.
    (
        "clock-back-allowed",
        State(5 * M, T),
        T - 3600 * M,
        M,
        {},
        Decision(True, 4 * M, None, 6 * TOKEN, State(4 * M, T - 3600 * M)),
    ),
    # denied: the wait is one token (6 s), not the hour lost; the rebased state is stored
    (
        "clock-back-denied-rebased",
        State(0, T),
        T - 3600 * M,
        M,
        {},
        Decision(False, 0, TOKEN, 60 * M, State(0, T - 3600 * M)),
    ),
    # 1 us past the tolerance is a jump
    (
        "clock-back-past-tolerance",
        State(0, T),
        T - 5 * M - 1,
        M,
        {},
        Decision(False, 0, TOKEN, 60 * M, State(0, T - 5 * M - 1)),
    ),
]


@pytest.mark.parametrize(
    "state, now, count, overrides, expected",
    [case[1:] for case in TOKEN_BUCKET_CASES],
    ids=[case[0] for case in TOKEN_BUCKET_CASES],
)
def test_token_bucket_worked_examples(
    state: State | None, now: int, count: int, overrides: dict[str, Any], expected: Decision
) -> None:
    assert token_bucket(state, now, count, **{**TB, **overrides}) == expected


def test_fresh_token_bucket_is_full_since_the_epoch() -> None:
    assert fresh_token_bucket(10 * M) == State(10 * M, 0)
    for now in (0, 1, T, 2**62):
        assert token_bucket(None, now, 0, **TB) == token_bucket(fresh_token_bucket(10 * M), now, 0, **TB)


@pytest.mark.parametrize("count", [M, 3 * M, 3_000_001, 10 * M])
def test_fresh_bucket_admits_up_to_capacity_then_denies(count: int) -> None:
    state: State | None = None
    admitted = 0
    while True:
        decision = token_bucket(state, T, count, **TB)
        if not decision.allowed:
            break
        admitted += count
        state = decision.state
    assert admitted == 10 * M // count * count
    # denied: exactly the time for the missing micro-tokens
    missing = count - (10 * M - admitted)
    assert decision.retry_after == missing * 6
    assert decision.state is None


def test_peek_does_not_consume() -> None:
    state = State(3 * M, T)
    first = token_bucket(state, T + 5, 0, **TB)
    second = token_bucket(state, T + 5, 0, **TB)
    assert first == second
    assert first.value == 3 * M


# ---------------------------------------------------------------------------------------
# The refill phase: consuming at fractional-token times never loses the partial token.
# ---------------------------------------------------------------------------------------


def test_phase_kept_exactly_when_the_rate_divides_the_period() -> None:
    # 1.5 micro-tokens every 9 us; 100 steps of 1 micro-token leave exactly 50.
    state = State(0, T)
    now = T
    for _ in range(100):
        now += 9
        decision = token_bucket(state, now, 1, **TB)
        assert decision.allowed
        state = decision.state
    assert token_bucket(state, now, 0, **TB).value == 50


@pytest.mark.parametrize(
    "rate, period, step, count, steps",
    [
        (10 * M, 60 * M, 9, 1, 200),  # 1/6 micro-token per us: representable, no loss
        (7, 10, 2, 1, 300),  # 0.7 per us: 1.4 per step, 0.4 of which is not whole us
        (7, 10, 3, 2, 300),
        (3, 7, 5, 1, 300),
        (M, 3 * M, 5, 1, 300),
        (999_999, 1_000_000, 1, 0, 50),  # count 0 stored each step: pure refill
        (13 * M, 86_400 * M, 7_777, 1, 100),
        (10**12, M, 1, 10**6 - 1, 200),  # a million micro-tokens per us
    ],
)
def test_fractional_steps_lose_under_one_micro_token_per_step(
    rate: int, period: int, step: int, count: int, steps: int
) -> None:
    capacity = 10**15  # never reached
    state = State(0, T)
    now = T
    exact = Fraction(0)
    for i in range(1, steps + 1):
        now += step
        exact += Fraction(rate * step, period)
        decision = token_bucket(state, now, count, rate=rate, period=period, capacity=capacity)
        if decision.allowed:
            state = decision.state
            exact -= count
        # what the stored state holds, phase included
        held = state.value + Fraction(rate * (now - state.ts), period)
        assert held <= exact  # never mints
        assert exact - held < i  # under 1 micro-token per step
        assert exact - held < Fraction(rate, period) * i  # under 1 us of refill per step


def test_phase_loss_example_seven_per_ten_us() -> None:
    # 0.7 micro-tokens per us. 2 us earn 1.4: one is credited, and the 0.4 left cannot
    # be kept as a whole number of microseconds (1 us is worth 0.7), so it is lost.
    decision = token_bucket(State(0, T), T + 2, 0, rate=7, period=10, capacity=100)
    assert decision.state == State(1, T + 2)
    # 3 us earn 2.1: two credited; 0.1 is less than 1 us's worth, lost.
    assert token_bucket(State(0, T), T + 3, 0, rate=7, period=10, capacity=100).state == State(2, T + 3)
    # 4 us earn 2.8: two credited, 0.8 is kept as 1 us (0.7), losing 0.1.
    assert token_bucket(State(0, T), T + 4, 0, rate=7, period=10, capacity=100).state == State(2, T + 3)


# ---------------------------------------------------------------------------------------
# Fixed window: 5 tokens per 10 s, rolling over up to 8, windows starting at 3 s.
# ---------------------------------------------------------------------------------------

FW: dict[str, Any] = {"rate": 5 * M, "period": 10 * M, "capacity": 8 * M, "offset": 3 * M}
#: The start of a window: 3 s past a multiple of 10 s.
W = T + 3 * M
assert (W - 3 * M) % (10 * M) == 0

FIXED_WINDOW_CASES = [
    ("fresh-peek", None, W + M, 0, {}, Decision(True, 8 * M, None, 0, State(8 * M, W))),
    ("fresh-take-one", None, W + M, M, {}, Decision(True, 7 * M, None, 9 * M, State(7 * M, W))),
    # 8 gone: 5 back at the next window, full (8) at the one after
    ("fresh-take-all", None, W + M, 8 * M, {}, Decision(True, 0, None, 19 * M, State(0, W))),
    ("fresh-at-window-start", None, W, 0, {}, Decision(True, 8 * M, None, 0, State(8 * M, W))),
    ("fresh-last-us", None, W - 1, 0, {}, Decision(True, 8 * M, None, 0, State(8 * M, W - 10 * M))),
    # -- denial within the window: retry at the next window, nothing stored --------------
    ("denied-last-us", State(0, W), W + 10 * M - 1, 1, {}, Decision(False, 0, 1, 10 * M + 1, None)),
    ("denied-mid", State(3 * M, W), W + 4 * M, 4 * M, {}, Decision(False, 3 * M, 6 * M, 6 * M, None)),
    ("next-window", State(0, W), W + 10 * M, 5 * M, {}, Decision(True, 0, None, 20 * M, State(0, W + 10 * M))),
    ("next-window-one-too-many", State(0, W), W + 10 * M, 5 * M + 1, {}, Decision(False, 5 * M, 10 * M, 10 * M, None)),
    # -- rollover up to capacity ------------------------------------------------------------
    ("rollover", State(2 * M, W), W + 10 * M, 7 * M, {}, Decision(True, 0, None, 20 * M, State(0, W + 10 * M))),
    ("rollover-capped", State(2 * M, W), W + 25 * M, 8 * M, {}, Decision(True, 0, None, 15 * M, State(0, W + 20 * M))),
    ("peek", State(2 * M, W), W + 5 * M, 0, {}, Decision(True, 2 * M, None, 15 * M, State(2 * M, W))),
    # -- reservations -------------------------------------------------------------------------
    (
        "reserve-into-debt",
        State(2 * M, W),
        W + 5 * M,
        6 * M,
        {"reserve": True, "max_reserved": 10 * M},
        Decision(True, -4 * M, 5 * M, 25 * M, State(-4 * M, W)),
    ),
    (
        "reserve-beyond-max-denied",
        State(-4 * M, W),
        W + 5 * M,
        M + 1,
        {"reserve": True, "max_reserved": 5 * M},
        Decision(False, -4 * M, 5 * M, 25 * M, None),
    ),
    (
        "reserve-uncapped",
        None,
        W,
        58 * M,
        {"reserve": True},
        Decision(True, -50 * M, 100 * M, 120 * M, State(-50 * M, W)),
    ),
    # -- capacity reduced below the stored value clamps (B11) -----------------------------
    ("b11", State(8 * M, W), W + 5 * M, M, {"capacity": 3 * M}, Decision(True, 2 * M, None, 5 * M, State(2 * M, W))),
    ("b11-peek", State(8 * M, W), W + 5 * M, 0, {"capacity": 3 * M}, Decision(True, 3 * M, None, 0, State(3 * M, W))),
    # -- a clock behind the stored window ------------------------------------------------------
    # 25 s back (past the 5 s tolerance: a jump) lands 5 s into the window starting 30 s
    # before W: the wait is 5 s, and the rebased state (on the same window phase) is stored.
    ("clock-back-denied", State(0, W), W - 25 * M, M, {}, Decision(False, 0, 5 * M, 15 * M, State(0, W - 30 * M))),
    ("clock-back-boundary", State(3 * M, W), W - 10 * M, M, {},
        Decision(True, 2 * M, None, 20 * M, State(2 * M, W - 10 * M))),
    # Within the tolerance, a lagging clock decides in the stored window: its state never
    # moves to the window before (the next window would credit it again), and its waits
    # are longer by the lag.
    ("clock-lags-allowed", State(3 * M, W), W - 1, M, {},
        Decision(True, 2 * M, None, 20 * M + 1, State(2 * M, W))),
    ("clock-lags-denied", State(0, W), W - 2 * M, M, {}, Decision(False, 0, 12 * M, 22 * M, None)),
    ("clock-lags-b11", State(8 * M, W), W - 1, 0, {"capacity": 3 * M},
        Decision(True, 3 * M, None, 0, State(3 * M, W))),
    # -- a state stored under another start or period moves onto the configured windows ---
    # start moved from 3 s to 7 s: the window starting at W + 4 s credits 5 tokens and
    # becomes the stored one; before it, the stored window is still the current one.
    ("moved-start-before-boundary", State(0, W), W + 4 * M - 1, 1, {"offset": 7 * M},
        Decision(False, 0, 1, 10 * M + 1, None)),
    ("moved-start-at-boundary", State(0, W), W + 4 * M, 5 * M, {"offset": 7 * M},
        Decision(True, 0, None, 20 * M, State(0, W + 4 * M))),
    # start moved back from 3 s to 1 s: the stored window (from W) began after the
    # configured one holding now (from W - 2 s); the next start, W + 8 s, credits.
    ("moved-start-earlier", State(0, W), W + 5 * M, M, {"offset": M},
        Decision(False, 0, 3 * M, 13 * M, None)),
    ("moved-start-earlier-next", State(0, W), W + 8 * M, M, {"offset": M},
        Decision(True, 4 * M, None, 10 * M, State(4 * M, W + 8 * M))),
    # period 10 s -> 60 s, windows now 3 s past each minute (W is 23 s past one): nothing
    # is credited until the next of those, W + 40 s, rather than every 10 s from W.
    ("longer-period", State(0, W), W + 15 * M, 1, {"period": 60 * M},
        Decision(False, 0, 25 * M, 85 * M, None)),
]


@pytest.mark.parametrize(
    "state, now, count, overrides, expected",
    [case[1:] for case in FIXED_WINDOW_CASES],
    ids=[case[0] for case in FIXED_WINDOW_CASES],
)
def test_fixed_window_worked_examples(
    state: State | None, now: int, count: int, overrides: dict[str, Any], expected: Decision
) -> None:
    assert fixed_window(state, now, count, **{**FW, **overrides}) == expected


@pytest.mark.parametrize(
    "offset, expected_ts",
    [(0, 0), (1, 1), (3 * M, 3 * M), (13 * M, 3 * M), (-7 * M, 3 * M), (10 * M - 1, 10 * M - 1), (10 * M, 0)],
)
def test_fresh_fixed_window_is_full_and_aligned(offset: int, expected_ts: int) -> None:
    assert fresh_fixed_window(8 * M, 10 * M, offset) == State(8 * M, expected_ts)


@pytest.mark.parametrize("offset", [0, 1, 3 * M, 13 * M, -7 * M, 10 * M - 1, 123_456_789])
@pytest.mark.parametrize("delta", [0, 1, 5 * M, 10 * M - 1, 10 * M, 10 * M + 1, 10**12 + 7])
def test_fixed_window_aligned_on_offset(offset: int, delta: int) -> None:
    period = 10 * M
    config = {**FW, "offset": offset}
    now = T + delta
    state: State | None = None
    for count in (M, 2 * M):
        decision = fixed_window(state, now, count, **config)
        assert decision.allowed
        assert decision.state is not None
        start = decision.state.ts
        assert (start - offset) % period == 0
        assert start <= now < start + period
        state = decision.state
    # the next window starts exactly at start + period
    assert fixed_window(state, start + period - 1, 0, **config).value == 5 * M
    assert fixed_window(state, start + period, 0, **config).value == 8 * M


# ---------------------------------------------------------------------------------------
# A denial never changes anything (unless the clock went back).
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "state, now, count",
    [
        (State(0, T), T, 1),
        (State(0, T), T + TOKEN - 1, M),
        (State(-5 * M, T), T + 5 * TOKEN, M),  # debt paid, the token not yet
    ],
)
def test_token_bucket_denial_stores_nothing(state: State, now: int, count: int) -> None:
    decision = token_bucket(state, now, count, **TB)
    assert not decision.allowed
    assert decision.state is None
    assert decision.retry_after is not None and decision.retry_after > 0


@pytest.mark.parametrize(
    "state, now, count",
    [(State(0, W), W, 1), (State(0, W), W + 10 * M - 1, M), (State(-4 * M, W), W + 10 * M, 2 * M)],
)
def test_fixed_window_denial_stores_nothing(state: State, now: int, count: int) -> None:
    decision = fixed_window(state, now, count, **FW)
    assert not decision.allowed
    assert decision.state is None


# ---------------------------------------------------------------------------------------
# Fixed window: the boundary burst (2L within 2 us) and nothing more within a window.
# ---------------------------------------------------------------------------------------


def test_fixed_window_boundary_burst_reaches_two_limits() -> None:
    config = {**FW, "capacity": 5 * M}  # capacity == rate == L
    first = fixed_window(None, W + 10 * M - 1, 5 * M, **config)
    assert first.allowed
    assert not fixed_window(first.state, W + 10 * M - 1, 1, **config).allowed
    second = fixed_window(first.state, W + 10 * M, 5 * M, **config)
    assert second.allowed  # 10 tokens within 2 us: the documented 2L burst
    assert not fixed_window(second.state, W + 20 * M - 1, 1, **config).allowed


def test_clock_back_no_lockout_examples() -> None:
    # A week back: the first token comes after 6 s, not a week.
    state = State(0, T)
    back = T - 7 * 86_400 * M
    denied = token_bucket(state, back, M, **TB)
    assert not denied.allowed and denied.retry_after == TOKEN
    assert denied.state == State(0, back)
    assert not token_bucket(denied.state, back + TOKEN - 1, M, **TB).allowed
    assert token_bucket(denied.state, back + TOKEN, M, **TB).allowed
    # the same for a fixed window: the next window on the stored phase
    denied = fixed_window(State(0, W), W - 7 * 86_400 * M + 2 * M, M, **FW)
    assert not denied.allowed and denied.retry_after == 8 * M
    assert fixed_window(denied.state, W - 7 * 86_400 * M + 10 * M, M, **FW).allowed


# ---------------------------------------------------------------------------------------
# K7: precision
# ---------------------------------------------------------------------------------------


def figure(line: str) -> None:
    print(f"\n{line}")


T0 = T / MICRO  # seconds, for the float control
K7_REQUESTS = 100_000  # 10^6 takes about 6 s of pure Python; the arithmetic is the same


def test_k7_integer_micro_tokens_do_not_drift():
    limit = parse_limit("k7", {"rate": 1000, "period": 1, "capacity": 1})  # a token every 1 ms
    digest = "0" * 64
    state, now, admitted = None, int(T0) * MICRO, 0
    for _ in range(K7_REQUESTS):
        now += 1000  # exactly 1 ms
        decision = limit.decide(state, now, MICRO, digest)
        if decision.allowed:
            admitted += 1
            state = decision.state
    assert admitted == K7_REQUESTS

    # Negative control: the same bucket in float seconds loses requests to rounding.
    tokens, ts, now_s, float_admitted = 1.0, T0, T0, 0
    for _ in range(K7_REQUESTS):
        now_s += 0.001
        tokens, ts = min(1.0, tokens + (now_s - ts) * 1000.0), now_s
        if tokens >= 1.0:
            tokens -= 1.0
            float_admitted += 1
    assert float_admitted < K7_REQUESTS
    figure(
        f"K7: {K7_REQUESTS} requests 1 ms apart at r=1000/s, C=1: admitted {admitted} (integer µs), {float_admitted} (float seconds)"
    )
