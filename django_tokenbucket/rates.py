"""Parse rate strings and periods into exact numbers.

The grammar is deliberately strict: a limit that silently means something else than
what its author wrote (``"10/M"`` read as minutes, ``"1e3/s"`` as a thousand) is worse
than an error at start-up.
"""

from __future__ import annotations

import math
import re
from datetime import timedelta
from decimal import Decimal
from fractions import Fraction
from functools import lru_cache
from typing import Union

__all__ = ["UNIT_SECONDS", "Number", "parse_period", "parse_rate", "shown", "to_fraction"]

Number = Union[int, float, Decimal, Fraction]

#: Every unit spelling: ours (one letter) and the words DRF's documentation and its
#: users write (DRF itself reads only the first letter, so ``"10/mo"`` would be ten a
#: minute there; here an unknown word is an error rather than a guess).
UNIT_SECONDS = {
    **dict.fromkeys(("s", "sec", "secs", "second", "seconds"), 1),
    **dict.fromkeys(("m", "min", "mins", "minute", "minutes"), 60),
    **dict.fromkeys(("h", "hr", "hrs", "hour", "hours"), 3600),
    **dict.fromkeys(("d", "day", "days"), 86400),
}

#: How error messages (and so ``manage.py check``) list the units: every spelling, by unit,
#: as docs/settings.md's table of rate strings does (tests/test_rates.py holds them together).
UNIT_SPELLINGS = "; ".join(
    ", ".join(spelling for spelling, length in UNIT_SECONDS.items() if length == seconds)
    for seconds in sorted(set(UNIT_SECONDS.values()))
)

_RATE_RE = re.compile(
    r"(?P<count>[0-9]+)/(?P<multiplier>[0-9]+)?(?P<unit>"
    + "|".join(sorted(UNIT_SECONDS, key=len, reverse=True))
    + ")",
    re.ASCII,
)


#: Bounds checked before any exact conversion, so that a number a client sent costs
#: microseconds however it is written: ``Decimal("1e8000000")`` would otherwise become a
#: 10**8000000 integer (seconds of CPU) before any limit said it is too large. Every
#: amount and duration the limiter accepts lies far inside them.
_MAX_EXPONENT = 30
_MAX_DIGITS = 40
_MAX_BITS = 128
#: How long a value quoted in an error message may be.
_SHOWN_LENGTH = 40


