"""Limit definitions: parse_limit, validate_count and window offsets (B1, B3-B5)."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from fractions import Fraction

import pytest
from django.core.exceptions import ImproperlyConfigured
from hypothesis import given
from hypothesis import strategies as st

from django_tokenbucket.algorithms import MAX_AMOUNT, MICRO
from django_tokenbucket.keys import encode_key
from django_tokenbucket.limits import (
    FIXED_WINDOW,
    TOKEN_BUCKET,
    LimitConfig,
    parse_limit,
)

NAME = "my_limit"
#: The largest whole number of tokens an amount may hold.
MAX_TOKENS = MAX_AMOUNT // MICRO


def _quotes(message: str, bad: object) -> bool:
    """Return whether ``message`` quotes ``bad`` (as repr, or as str for numbers).

    A Decimal shown as the float of the same value ("5e-07" for Decimal("5E-7")) counts.
    """
    if isinstance(bad, Decimal) and bad.is_finite() and repr(float(bad)) in message:
        return True
    return repr(bad) in message or str(bad) in message


def assert_improper(spec: object, bad: object, name: str = NAME) -> str:
    with pytest.raises(ImproperlyConfigured) as excinfo:
        parse_limit(name, spec)
    message = str(excinfo.value)
    assert repr(name) in message, f"the limit is not named in {message!r}"
    assert _quotes(message, bad), f"{bad!r} is not quoted in {message!r}"
    return message


# ---------------------------------------------------------------------------------------
# Accepted configurations
# ---------------------------------------------------------------------------------------


def test_rate_string_shorthand():
    limit = parse_limit("login", "5/m")
    assert limit == LimitConfig(
        name="login", kind=TOKEN_BUCKET, rate=5 * MICRO, period=60 * MICRO, capacity=5 * MICRO
    )
    assert parse_limit("login", {"rate": "5/m"}) == limit
    assert parse_limit("login", {"kind": "token bucket", "rate": "5/m"}) == limit


def test_numeric_rate_with_period_and_capacity():
    limit = parse_limit("send", {"kind": "token bucket", "rate": 10, "period": 60, "capacity": 20})
    assert (limit.rate, limit.period, limit.capacity) == (10 * MICRO, 60 * MICRO, 20 * MICRO)
    assert limit.max_reserved is None and limit.start is None
    assert limit.rate_tokens == 10 and limit.period_seconds == 60 and limit.capacity_tokens == 20


@pytest.mark.parametrize(
    "period", [60, 60.0, Decimal("60"), Fraction(60), timedelta(minutes=1), timedelta(seconds=60)]
)
def test_period_forms(period):
    assert parse_limit(NAME, {"rate": 10, "period": period}).period == 60 * MICRO


def test_fractional_amounts_up_to_six_decimals():
    limit = parse_limit(
        NAME, {"rate": 0.1, "period": 0.000001, "capacity": Decimal("2.000001"), "max_reserved": 0.5}
    )
    assert limit.rate == 100_000
    assert limit.period == 1
    assert limit.capacity == 2_000_001
    assert limit.max_reserved == 500_000


def test_capacity_none_means_rate_and_max_reserved_zero_is_allowed():
    limit = parse_limit(NAME, {"rate": "10/m", "capacity": None, "max_reserved": 0})
    assert limit.capacity == 10 * MICRO
    assert limit.max_reserved == 0


def test_amounts_at_the_exact_limit():
    # 2**53 micro-tokens is 9007199254.740992 tokens: exactly six decimals.
    edge = Decimal(MAX_AMOUNT) / MICRO
    assert parse_limit(NAME, {"rate": 1, "period": 1, "capacity": edge}).capacity == MAX_AMOUNT
    with pytest.raises(ImproperlyConfigured, match=repr(NAME)):
        parse_limit(NAME, {"rate": 1, "period": 1, "capacity": edge + Decimal("0.000001")})


@pytest.mark.parametrize(
    "kind, expected",
    [
        ("token bucket", TOKEN_BUCKET),
        ("token_bucket", TOKEN_BUCKET),
        ("fixed window", FIXED_WINDOW),
        ("fixed_window", FIXED_WINDOW),
    ],
)
def test_kind_aliases(kind, expected):
    assert parse_limit(NAME, {"kind": kind, "rate": "5/m"}).kind == expected


def test_fixed_window_start():
    base = {"kind": "fixed window", "rate": 5, "period": 60}
    assert parse_limit(NAME, {**base, "start": 0}).start == 0
    assert parse_limit(NAME, {**base, "start": 30}).start == 30 * MICRO
    assert parse_limit(NAME, {**base, "start": 0.5}).start == 500_000
    assert parse_limit(NAME, {**base, "start": Decimal("1.000001")}).start == 1_000_001
    assert parse_limit(NAME, {**base, "start": timedelta(seconds=30)}).start == 30 * MICRO
    assert parse_limit(NAME, {**base, "start": timedelta(minutes=1, microseconds=7)}).start == 60 * MICRO + 7
    assert parse_limit(NAME, {**base, "start": timedelta(seconds=-15)}).start == -15 * MICRO


def test_settings_limits_parse():
    from django.conf import settings

    for name, spec in settings.TOKENBUCKET["LIMITS"].items():
        assert parse_limit(name, spec).name == name


# ---------------------------------------------------------------------------------------
# Rejected configurations: ImproperlyConfigured naming the limit, quoting the value
# ---------------------------------------------------------------------------------------


def test_unknown_options():
    message = assert_improper({"rate": "5/m", "burst": 3}, "burst")
    assert "'burst'" in message
    assert_improper({"rate": "5/m", "Capacity": 3}, "Capacity")
    assert_improper({"rate": "5/m", "rate_limit": 3, "periode": 60}, "periode")


@pytest.mark.parametrize("kind", ["sliding window", "Token Bucket", "leaky bucket", "", 42, None, True])
def test_bad_kind(kind):
    assert_improper({"kind": kind, "rate": "5/m"}, kind)


def test_missing_rate():
    assert_improper({"kind": "token bucket", "period": 60}, "rate")
    assert_improper({}, "rate")


def test_numeric_rate_without_period():
    assert_improper({"rate": 10}, 10)
    assert_improper({"rate": 0.5, "capacity": 2}, 0.5)


def test_rate_string_and_period():
    assert_improper({"rate": "10/m", "period": 60}, "10/m")


@pytest.mark.parametrize("spec", [10, 10.5, None, ["10/m"], ("rate", "10/m"), b"10/m"], ids=repr)
def test_spec_not_a_mapping(spec):
    assert_improper(spec, spec)


@pytest.mark.parametrize("rate", ["10/M", "1e3/s", "0/s", "-1/s", "10/0s", " 10/s", "10"], ids=repr)
def test_bad_rate_string(rate):
    assert_improper({"rate": rate}, rate)
    assert_improper(rate, rate)


BAD_AMOUNTS = [
    0,
    0.0,
    -1,
    -0.5,
    Decimal("-1"),
    Fraction(-1, 2),
    float("nan"),
    float("inf"),
    float("-inf"),
    Decimal("NaN"),
    Decimal("Infinity"),
    True,
    False,
    "20",
    "10/m",
    [20],
]


@pytest.mark.parametrize("capacity", BAD_AMOUNTS, ids=repr)
def test_bad_capacity(capacity):
    assert_improper({"rate": "10/m", "capacity": capacity}, capacity)


@pytest.mark.parametrize("rate", [r for r in BAD_AMOUNTS if not isinstance(r, str)], ids=repr)
def test_bad_numeric_rate(rate):
    assert_improper({"rate": rate, "period": 60}, rate)


@pytest.mark.parametrize(
    "period", [0, -1, float("nan"), float("inf"), True, "60", Decimal("NaN"), timedelta(0)], ids=repr
)
def test_bad_period(period):
    assert_improper({"rate": 10, "period": period}, period)


@pytest.mark.parametrize(
    "max_reserved", [-1, -0.5, float("nan"), float("inf"), True, "5", Decimal("-Infinity")], ids=repr
)
def test_bad_max_reserved(max_reserved):
    assert_improper({"rate": "10/m", "max_reserved": max_reserved}, max_reserved)


@pytest.mark.parametrize("option", ["rate", "capacity", "max_reserved"])
@pytest.mark.parametrize("value", [0.0000001, 1.1234567, Decimal("0.0000005"), Decimal("3.1415926")], ids=repr)
def test_more_than_six_decimals(option, value):
    spec = {"rate": 10, "period": 60, option: value}
    assert_improper(spec, value)


@pytest.mark.parametrize("period", [0.0000001, 1.0000005, Decimal("60.0000001")], ids=repr)
def test_period_finer_than_a_microsecond(period):
    assert_improper({"rate": 10, "period": period}, period)


def test_period_too_long():
    assert_improper({"rate": 10, "period": 10**10}, 10**10)


@pytest.mark.parametrize("option", ["capacity", "max_reserved"])
@pytest.mark.parametrize("value", [MAX_TOKENS + 1, 10**12, 1e300, Decimal("1E+30")], ids=repr)
def test_amount_above_2_53_micro_tokens(option, value):
    assert_improper({"rate": "10/m", option: value}, value)


@pytest.mark.parametrize("rate", [MAX_TOKENS + 1, 10**15, 1e300], ids=repr)
def test_rate_above_2_53_micro_tokens(rate):
    assert_improper({"rate": rate, "period": 60}, rate)


def test_rate_string_above_2_53_micro_tokens():
    rate = f"{MAX_TOKENS + 1}/s"
    assert_improper({"rate": rate}, rate)


def test_start_on_a_token_bucket():
    assert_improper({"rate": "5/m", "start": 0}, "start")
    assert_improper({"kind": "token_bucket", "rate": 5, "period": 60, "start": timedelta(0)}, "start")


@pytest.mark.parametrize(
    "start", [float("nan"), float("inf"), True, "0", 0.0000001, Decimal("NaN"), [0]], ids=repr
)
def test_bad_start(start):
    assert_improper({"kind": "fixed window", "rate": 5, "period": 60, "start": start}, start)


@pytest.mark.parametrize("name", ["", " login", "login ", "lo\x00gin", "log\nin", 42, None, b"login", ("a",)], ids=repr)
def test_bad_names(name):
    with pytest.raises(ImproperlyConfigured) as excinfo:
        parse_limit(name, "5/m")
    assert repr(name) in str(excinfo.value)


def test_name_too_long():
    with pytest.raises(ImproperlyConfigured):
        parse_limit("x" * 201, "5/m")
    assert parse_limit("x" * 200, "5/m").name == "x" * 200


# ---------------------------------------------------------------------------------------
# validate_count (B1, B3, B4)
# ---------------------------------------------------------------------------------------

LOGIN = parse_limit("login", "5/m")
RESERVABLE = parse_limit("reservable", {"rate": 10, "period": 10, "max_reserved": 20})


@pytest.mark.parametrize(
    "count",
    [
        0,
        0.0,
        -1,
        -(10**9),
        -0.5,
        float("nan"),
        float("inf"),
        float("-inf"),
        True,
        False,
        Decimal("NaN"),
        Decimal("sNaN"),
        Decimal("Infinity"),
        Decimal("0"),
        1e308,
        10**400,
        "1",
        b"1",
        None,
        [1],
        Fraction(1, 3),
        1.0000001,
    ],
    ids=repr,
)
@pytest.mark.parametrize("reserve", [False, True])
def test_validate_count_rejects(count, reserve):
    for limit in (LOGIN, RESERVABLE, parse_limit("uncapped", "5/m")):
        with pytest.raises(ValueError) as excinfo:
            limit.validate_count(count, reserve)
        assert repr(limit.name) in str(excinfo.value)


@pytest.mark.parametrize(
    "count, micro",
    [(1, MICRO), (0.5, 500_000), (Decimal("0.000001"), 1), (Fraction(5, 2), 2_500_000), (5, 5 * MICRO), (5.0, 5 * MICRO)],
)
def test_validate_count_accepts(count, micro):
    assert LOGIN.validate_count(count, False) == micro
    assert LOGIN.validate_count(count, True) == micro


def test_count_above_capacity_without_reserve():
    # B2: count == capacity is fine; one micro-token more could never succeed.
    assert LOGIN.validate_count(5, False) == 5 * MICRO
    for count in (5.000001, 6, 10**6):
        with pytest.raises(ValueError) as excinfo:
            LOGIN.validate_count(count, False)
        message = str(excinfo.value)
        assert "'login'" in message and "capacity" in message and str(count) in message


def test_count_above_capacity_plus_max_reserved():
    assert RESERVABLE.validate_count(30, True) == 30 * MICRO
    assert RESERVABLE.validate_count(11, True) == 11 * MICRO
    with pytest.raises(ValueError, match="'reservable'"):
        RESERVABLE.validate_count(11, False)
    for count in (30.000001, 31, 10**6):
        with pytest.raises(ValueError) as excinfo:
            RESERVABLE.validate_count(count, True)
        assert "'reservable'" in str(excinfo.value)


def test_uncapped_reservations_take_large_counts():
    assert LOGIN.max_reserved is None
    assert LOGIN.validate_count(10**6, True) == 10**12
    assert LOGIN.validate_count(MAX_TOKENS, True) == MAX_TOKENS * MICRO
    with pytest.raises(ValueError, match="'login'"):
        LOGIN.validate_count(MAX_TOKENS + 1, True)


@given(
    st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.decimals(allow_nan=True, allow_infinity=True)
    | st.fractions()
    | st.booleans()
    | st.text(max_size=3),
    st.booleans(),
)
def test_validate_count_any_value(count, reserve):
    try:
        micro = RESERVABLE.validate_count(count, reserve)
    except ValueError as exc:
        assert "'reservable'" in str(exc)
        return
    assert isinstance(micro, int) and not isinstance(micro, bool)
    assert 0 < micro <= (30 if reserve else 10) * MICRO
    expected = Fraction(repr(count)) if isinstance(count, float) else Fraction(count)
    assert Fraction(micro, MICRO) == expected


# ---------------------------------------------------------------------------------------
# window_offset
# ---------------------------------------------------------------------------------------

WINDOW = parse_limit("window", {"kind": "fixed window", "rate": 5, "period": 60})


def test_window_offset_is_stable_and_in_range():
    digest = encode_key("alice").digest
    offset = WINDOW.window_offset(digest)
    assert 0 <= offset < WINDOW.period
    assert WINDOW.window_offset(digest) == offset
    # A config parsed again (another process, a reload) gives the same offset.
    again = parse_limit("window", {"kind": "fixed_window", "rate": 5, "period": timedelta(minutes=1)})
    assert again.window_offset(digest) == offset
    assert WINDOW.fresh_state(digest).ts == offset


def test_window_offsets_spread_over_keys_and_limits():
    offsets = {WINDOW.window_offset(encode_key(i).digest) for i in range(200)}
    assert len(offsets) > 150
    other = parse_limit("other_window", {"kind": "fixed window", "rate": 5, "period": 60})
    digest = encode_key("alice").digest
    names = [parse_limit(f"w{i}", {"kind": "fixed window", "rate": 5, "period": 60}) for i in range(20)]
    assert len({limit.window_offset(digest) for limit in [WINDOW, other, *names]}) > 15


@given(key=st.text() | st.binary() | st.integers(), period=st.integers(min_value=1, max_value=2**53))
def test_window_offset_in_range(key, period):
    limit = parse_limit("w", {"kind": "fixed window", "rate": 1, "period": Fraction(period, MICRO)})
    offset = limit.window_offset(encode_key(key).digest)
    assert 0 <= offset < period


@pytest.mark.parametrize(
    "start, expected",
    [
        (0, 0),
        (15, 15 * MICRO),
        (59.999999, 59_999_999),
        (timedelta(seconds=30), 30 * MICRO),
        (75, 15 * MICRO),  # an offset from the epoch: only its phase in the period matters
        (-15, 45 * MICRO),
    ],
)
def test_window_offset_with_start(start, expected):
    limit = parse_limit("window", {"kind": "fixed window", "rate": 5, "period": 60, "start": start})
    for key in ("alice", "bob", b"\x00", 7, None):
        assert limit.window_offset(encode_key(key).digest) == expected
        assert limit.fresh_state(encode_key(key).digest).ts == expected
