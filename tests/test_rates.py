"""Rate strings and periods (reliability plan B6 and property (a))."""

from __future__ import annotations

import re
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from django_tokenbucket.rates import UNIT_SECONDS, parse_period, parse_rate

# ---------------------------------------------------------------------------------------
# parse_rate: the grammar, table-driven
# ---------------------------------------------------------------------------------------

REJECTED_RATES = [
    "10/M",  # capital unit: 'M' is not minutes (nor months)
    "10/5M",
    "10/5x",  # unknown unit
    "٣/s",  # ARABIC-INDIC DIGIT THREE: str.isdigit() is True, but not ASCII
    "10/",  # no unit
    "/m",  # no count
    "1e3/s",  # exponents are not integers
    " 10/s",  # leading space
    "10/s ",  # trailing space
    "10/0s",  # zero period
    "10/-5m",  # negative period
    "-1/s",  # negative count
    "0/s",  # zero count
    "10/ms",  # not milliseconds, not anything
    "10\n/s",  # a newline inside
    "10/s\n",  # a trailing newline ('$' would have let it through)
    "１０/s",  # FULLWIDTH DIGIT ONE, FULLWIDTH DIGIT ZERO
    "10/５m",  # fullwidth multiplier
    "+10/s",
    "10.5/s",
    "10/1.5m",
    "10 /s",
    "10/ s",
    "10/5 m",
    "10//s",
    "10/s/s",
    "10/mm",
    "10/S",
    "10/Minute",
    "10/mo",  # DRF reads the first letter (minutes); here an unknown word is an error
    "10/minz",
    "10/Sec",
    "10/hours_",
    "10/week",
    "10/y",
    "10",
    "/",
    "",
    "s",
    "10/s\x00",
    "0x10/s",
    "1_000/s",
    "10/1_0m",
    "00/s",
    "10/00m",
]

ACCEPTED_RATES = [
    ("10/s", 10, 1),
    ("10/m", 10, 60),
    ("10/h", 10, 3600),
    ("10/d", 10, 86400),
    ("10/5m", 10, 300),
    ("10/minute", 10, 60),
    ("10/minutes", 10, 60),
    ("1/second", 1, 1),
    ("2/seconds", 2, 1),
    ("1/hour", 1, 3600),
    ("3/hours", 3, 3600),
    ("1000/day", 1000, 86400),
    ("7/days", 7, 86400),
    ("5/10m", 5, 600),
    ("100/1s", 100, 1),
    ("1/2d", 1, 172800),
    # DRF's documented spellings.
    ("3/sec", 3, 1),
    ("60/min", 60, 60),
    ("1/hr", 1, 3600),
    ("2/hrs", 2, 3600),
    ("5/mins", 5, 60),
    ("5/10min", 5, 600),
]


@pytest.mark.parametrize("rate", REJECTED_RATES, ids=repr)
def test_parse_rate_rejects(rate):
    with pytest.raises(ValueError) as excinfo:
        parse_rate(rate)
    # The message quotes what was written, so the author can find it.
    assert repr(rate) in str(excinfo.value)


@pytest.mark.parametrize("rate, tokens, period", ACCEPTED_RATES, ids=[r[0] for r in ACCEPTED_RATES])
def test_parse_rate_accepts(rate, tokens, period):
    result = parse_rate(rate)
    assert result == (Fraction(tokens), Fraction(period))
    assert all(isinstance(part, Fraction) for part in result)


@pytest.mark.parametrize("rate", [10, 10.0, None, b"10/s", ["10/s"], ("10", "s")], ids=repr)
def test_parse_rate_rejects_non_strings(rate):
    with pytest.raises(ValueError) as excinfo:
        parse_rate(rate)
    assert repr(rate) in str(excinfo.value)


def test_unit_table_is_consistent():
    # Every spelled-out unit means the same as its one-letter form.
    for word, letter in [("second", "s"), ("minute", "m"), ("hour", "h"), ("day", "d"), ("sec", "s"), ("min", "m"), ("hr", "h")]:
        assert UNIT_SECONDS[word] == UNIT_SECONDS[word + "s"] == UNIT_SECONDS[letter]


ROOT = Path(__file__).resolve().parent.parent


def documented_units() -> dict[str, set[str]]:
    """docs/settings.md's table of rate-string units: unit name -> spellings."""
    text = (ROOT / "docs" / "settings.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| (second|minute|hour|day) \| (.+) \|$", text, re.M)
    return {unit: set(re.findall(r"`([a-z]+)`", spellings)) for unit, spellings in rows}


