"""What the admin and the command share for overrides (``override_operations``): durations,
factors and rates as operators type them, numbers checked as the limiter checks them."""

from __future__ import annotations

from datetime import timedelta
from decimal import Decimal
from fractions import Fraction

import pytest

from django_tokenbucket import limiter
from django_tokenbucket.models import LimitOverride
from django_tokenbucket.override_operations import (
    factor_of,
    key_from_spec,
    multiplied,
    numbers_from_text,
    parse_duration,
    rate_text,
)
from django_tokenbucket.overrides import key_digest

M = 1_000_000


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("30 min", 1800), ("1h", 3600), (" 7d ", 604800), ("2w", 1209600), ("1 Week", 604800)],
)
def test_durations(text, seconds):
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["", "soon", "0h", "1h30m", "-1h", "1.5h", "1y", "999999999w"])
def test_bad_durations(text):
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_factors():
    assert factor_of(" 10 ") == 10 and factor_of("1.5") == Fraction(3, 2)
    for text in ("0", "-2", "x", "1e9", "nan"):
        with pytest.raises(ValueError, match="×"):
            factor_of(text)


@pytest.mark.parametrize(
    ("rate", "period", "text"),
    [(100, 60, "100/m"), (5, 90, "5/90s"), (1, 7200, "1/2h"), (1000, 86400, "1000/d"), (0.5, 60, "0.5/m")],
)
def test_a_rate_written_back_as_a_rate_string(rate, period, text):
    row = LimitOverride(name="x", action="limit", rate=round(rate * M), period=period * M)
    assert rate_text(row, None) == text


def test_a_rate_without_its_own_period_takes_the_limits():
    row = LimitOverride(name="login", action="limit", rate=7 * M)
    assert rate_text(row, limiter.resolve("login")) == "7/m"
    assert rate_text(LimitOverride(name="login", action="block"), None) == ""


def test_numbers_are_checked_as_the_limiter_checks_them():
    login = limiter.resolve("login")  # 5/m
    assert numbers_from_text(login, "100/h", None, None) == {
        "rate": 100 * M, "period": 3600 * M, "capacity": None, "max_reserved": None
    }
    assert numbers_from_text(login, "", Decimal("2.5"), Decimal(0))["max_reserved"] == 0
    for rate, capacity, words in (
        ("10/fortnight", None, "invalid rate"),
        ("", Decimal(0), "capacity must be positive"),
        ("", Decimal("0.5"), "could never admit a call of one token"),
        ("", None, "give at least one of rate"),
    ):
        with pytest.raises(ValueError, match=words) as raised:
            numbers_from_text(login, rate, capacity, None)
        assert "rate limit 'login'" in str(raised.value)


def test_give_n_times_multiplies_the_rate_and_the_capacity():
    burst = limiter.resolve("burst")  # 10/m, capacity 20
    assert multiplied(burst, Fraction(3)) == {"rate": 30 * M, "period": None, "capacity": 60 * M, "max_reserved": None}
    with pytest.raises(ValueError, match="rate limit 'burst'"):
        multiplied(burst, Fraction(1, 100))  # capacity 0.2: never one token


def test_keys_as_typed_meet_the_keys_decisions_use():
    assert key_from_spec("login", " ") is None
    assert key_digest("login", key_from_spec("login", "post:username= Alice@Example.com "))[0] == key_digest(
        "login", ("post:username", "alice@example.com")
    )[0]
    with pytest.raises(ValueError, match="rate limit 'login': key 'alice' is not SPEC=VALUE"):
        key_from_spec("login", "alice")