def shown(value: object) -> str:
    """Return ``repr(value)`` for an error message, cut short, and without converting a huge int to text.

    The value may come from a client (an amount an application meters): its repr must
    neither flood a log line nor cost the quadratic int-to-decimal conversion.
    """
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _MAX_BITS:
        return f"<an integer of {value.bit_length():,} bits>"
    if isinstance(value, Fraction) and max(value.numerator.bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        return f"<a Fraction of {value.numerator.bit_length():,}/{value.denominator.bit_length():,} bits>"
    if isinstance(value, str) and len(value) > _SHOWN_LENGTH:
        return repr(value[:_SHOWN_LENGTH]) + f"... ({len(value):,} characters)"
    text = repr(value)
    return text if len(text) <= 2 * _SHOWN_LENGTH else text[: 2 * _SHOWN_LENGTH] + "..."


def to_fraction(value: object, what: str) -> Fraction:
    """Return ``value`` as an exact Fraction, or raise ValueError naming ``what``.

    Floats go through their shortest repr, so ``0.1`` means one tenth, as the author
    of the setting meant, rather than the nearest binary fraction. Magnitudes beyond
    10**30, and Decimals with more than 40 significant digits or finer than 10**-30,
    are refused before they are converted (see ``_MAX_EXPONENT``).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal, Fraction)):
        raise ValueError(f"{what} must be a number, not {shown(value)}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{what} must be finite, not {value!r}")
        if abs(value) >= 10.0**_MAX_EXPONENT:
            raise ValueError(f"{what} is too large: {value!r}")
        return Fraction(repr(value))
    if isinstance(value, Decimal):
        return Fraction(_bounded_decimal(value, what))
    if isinstance(value, int):
        if value.bit_length() > _MAX_BITS:
            raise ValueError(f"{what} is too large: {shown(value)}")
        return Fraction(value)
    if max(value.numerator.bit_length(), value.denominator.bit_length()) > _MAX_BITS:
        raise ValueError(f"{what} is too large or too precise: {shown(value)}")
    return value


def _bounded_decimal(value: Decimal, what: str) -> Decimal:
    """Return ``value`` with its trailing zeros dropped, or raise ValueError if it is out of bounds."""
    if not value.is_finite():
        raise ValueError(f"{what} must be finite, not {shown(value)}")
    if not value:
        return Decimal(0)
    # adjusted() is the exponent of the leading digit: O(1), whatever the exponent.
    if value.adjusted() > _MAX_EXPONENT:
        raise ValueError(f"{what} is too large: {shown(value)}")
    if value.adjusted() < -_MAX_EXPONENT:
        raise ValueError(f"{what} is too small (more than {_MAX_EXPONENT} decimal places): {shown(value)}")
    sign, digits, exponent = value.as_tuple()
    significant = bytes(digits).rstrip(b"\0")
    if len(significant) > _MAX_DIGITS:
        raise ValueError(f"{what} has more than {_MAX_DIGITS} significant digits: {shown(value)}")
    assert isinstance(exponent, int)  # finite
    return Decimal((sign, tuple(significant), exponent + len(digits) - len(significant)))


def parse_rate(rate: str) -> tuple[Fraction, Fraction]:
    """Parse ``"N/unit"`` or ``"N/Munit"`` into ``(tokens, period_seconds)``.

    Units are ``s``, ``m``, ``h``, ``d`` and the words DRF users write: ``sec``,
    ``min``, ``hr``, ``second``, ``minute``, ``hour``, ``day`` (singular or plural).
    ``"5/10m"`` is five per ten minutes.
    """
    if not isinstance(rate, str):
        raise ValueError(f"rate string must be a str, not {shown(rate)}")
    if len(rate) > _MAX_RATE_LENGTH:
        # Longer than any rate the grammar means; int() of a 4,301-digit count would fail
        # with a message naming neither the rate nor the limit.
        raise ValueError(f"invalid rate {shown(rate)}: longer than {_MAX_RATE_LENGTH} characters")
    # A DRF throttle parses its rate each time it is made, twice per request.
    return _parse_rate(str(rate))


_MAX_RATE_LENGTH = 40


@lru_cache(maxsize=256)
def _parse_rate(rate: str) -> tuple[Fraction, Fraction]:
    match = _RATE_RE.fullmatch(rate)
    if match is None:
        raise ValueError(
            f"invalid rate {rate!r}: expected 'N/unit' or 'N/Munit' with N and M "
            f"positive ASCII integers and the unit one of: {UNIT_SPELLINGS} "
            f"(e.g. '10/m', '5/10min', '1000/day')"
        )
    count = int(match["count"])
    multiplier = int(match["multiplier"]) if match["multiplier"] is not None else 1
    if count <= 0:
        raise ValueError(f"invalid rate {rate!r}: the number of tokens must be positive")
    if multiplier <= 0:
        raise ValueError(f"invalid rate {rate!r}: the period must be positive")
    return Fraction(count), Fraction(multiplier * UNIT_SECONDS[match["unit"]])


def parse_period(period: object) -> Fraction:
    """Return a period given in seconds (a number) or as a timedelta, in seconds."""
    if isinstance(period, timedelta):
        seconds = Fraction(period.days * 86400 + period.seconds) + Fraction(period.microseconds, 1_000_000)
    else:
        seconds = to_fraction(period, "period")
    if seconds <= 0:
        raise ValueError(f"period must be positive, not {shown(period)}")
    return seconds