def test_one_grammar_in_the_docs_the_error_and_the_check():
    # The README and settings.md listed "s m h d second minute hour day" while the parser
    # took "5/min" and its error listed "sec, min, hr" (issue 33).
    documented = documented_units()
    seconds = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
    assert {spelling: seconds[unit] for unit, spellings in documented.items() for spelling in spellings} == UNIT_SECONDS
    with pytest.raises(ValueError) as excinfo:
        parse_rate("10/mo")
    listed = str(excinfo.value).partition("one of: ")[2].partition(" (e.g.")[0]
    assert [set(group.split(", ")) for group in listed.split("; ")] == [documented[unit] for unit in seconds]
    # The README states no list of its own: it points at that table.
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "docs/settings.md#limit-config" in readme and "`second`, `minute`" not in readme


# ---------------------------------------------------------------------------------------
# parse_period
# ---------------------------------------------------------------------------------------

ACCEPTED_PERIODS = [
    (60, Fraction(60)),
    (1, Fraction(1)),
    (0.5, Fraction(1, 2)),
    (0.1, Fraction(1, 10)),  # the decimal the author meant, not the binary neighbour
    (Decimal("1.5"), Fraction(3, 2)),
    (Fraction(1, 3), Fraction(1, 3)),
    (10**9, Fraction(10**9)),
    (timedelta(minutes=1), Fraction(60)),
    (timedelta(days=1, seconds=1), Fraction(86401)),
    (timedelta(microseconds=1), Fraction(1, 1_000_000)),
    (timedelta(seconds=1, microseconds=500_000), Fraction(3, 2)),
]


@pytest.mark.parametrize("period, expected", ACCEPTED_PERIODS, ids=repr)
def test_parse_period_accepts(period, expected):
    result = parse_period(period)
    assert result == expected
    assert isinstance(result, Fraction)


REJECTED_PERIODS = [
    0,
    0.0,
    -0.0,
    -1,
    -0.5,
    Decimal("0"),
    Decimal("-1"),
    Fraction(-1, 3),
    float("nan"),
    float("inf"),
    float("-inf"),
    Decimal("NaN"),
    Decimal("sNaN"),
    Decimal("Infinity"),
    Decimal("-Infinity"),
    True,
    False,
    "60",
    "1m",
    None,
    [60],
    timedelta(0),
    timedelta(seconds=-1),
    timedelta(microseconds=-1),
]


@pytest.mark.parametrize("period", REJECTED_PERIODS, ids=repr)
def test_parse_period_rejects(period):
    with pytest.raises(ValueError) as excinfo:
        parse_period(period)
    assert repr(period) in str(excinfo.value)


# ---------------------------------------------------------------------------------------
# Property (a): round trip, and nothing but positive finite numbers or ValueError
# ---------------------------------------------------------------------------------------

UNITS = sorted(UNIT_SECONDS)


@given(
    count=st.integers(min_value=1, max_value=10**12),
    multiplier=st.none() | st.integers(min_value=1, max_value=10**6),
    unit=st.sampled_from(UNITS),
)
def test_parse_rate_round_trip(count, multiplier, unit):
    text = f"{count}/{'' if multiplier is None else multiplier}{unit}"
    expected = (Fraction(count), Fraction((multiplier or 1) * UNIT_SECONDS[unit]))
    assert parse_rate(text) == expected


def _check_parse_result(text: str) -> None:
    try:
        tokens, period = parse_rate(text)
    except ValueError:
        return
    for part in (tokens, period):
        assert isinstance(part, Fraction)
        assert part > 0
        assert part.denominator == 1  # whole tokens, whole seconds
    # Only the canonical ASCII grammar is accepted.
    assert text.isascii()
    assert text == text.strip()
    assert text.count("/") == 1


# Characters that make near-misses likely: digits of all scripts, signs, dots,
# exponents, whitespace of all kinds, units in several cases.
_NEAR_ALPHABET = st.sampled_from(
    list("0123456789/smhdSMHD+-.eE _x")
    + ["\n", "\t", "\r", "\x00", "\u00a0", "\u3000", "٣", "１", "０", "²", "߀", "𝟙"]
    + ["second", "minute", "hour", "day", "seconds", "hours", "Minute"]
)


@given(st.text(alphabet=st.characters(exclude_categories=())))
@example("10/s")
@example("9" * 5000 + "/s")
@example("1/" + "9" * 5000 + "d")
def test_parse_rate_any_text(text):
    _check_parse_result(text)


@given(st.lists(_NEAR_ALPHABET, max_size=12).map("".join))
def test_parse_rate_near_misses(text):
    _check_parse_result(text)


@given(
    st.integers(min_value=-(10**6), max_value=10**9)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.decimals(allow_nan=True, allow_infinity=True)
    | st.fractions()
    | st.timedeltas()
    | st.booleans()
    | st.none()
    | st.text(max_size=5)
)
def test_parse_period_any_value(value):
    try:
        seconds = parse_period(value)
    except ValueError:
        return
    assert isinstance(seconds, Fraction)
    assert seconds > 0
    assert not isinstance(value, bool)
