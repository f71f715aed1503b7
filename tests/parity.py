"""Parity of a store's own arithmetic (the Redis script, the PostgreSQL function) with
the Python algorithms: generated and hand-picked traces, replayed through both.

A store adapter decides (and refunds) through the real backend at a pinned time and
reads back the state it stored; ``replay`` requires identical decisions, waits and
stored states.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace

from hypothesis import HealthCheck, assume
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

from django_tokenbucket import clock as clock_module
from django_tokenbucket.algorithms import ALGORITHMS, CLOCK_SKEW_TOLERANCE, MAX_AMOUNT, MICRO, State
from django_tokenbucket.backends.base import Outcome, Request, decide_all, row_id
from django_tokenbucket.keys import EncodedKey, encode_key
from django_tokenbucket.limits import FIXED_WINDOW, TOKEN_BUCKET, LimitConfig

T0_US = 1_700_000_000 * MICRO

Decide = Callable[[Sequence[Request], bool], Outcome]
Stored = Callable[[Request], "State | None"]


@dataclass(frozen=True)
class Refund:
    """A step of a trace that gives ``amount`` micro-tokens back to ``key`` (``BaseBackend.refund``)."""

    config: LimitConfig
    key: EncodedKey
    amount: int


Refunder = Callable[[Refund], Outcome]


@contextmanager
def pinned(now_us: int) -> Iterator[None]:
    """Pin the limiter's clock to an exact microsecond (frozen_clock takes float seconds)."""
    previous = clock_module.frozen()
    clock_module.freeze(now_us)
    try:
        yield
    finally:
        clock_module.freeze(previous)


EXTREME_AMOUNTS = [1, 2, 3, 999_999, MICRO, MICRO + 1, 2**31, 2**52 - 1, 2**52, MAX_AMOUNT - 1, MAX_AMOUNT]
EXTREME_PERIODS = [1, 2, 7, MICRO, 60 * MICRO, 86_400 * MICRO, 2**40, 2**52 + 1, 2**53]

amounts = st.one_of(
    st.integers(1, 100).map(lambda n: n * MICRO),  # whole tokens, as most configs have
    st.integers(1, 10**7),
    st.integers(1, MAX_AMOUNT),
    st.sampled_from(EXTREME_AMOUNTS),
)
periods = st.one_of(
    st.integers(1, 3600).map(lambda n: n * MICRO),
    st.integers(1, 10**9),
    st.integers(1, 2**53),
    st.sampled_from(EXTREME_PERIODS),
)
# Time steps: mostly forwards, sometimes backwards, from microseconds to centuries.
steps = st.one_of(
    st.integers(0, 10),
    st.integers(0, 10 * MICRO),
    st.integers(-MICRO, 100 * MICRO),
    # around algorithms.CLOCK_SKEW_TOLERANCE: a lagging clock, and just past it a jump
    st.integers(-CLOCK_SKEW_TOLERANCE - 2, 0),
    st.integers(-(2**50), 2**50),
    st.sampled_from([0, 1, -1, 2**53, -(2**53)]),
)
start_times = st.one_of(st.just(T0_US), st.integers(0, 2**53), st.integers(-(2**53), 2**54))


@st.composite
def limit_configs(draw, name: str) -> LimitConfig:
    # Every kind: a new one is replayed through every port as soon as it exists.
    kind = draw(st.sampled_from(list(ALGORITHMS)))
    return LimitConfig(
        name=name,
        kind=kind,
        rate=draw(amounts),
        period=draw(periods),
        capacity=draw(amounts),
        max_reserved=draw(st.one_of(st.none(), st.just(0), amounts)),
        start=draw(st.one_of(st.none(), st.integers(-(2**53), 2**53))) if ALGORITHMS[kind].phased else None,
    )


@st.composite
def traces(draw, distinct_names: bool = False):
    # Two limits may share a name (and so their rows), as inline configs of one name can,
    # unless ``distinct_names``: then each row is only ever read under the config that wrote it.
    names = draw(
        st.lists(
            st.sampled_from(["p", "q", "a limit with spaces {and braces}"]),
            min_size=1,
            max_size=3,
            unique=distinct_names,
        )
    )
    configs = [draw(limit_configs(name)) for name in names]
    keys = [encode_key(k) for k in ("alice", None, ("tenant", 7))]
    counts = st.one_of(st.integers(1, 3 * MICRO), st.integers(1, MAX_AMOUNT), st.sampled_from(EXTREME_AMOUNTS))
    request = st.builds(
        lambda c, k, count, reserve: Request(configs[c], keys[k], count, reserve),
        st.integers(0, len(configs) - 1),
        st.integers(0, len(keys) - 1),
        counts,
        st.booleans(),
    )
    trace = draw(st.lists(st.tuples(steps, st.lists(request, min_size=1, max_size=3), st.booleans()), max_size=12))
    return draw(start_times), trace


refund_amounts = st.one_of(st.integers(1, 3 * MICRO), st.integers(1, MAX_AMOUNT), st.sampled_from(EXTREME_AMOUNTS))


