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

__all__ = ["UNIT_SECONDS", "Number", "parse_period", "parse_rate", "to_fraction"]

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

#: How error messages list the units.
UNIT_SPELLINGS = "s, m, h, d, or sec, min, hr, second, minute, hour, day (and their plurals)"

_RATE_RE = re.compile(
    r"(?P<count>[0-9]+)/(?P<multiplier>[0-9]+)?(?P<unit>"
    + "|".join(sorted(UNIT_SECONDS, key=len, reverse=True))
    + ")",
    re.ASCII,
)


def to_fraction(value: object, what: str) -> Fraction:
    """Return ``value`` as an exact Fraction, or raise ValueError naming ``what``.

    Floats go through their shortest repr, so ``0.1`` means one tenth, as the author
    of the setting meant, rather than the nearest binary fraction.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float, Decimal, Fraction)):
        raise ValueError(f"{what} must be a number, not {value!r}")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{what} must be finite, not {value!r}")
        return Fraction(repr(value))
    if isinstance(value, Decimal):
        if not value.is_finite():
            raise ValueError(f"{what} must be finite, not {value!r}")
    return Fraction(value)


def parse_rate(rate: str) -> tuple[Fraction, Fraction]:
    """Parse ``"N/unit"`` or ``"N/Munit"`` into ``(tokens, period_seconds)``.

    Units are ``s``, ``m``, ``h``, ``d`` and the words DRF users write: ``sec``,
    ``min``, ``hr``, ``second``, ``minute``, ``hour``, ``day`` (singular or plural).
    ``"5/10m"`` is five per ten minutes.
    """
    if not isinstance(rate, str):
        raise ValueError(f"rate string must be a str, not {rate!r}")
    # A DRF throttle parses its rate each time it is made, twice per request.
    return _parse_rate(str(rate))


@lru_cache(maxsize=256)
def _parse_rate(rate: str) -> tuple[Fraction, Fraction]:
    match = _RATE_RE.fullmatch(rate)
    if match is None:
        raise ValueError(
            f"invalid rate {rate!r}: expected 'N/unit' or 'N/Munit' with N and M "
            f"positive ASCII integers and unit one of {UNIT_SPELLINGS} "
            f"(e.g. '10/m', '5/10m', '1000/day', '60/min')"
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
        raise ValueError(f"period must be positive, not {period!r}")
    return seconds
