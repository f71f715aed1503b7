"""The rate-limit arithmetic, free of I/O.

Every backend locks a limit's state, hands it to a function here with the store's
current time, and writes back what the function says. Keeping the math here, in
integers, is what lets the database path, the Redis script and the tests agree to the
last micro-token.

Units: amounts are micro-tokens (millionths of a token) and times are microseconds
since the Unix epoch, both as ``int``. Integers never drift: a refill is rounded down,
so the arithmetic can lose a micro-token at worst and never mints one.

The same arithmetic is written again where a store computes: ``PORTS`` names each copy,
the kinds and operations it implements, and the tests that replay it against this
module. A new kind needs every one of these:

* an ``Algorithm`` in ``ALGORITHMS``: ``decide``, ``refund``, ``fresh``, ``refill_time``,
  ``denied_later`` and ``denial_holds`` (what the deny cache answers, and for how long,
  held to ``decide`` by tests/test_properties.py), ``phased``, and a ``code`` no other
  kind has;
* in ``backends/redis/lua/decide.lua``, a branch on its code in the common path (which
  leaves a code it does not know to the general path) and in the general path (which
  refuses one). The
  Redis backend refunds with that branch, as a decision of ``-amount`` under uncapped
  reservations, so it must give ``refund``'s state too (its value may exceed the
  capacity, which every read caps);
* in ``backends/database/sql/postgresql_v3.sql``, a branch in ``django_tokenbucket_single_v3`` and in
  ``django_tokenbucket_step_v3``: each names one kind and decides any other as the kind
  of its ELSE. Changed SQL is a new version of the file, with its own migration and
  ``backends.database.postgresql.FUNCTION_VERSION`` (see the file's head);
* in ``backends.database.filters.at_least_q``, an expression of its value now if it is
  neither a continuous refill (not ``phased``) nor whole windows of ``rate`` each
  (``phased``): the filter picks between those two by ``phased`` alone;
* its name in the ``kinds`` of every port but the admission statement, which only token
  buckets reach (its ``gate``).

tests/test_ports.py checks that the script and the SQL have a branch for every kind
and that ``PORTS`` is true to the files, and replays the ports that
tests/test_redis.py and tests/test_pg_fast_path.py do not; the traces of tests/parity.py
draw every kind of ``ALGORITHMS``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

__all__ = [
    "ALGORITHMS",
    "CLOCK_SKEW_TOLERANCE",
    "FIXED_WINDOW",
    "MAX_AMOUNT",
    "MICRO",
    "PORTS",
    "TOKEN_BUCKET",
    "Algorithm",
    "Decision",
    "Port",
    "State",
    "algorithm_named",
    "fixed_window",
    "fixed_window_denial_holds",
    "fixed_window_denied_later",
    "fixed_window_refund",
    "fresh_fixed_window",
    "fresh_token_bucket",
    "lowest_value",
    "token_bucket",
    "token_bucket_denial_holds",
    "token_bucket_denied_later",
    "token_bucket_refund",
    "token_bucket_taken",
]

#: Amounts are stored in millionths of a token, times in microseconds.
MICRO = 1_000_000

#: Largest amount (in micro-tokens) a limit may hold: every stored number stays exact
#: in an IEEE double, which is all that Redis' Lua has.
MAX_AMOUNT = 2**53

#: How far (in microseconds) a clock may read behind a limit's stored time and still be
#: taken for a host whose clock lags another's rather than a clock set back. Such a
#: decision is made at the stored time: the state never goes back, so hosts with skewed
#: clocks cannot credit their skew again each time they take turns. A clock further back
#: is taken to have jumped, and the state follows it rather than locking everyone out
#: until it catches up. Keep app servers' clocks well within this (NTP keeps them within
#: milliseconds), or use ``CLOCK = "store"``. The Redis backend passes it to
#: ``backends/redis/lua/decide.lua`` with every call, and the PostgreSQL functions take it as an argument.
CLOCK_SKEW_TOLERANCE = 5 * MICRO


@dataclass(frozen=True)
class State:
    """The whole stored state of one limit: ``value`` micro-tokens at time ``ts``."""

    value: int
    ts: int


@dataclass(frozen=True)
class Decision:
    """What one call decides.

    ``value`` is the amount after this call when allowed, the amount now when denied.
    ``retry_after`` is, when denied, the time until the same call would succeed;
    when allowed with a debt (a reservation), the time until the debt is paid;
    otherwise ``None``. ``full_after`` is the time until the limit is full again.
    ``state`` is what the backend must store, or ``None`` when nothing changes.
    """

    allowed: bool
    value: int
    retry_after: int | None
    full_after: int
    state: State | None


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def _lagging_clock_time(now: int, state: State) -> int | None:
    """Return the time to decide at when ``now`` lags the stored state, else None."""
    if state.ts - CLOCK_SKEW_TOLERANCE <= now < state.ts:
        return state.ts
    return None


def _waits_from(decision: Decision, lag: int) -> Decision:
    """Return ``decision``, made ``lag`` microseconds ahead of the caller's clock, with its
    waits on the caller's clock, which must run that much longer to see them end. What
    holds already (a zero wait) holds on any clock."""
    return replace(
        decision,
        retry_after=decision.retry_after + lag if decision.retry_after else decision.retry_after,
        full_after=decision.full_after + lag if decision.full_after else 0,
    )


def lowest_value(reserve: bool, max_reserved: int | None) -> int | None:
    """Return how low a call may take the value, or None when reservations are uncapped."""
    if not reserve:
        return 0
    return None if max_reserved is None else -max_reserved


def fresh_token_bucket(capacity: int) -> State:
    """Return the state of a bucket nobody has used: full since the epoch.

    Being independent of the time, it lets a missing row or key mean "fresh", and an
    idle bucket be deleted once it would read as full.
    """
    return State(capacity, 0)


def fresh_fixed_window(capacity: int, period: int, offset: int) -> State:
    """Return the state of an unused fixed window: full, aligned on ``offset``."""
    return State(capacity, offset % period)


def token_bucket(
    state: State | None,
    now: int,
    count: int,
    *,
    rate: int,
    period: int,
    capacity: int,
    reserve: bool = False,
    max_reserved: int | None = None,
    offset: int = 0,
) -> Decision:
    """Decide whether ``count`` micro-tokens may be taken from a token bucket at ``now``.

    The bucket gains ``rate`` micro-tokens per ``period`` microseconds, continuously,
    up to ``capacity``. With ``reserve`` the value may go below zero (a debt) down to
    ``-max_reserved`` (unbounded when ``max_reserved`` is None). ``count`` may be 0 to
    read the value without taking anything. ``offset`` is unused (a bucket has no
    windows); it is accepted so that every kind is called alike (``Algorithm``).
    """
    if state is None:
        state = fresh_token_bucket(capacity)
    decided_at = _lagging_clock_time(now, state)
    if decided_at is not None:
        decision = token_bucket(
            state,
            decided_at,
            count,
            rate=rate,
            period=period,
            capacity=capacity,
            reserve=reserve,
            max_reserved=max_reserved,
        )
        return _waits_from(decision, decided_at - now)
    clock_went_back = now < state.ts
    # A clock that jumped backwards credits nothing for the lost time, and measuring the
    # refill from ``now`` keeps it from locking anybody out until it catches up.
    since = now if clock_went_back else state.ts
    stored = min(state.value, capacity)
    elapsed = now - since

    gained = rate * elapsed
    credited = gained // period
    if stored + credited >= capacity:
        value, value_ts = capacity, now
    else:
        # Keep the fraction of a micro-token already earned (the refill phase) by
        # dating the new value back by the time that earned it.
        value, value_ts = stored + credited, now - (gained - credited * period) // rate

    lowest = lowest_value(reserve, max_reserved)
    after = value - count
    if lowest is None or after >= lowest:
        return token_bucket_taken(State(after, value_ts), now, rate=rate, period=period, capacity=capacity)
    # Measured from the stored state, not the re-dated one, so the wait is exact.
    return Decision(
        allowed=False,
        value=value,
        retry_after=_time_to_reach(count + lowest, stored, since, now, rate, period),
        full_after=_time_to_reach(capacity, stored, since, now, rate, period),
        state=State(stored, now) if clock_went_back else None,
    )


def token_bucket_taken(taken: State, now: int, *, rate: int, period: int, capacity: int) -> Decision:
    """Return the admission at ``now`` whose bucket was left at ``taken`` (its value after
    the count was taken, dated as ``token_bucket`` dates it).

    Everything an admission reports follows from the state it stores: the PostgreSQL
    fast path's admission statement returns that state, and this completes the decision.
    """
    after, value_ts = taken.value, taken.ts
    return Decision(
        allowed=True,
        value=after,
        retry_after=_time_to_reach(0, after, value_ts, now, rate, period) if after < 0 else None,
        full_after=_time_to_reach(capacity, after, value_ts, now, rate, period),
        state=taken,
    )


def _time_to_reach(target: int, from_value: int, from_ts: int, now: int, rate: int, period: int) -> int:
    """Microseconds from ``now`` until a bucket at ``from_value`` on ``from_ts`` holds ``target``."""
    if from_value >= target:
        return 0
    return from_ts + _ceil_div((target - from_value) * period, rate) - now


def fixed_window(
    state: State | None,
    now: int,
    count: int,
    *,
    rate: int,
    period: int,
    capacity: int,
    offset: int,
    reserve: bool = False,
    max_reserved: int | None = None,
) -> Decision:
    """Decide whether ``count`` micro-tokens may be taken from a fixed window at ``now``.

    Windows of ``period`` microseconds start at ``offset`` modulo ``period``; each new
    window adds ``rate`` micro-tokens, and unused ones roll over up to ``capacity``.
    ``state.ts`` is the start of the window the value belongs to.
    """
    if state is None:
        state = fresh_fixed_window(capacity, period, offset)
    decided_at = _lagging_clock_time(now, state)
    if decided_at is not None:
        decision = fixed_window(
            state,
            decided_at,
            count,
            rate=rate,
            period=period,
            capacity=capacity,
            offset=offset,
            reserve=reserve,
            max_reserved=max_reserved,
        )
        return _waits_from(decision, decided_at - now)
    clock_went_back = now < state.ts
    # Python's modulo is never negative, so this is the start, at or before ``now``, of
    # the configured window holding ``now``.
    window_start = now - (now - offset) % period
    # Every window start after the stored one credits ``rate``. Counting window starts
    # rather than whole periods since ``state.ts`` puts a state stored under another
    # ``period`` or ``start`` on the configured windows from its next call. A clock that
    # jumped back finds none (``window_start <= now < state.ts``): it mints nothing, and the
    # state is rebased onto ``window_start`` so nobody waits for the clock to catch up.
    windows = max(0, _ceil_div(window_start - state.ts, period))
    value = min(capacity, state.value + windows * rate)

    def time_to_reach(target: int, from_value: int) -> int:
        if from_value >= target:
            return 0
        return window_start + _ceil_div(target - from_value, rate) * period - now

    lowest = lowest_value(reserve, max_reserved)
    after = value - count
    if lowest is None or after >= lowest:
        return Decision(
            allowed=True,
            value=after,
            retry_after=time_to_reach(0, after) if after < 0 else None,
            full_after=time_to_reach(capacity, after),
            state=State(after, window_start),
        )
    return Decision(
        allowed=False,
        value=value,
        retry_after=time_to_reach(count + lowest, value),
        full_after=time_to_reach(capacity, value),
        state=State(min(state.value, capacity), window_start) if clock_went_back else None,
    )


def token_bucket_refund(
    state: State | None, now: int, amount: int, *, rate: int, period: int, capacity: int, offset: int = 0
) -> State:
    """Return a token bucket's state once ``amount`` micro-tokens are given back at ``now``.

    The bucket first refills as ``token_bucket`` would, keeping its refill phase, then
    gains ``amount``, capped at ``capacity``. Refilling before adding makes a refund
    exact: the result is the state the bucket would have if the returned tokens had
    never been taken, since both sides reach the cap in the same way. ``offset`` is
    unused, as in ``token_bucket``.
    """
    if amount < 0:
        raise ValueError(f"a refund must not be negative, not {amount!r}")
    refilled = token_bucket(state, now, 0, rate=rate, period=period, capacity=capacity, reserve=True)
    assert refilled.state is not None  # uncapped reservations always allow a zero count
    return State(min(capacity, refilled.value + amount), refilled.state.ts)


def fixed_window_refund(
    state: State | None, now: int, amount: int, *, rate: int, period: int, capacity: int, offset: int
) -> State:
    """Return a fixed window's state once ``amount`` micro-tokens are given back at ``now``.

    The tokens go to the current window (after the windows that passed since the stored
    one are credited), capped at ``capacity``.
    """
    if amount < 0:
        raise ValueError(f"a refund must not be negative, not {amount!r}")
    current = fixed_window(
        state, now, 0, rate=rate, period=period, capacity=capacity, offset=offset, reserve=True
    )
    assert current.state is not None  # uncapped reservations always allow a zero count
    return State(min(capacity, current.value + amount), current.state.ts)


def _token_bucket_fresh(capacity: int, period: int, offset: int) -> State:
    return fresh_token_bucket(capacity)


def _token_bucket_refill_time(amount: int, rate: int, period: int) -> int:
    return _ceil_div(amount * period, rate)


def _fixed_window_refill_time(amount: int, rate: int, period: int) -> int:
    return _ceil_div(amount, rate) * period


def token_bucket_denied_later(
    value: int,
    retry_after: int,
    denied_count: int,
    count: int,
    elapsed: int,
    *,
    rate: int,
    period: int,
    capacity: int,
    exact: bool,
) -> tuple[int, int] | None:
    """Return (value, retry_after) of a call of ``count`` made ``elapsed`` µs after a denial
    of ``denied_count`` (``count`` ≥ it) that said ``value`` and ``retry_after``, with no
    change to the bucket meanwhile but refill; None when ``exact`` is asked and the answer
    would be a micro-token off.

    A denial changes nothing, so the bucket only refills: its value grows by the rate, and
    the wait, measured to a fixed moment, shrinks by ``elapsed`` and grows by the refill
    time of the larger count. The store keeps a fraction of a micro-token (the refill
    phase) that its answer rounds away, so this may say a micro-token less, and a larger
    count's wait a microsecond more, than the store would; ``exact`` (a pinned clock, where
    the store's time is known exactly) answers only what it extrapolates exactly.
    """
    gained = rate * elapsed
    more = count - denied_count
    if exact and (gained % period or more * period % rate):
        return None
    extra = _token_bucket_refill_time(more, rate, period) if more else 0
    return min(capacity, value + gained // period), retry_after + extra - elapsed


def token_bucket_denial_holds(
    value: int, retry_after: int, count: int, now: int, *, rate: int, period: int, offset: int
) -> int | None:
    """Return for how long (µs) a denial of ``count`` decided at ``now`` says what later
    calls get (``token_bucket_denied_later``): until its ``retry_after``. None when it cannot
    be carried forward: a wait longer than the refill of what is missing means the store
    decided at a later stored time (a clock behind the bucket's last write)."""
    if retry_after > _token_bucket_refill_time(count - value, rate, period):
        return None
    return retry_after


def fixed_window_denied_later(
    value: int,
    retry_after: int,
    denied_count: int,
    count: int,
    elapsed: int,
    *,
    rate: int,
    period: int,
    capacity: int,
    exact: bool,
) -> tuple[int, int] | None:
    """``token_bucket_denied_later`` for a fixed window, within the window of the denial
    (the caller's bound): its value is constant until the next window starts, and a larger
    count waits whole windows more."""
    windows_more = _ceil_div(count - value, rate) - _ceil_div(denied_count - value, rate)
    return value, retry_after + windows_more * period - elapsed


def fixed_window_denial_holds(
    value: int, retry_after: int, count: int, now: int, *, rate: int, period: int, offset: int
) -> int | None:
    """``token_bucket_denial_holds`` for a fixed window: until its ``retry_after`` or the
    end of the window it was decided in, whichever is first (the next one refills)."""
    next_window = now - (now - offset) % period + period
    return min(retry_after, next_window - now)


@dataclass(frozen=True)
class Algorithm:
    """One kind of limit: its arithmetic, and what the rest of the package needs to know of it.

    Everything in Python that depends on a limit's kind asks its ``Algorithm``
    (``LimitConfig.algorithm``) instead of comparing kind names. The stores' copies of the
    arithmetic (``PORTS``) cannot: a new kind is an entry in ``ALGORITHMS`` plus what the
    module docstring lists for them.
    """

    #: The name users write in ``"kind"`` (and the admin shows).
    name: str
    #: Other spellings accepted in ``"kind"``.
    aliases: tuple[str, ...]
    #: The one-letter name the Redis script and the PostgreSQL functions dispatch on.
    code: str
    #: Whether the limit refills in steps that start at a per-key offset (a window's phase,
    #: from ``start`` or a hash of the key): its fresh state and decisions need that offset,
    #: and ``start`` applies to it.
    phased: bool
    #: ``decide(state, now, count, *, rate, period, capacity, offset, reserve, max_reserved)``.
    decide: Callable[..., Decision]
    #: ``refund(state, now, amount, *, rate, period, capacity, offset)``: the state once tokens come back.
    refund: Callable[..., State]
    #: ``fresh(capacity, period, offset)``: the state of a key nobody has used.
    fresh: Callable[[int, int, int], State]
    #: ``refill_time(amount, rate, period)``: how long (µs) a value of 0 takes to reach ``amount``.
    refill_time: Callable[[int, int, int], int]
    #: ``denied_later(value, retry_after, denied_count, count, elapsed, *, rate, period, capacity, exact)``:
    #: what a denial says of a later call while nothing but time changes the bucket (the
    #: deny cache's answer), or None when it cannot say it exactly enough.
    denied_later: Callable[..., tuple[int, int] | None]
    #: ``denial_holds(value, retry_after, count, now, *, rate, period, offset)``: for how long
    #: (µs) ``denied_later`` may answer from a denial decided at ``now``; None: not at all.
    denial_holds: Callable[..., int | None]


TOKEN_BUCKET = "token bucket"
FIXED_WINDOW = "fixed window"

#: Every kind of limit, by name.
ALGORITHMS: dict[str, Algorithm] = {
    algorithm.name: algorithm
    for algorithm in (
        Algorithm(
            name=TOKEN_BUCKET,
            aliases=("token_bucket",),
            code="t",
            phased=False,
            decide=token_bucket,
            refund=token_bucket_refund,
            fresh=_token_bucket_fresh,
            refill_time=_token_bucket_refill_time,
            denied_later=token_bucket_denied_later,
            denial_holds=token_bucket_denial_holds,
        ),
        Algorithm(
            name=FIXED_WINDOW,
            aliases=("fixed_window",),
            code="f",
            phased=True,
            decide=fixed_window,
            refund=fixed_window_refund,
            fresh=fresh_fixed_window,
            refill_time=_fixed_window_refill_time,
            denied_later=fixed_window_denied_later,
            denial_holds=fixed_window_denial_holds,
        ),
    )
}

_BY_SPELLING = {spelling: a for a in ALGORITHMS.values() for spelling in (a.name, *a.aliases)}


@dataclass(frozen=True)
class Port:
    """A copy of this module's arithmetic in a store's own language, held to it by replays."""

    #: The file, relative to the package.
    path: str
    #: Where in the file: a function or class, or the heading of a section of the script.
    part: str
    #: The kinds (``Algorithm.name``) it implements.
    kinds: tuple[str, ...]
    #: What it computes: ``"decide"`` (a decision and the state to store), ``"refund"``
    #: (the state once tokens come back), ``"classify"`` (rows limited, partial or full now).
    operations: tuple[str, ...]
    #: The tests that replay it against this module, as ``tests/<module>.py::<test>``.
    replayed_by: tuple[str, ...]
    #: The condition in ``path`` that sends only ``kinds`` to it; "" when every kind goes.
    gate: str = ""


_REPLAYED_BY_LUA = "tests/test_redis.py::test_lua_and_python_agree_on_every_decision"
_REPLAYED_BY_SQL = "tests/test_pg_fast_path.py::test_sql_and_python_agree_on_every_decision"
_REFUNDS_REPLAYED_BY = "tests/test_ports.py::test_a_redis_refund_leaves_the_state_of_the_python_refund"

#: Every copy of the arithmetic outside this module. The script's general path and
#: ``django_tokenbucket_decide_v3`` also port ``backends.base.decide_all``.
PORTS: tuple[Port, ...] = (
    Port(
        "backends/redis/lua/decide.lua",
        "The common path",
        (TOKEN_BUCKET, FIXED_WINDOW),
        ("decide", "refund"),
        (
            _REPLAYED_BY_LUA,
            "tests/test_redis.py::test_the_common_path_stops_exactly_where_doubles_stop_being_exact",
            _REFUNDS_REPLAYED_BY,
        ),
    ),
    Port(
        "backends/redis/lua/decide.lua",
        "The general path",
        (TOKEN_BUCKET, FIXED_WINDOW),
        ("decide", "refund"),
        (
            _REPLAYED_BY_LUA,
            "tests/test_redis.py::test_the_general_path_decides_one_limit_as_the_common_path_does",
            _REFUNDS_REPLAYED_BY,
        ),
    ),
    Port(
        "backends/database/sql/postgresql_v3.sql",
        "django_tokenbucket_single_v3",
        (TOKEN_BUCKET, FIXED_WINDOW),
        ("decide",),
        (_REPLAYED_BY_SQL,),
    ),
    Port(
        "backends/database/sql/postgresql_v3.sql",
        "django_tokenbucket_step_v3",
        (TOKEN_BUCKET, FIXED_WINDOW),
        ("decide",),
        (_REPLAYED_BY_SQL,),
    ),
    Port(
        "backends/database/postgresql.py",
        "_Admit",
        (TOKEN_BUCKET,),
        ("decide",),
        (_REPLAYED_BY_SQL,),
        gate='algorithm.code == "t"',
    ),
    Port(
        "backends/database/filters.py",
        "at_least_q",
        (TOKEN_BUCKET, FIXED_WINDOW),
        ("classify",),
        (
            "tests/test_ports.py::test_the_orm_filter_classifies_replayed_rows_as_live_state_does",
            "tests/test_admin.py::test_state_filter_agrees_with_the_value_derived_now",
        ),
    ),
)


def algorithm_named(kind: str) -> Algorithm | None:
    """Return the algorithm a ``"kind"`` spelling names, or None if there is none."""
    return _BY_SPELLING.get(kind)