@st.composite
def refund_traces(draw):
    """``traces`` with refunds before some of their steps, on the rows the trace decides on.

    Names are distinct (``traces``): a store may keep a refunded value above the capacity,
    which reads cap, so its adapter reads the state capped at the capacity of the row's
    one config.
    """
    start, trace = draw(traces(distinct_names=True))
    requests = [request for _, group, _ in trace for request in group]
    if not requests:
        return start, trace
    refund = st.builds(
        lambda request, amount: Refund(request.config, request.key, amount), st.sampled_from(requests), refund_amounts
    )
    with_refunds = []
    for step in trace:
        # Before any decision too: a refund to a key nobody has used.
        if draw(st.booleans()):
            with_refunds.append((draw(steps), draw(refund), True))
        with_refunds.append(step)
    return start, with_refunds


def replay(
    decide: Decide, stored: Stored, start: int, trace, note=lambda label: None, refund: Refunder | None = None
) -> None:
    """Run ``trace`` through decide_all (Python) and the store; require identical results.

    The store starts empty. ``stored(request)`` reads back the state the store holds for
    the request's row (None: no row or key). A ``Refund`` step (``refund_traces``) goes
    through ``refund`` and ``LimitConfig.refund``.
    """
    model: dict = {}
    now = start
    for step, (dt, requests, apply) in enumerate(trace):
        now += dt
        if isinstance(requests, Refund):
            assert refund is not None, "a trace with refunds needs a store's refund"
            model[row_id(_as_request(requests))] = _replay_refund(refund, stored, model, now, step, requests)
            continue
        rows = {row_id(r): model.get(row_id(r)) for r in requests}
        expected, writes = decide_all(requests, rows, now)
        with pinned(now):
            outcome = decide(requests, apply)
        assert outcome.now == now
        # What to write is checked below, as what the store holds.
        assert [replace(d, state=None) for d in outcome.decisions] == [replace(d, state=None) for d in expected], (
            f"step {step}: {requests} at {now}: {outcome.decisions} != {expected}"
        )
        for decision in expected:
            note("allowed" if decision.allowed else "denied")
            numbers = [decision.value, decision.retry_after or 0, decision.full_after, now]
            if any(abs(n) > 2**53 for n in numbers):
                note("a result beyond 2^53")
        if apply:
            model.update(writes)
        for request in requests:
            held = stored(request)
            assert held == model.get(row_id(request)), (
                f"step {step}: {request} holds {held}, not {model.get(row_id(request))}"
            )


def _as_request(refund: Refund) -> Request:
    return Request(refund.config, refund.key, refund.amount)


def _replay_refund(refunder: Refunder, stored: Stored, model: dict, now: int, step: int, refund: Refund) -> State:
    """Refund through the store and ``LimitConfig.refund``; require the same report and state."""
    config, digest, request = refund.config, refund.key.digest, _as_request(refund)
    expected = config.refund(model.get(row_id(request)), now, refund.amount, digest)
    # What BaseBackend.refund reports: the state after it, as a zero-token read that any
    # debt allows.
    reading = replace(config, max_reserved=None).decide(expected, now, 0, digest, reserve=True)
    with pinned(now):
        outcome = refunder(refund)
    assert outcome.now == now
    assert [replace(d, state=None) for d in outcome.decisions] == [replace(reading, state=None)], (
        f"step {step}: {refund} at {now}: {outcome.decisions} != {reading}"
    )
    held = stored(request)
    assert held == expected, f"step {step}: {refund} at {now} holds {held}, not {expected}"
    return expected


PARITY = hypothesis_settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)


@st.composite
def near_ties(draw):
    """A refill that lands within a few micro-tokens of full, with products far past 2^53.

    ``rate * elapsed - deficit * period`` is made exactly ``delta`` (through a modular
    inverse), where a comparison of rounded doubles could not tell the sides apart.
    """
    period = draw(st.integers(2**40, 2**53))
    rate = draw(st.integers(2**40, 2**53).filter(lambda r: math.gcd(r, period) == 1))
    delta = draw(st.integers(-3, 3))
    elapsed = (delta * pow(rate, -1, period)) % period or period
    deficit = (rate * elapsed - delta) // period
    assume(0 < deficit <= MAX_AMOUNT)
    capacity = draw(st.integers(deficit, MAX_AMOUNT))
    config = LimitConfig(name="tie", kind=TOKEN_BUCKET, rate=rate, period=period, capacity=capacity)
    count = draw(st.integers(1, 3))
    trace = [(0, [Request(config, ALICE, deficit)], True), (elapsed, [Request(config, ALICE, count)], True)]
    return draw(st.integers(0, 2**52)), trace


def _config(kind=TOKEN_BUCKET, **fields) -> LimitConfig:
    return LimitConfig(kind=kind, **{"name": "x", "max_reserved": None, "start": None, **fields})


ALICE = encode_key("alice")
ONE_PER_SECOND = _config(rate=MICRO, period=MICRO, capacity=MICRO)

#: Hand-picked traces past 53 bits: (config, [(dt, [(count, reserve), ...]), ...]).
BEYOND_53_BITS = [
    # A fresh bucket dated 0 refills for 1.7e15 µs: rate * elapsed is ~2^106.
    (_config(rate=MAX_AMOUNT, period=1, capacity=MAX_AMOUNT), [(0, [(MAX_AMOUNT, False)])]),
    # Partial refills whose product needs more than 53 bits but whose result does not.
    (
        _config(rate=MAX_AMOUNT - 1, period=2**53, capacity=MAX_AMOUNT),
        [(0, [(MAX_AMOUNT, False)]), (2**40 + 1, [(3, False)]), (12345, [(MAX_AMOUNT, False)])],
    ),
    # Waits beyond 2^53 µs, and debts beyond 2^53 micro-tokens (uncapped reservations).
    (
        _config(rate=1, period=2**53, capacity=MAX_AMOUNT),
        [(0, [(MAX_AMOUNT, True), (MAX_AMOUNT, True), (MAX_AMOUNT, True)]), (7, [(1, False)]), (0, [(1, True)])],
    ),
    (
        _config(FIXED_WINDOW, rate=1, period=2**53, capacity=MAX_AMOUNT, start=5),
        [
            (0, [(MAX_AMOUNT, True)]),
            (2**53, [(MAX_AMOUNT, True), (MAX_AMOUNT - 1, True)]),
            (-(2**54), [(1, False)]),
        ],
    ),
    # Clocks far in the past and backwards jumps larger than 2^53.
    (
        _config(FIXED_WINDOW, rate=3, period=7, capacity=10, start=-(2**53)),
        [(0, [(4, False)]), (-(2**53) - 5, [(11, True)]), (2**54, [(10, False)])],
    ),
    # A product of exactly 2^53 + 1, which a double rounds to 2^53.
    (
        _config(rate=3, period=3, capacity=MAX_AMOUNT),
        [(0, [(MAX_AMOUNT, False)]), ((2**53 + 1) // 3, [(1, False)])],
    ),
    # A window refill one micro-token short of (and then just past) a 2^54 deficit.
    (
        _config(FIXED_WINDOW, rate=3, period=1, capacity=MAX_AMOUNT, start=0),
        [(0, [(MAX_AMOUNT, True), (MAX_AMOUNT, True)]), ((2**54 - 1) // 3, [(1, False)])],
    ),
    (
        _config(FIXED_WINDOW, rate=3, period=1, capacity=MAX_AMOUNT, start=0),
        [(0, [(MAX_AMOUNT, True), (MAX_AMOUNT, True)]), ((2**54 + 2) // 3, [(1, False)])],
    ),
]
BEYOND_53_BITS_IDS = [
    "fresh-huge-refill",
    "wide-product",
    "huge-waits-and-debts",
    "window-huge-debt",
    "far-clocks",
    "product-2^53+1",
    "window-one-short",
    "window-just-past",
]


def beyond_53_bits_trace(config: LimitConfig, trace) -> list:
    return [(dt, [Request(config, ALICE, c, r) for c, r in reqs], True) for dt, reqs in trace]


def window_move_trace() -> list:
    """A window stored under one start and period, decided under others, and a clock gone back."""
    before = _config(FIXED_WINDOW, rate=5 * MICRO, period=10 * MICRO, capacity=8 * MICRO, start=3 * MICRO)
    moved = replace(before, start=7 * MICRO)
    longer = replace(before, period=60 * MICRO, start=None)
    trace = [
        (0, [Request(before, ALICE, 8 * MICRO)], True),
        (4 * MICRO, [Request(moved, ALICE, 1)], True),  # denied: before the moved start
        (1, [Request(moved, ALICE, 5 * MICRO)], True),
        (MICRO, [Request(longer, ALICE, MICRO, True)], True),
        (-30 * MICRO, [Request(before, ALICE, 10 * MICRO)], True),  # and a clock gone back
        (95 * MICRO, [Request(longer, ALICE, 0)], False),
        (MICRO, [Request(moved, ALICE, MICRO)], True),
        (-3 * MICRO, [Request(moved, ALICE, MICRO)], True),  # a lagging clock on a moved window
    ]
    return trace


def clock_skew_trace() -> list:
    """Clocks exactly at, and one microsecond past, CLOCK_SKEW_TOLERANCE behind the stored
    state, on a token bucket and a fixed window: the Lua script is passed the constant and
    the SQL writes it out again, and this holds the three to the same figure."""
    bucket = _config(name="bucket", rate=MICRO, period=MICRO, capacity=10 * MICRO)
    window = _config(FIXED_WINDOW, name="window", rate=5 * MICRO, period=10 * MICRO, capacity=8 * MICRO, start=0)
    trace = []
    for config in (bucket, window):
        trace += [
            (0, [Request(config, ALICE, 8 * MICRO)], True),
            (-CLOCK_SKEW_TOLERANCE, [Request(config, ALICE, 5 * MICRO)], True),  # lagging: decided at ts
            (0, [Request(config, ALICE, MICRO)], True),
            (-1, [Request(config, ALICE, 5 * MICRO)], True),  # past it: a jump, rebased
            (CLOCK_SKEW_TOLERANCE + 1, [Request(config, ALICE, 0)], False),
        ]
    return trace
