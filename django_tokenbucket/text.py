"""Amounts, durations and limits as people read them (admin and management command)."""

from __future__ import annotations

from decimal import ROUND_FLOOR, Decimal

from .algorithms import MICRO
from .limits import LimitConfig

__all__ = ["describe_rate", "format_duration", "format_tokens", "printable"]

_UNITS = ((86_400, "d"), (3_600, "h"), (60, "min"), (1, "s"))
_PERIOD_NAMES = {1: "second", 60: "minute", 3_600: "hour", 86_400: "day"}


def printable(text: str) -> str:
    """Return ``text`` as it is when every character of it is printable, else its repr.

    For whatever a terminal shows that came from a request, a form or the database (a
    label, a reason, a stored name): ESC, BEL, the 8-bit CSI (0x9B) or a right-to-left
    override (U+202E) would be obeyed by the terminal, rewriting what the operator
    reads, rather than shown. A repr shows each of them as an escape, unambiguously.
    """
    return text if text.isprintable() else repr(text)


def format_tokens(micro: int, places: int | None = None) -> str:
    """Return ``micro`` micro-tokens as tokens: exact, or rounded down to ``places`` decimals.

    Rounded down, so that a bucket a micro-token short of full never reads as full.
    """
    amount = Decimal(micro) / MICRO
    if places is not None:
        amount = amount.quantize(Decimal(1).scaleb(-places), rounding=ROUND_FLOOR)
        return f"{amount:,.{places}f}".replace("-", "−")
    text = f"{amount:,f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text.replace("-", "−")


def format_duration(us: int) -> str:
    """Return a duration in microseconds as "0.25 s", "7.6 s", "12 s", "3 min 20 s", "2 h 5 min"...

    Rounded up: "full again in" must never promise a moment too early.
    """
    if us <= 0:
        return "0 s"
    if us < MICRO:
        milliseconds = -(-us // 1000)  # rounded up, as below
        return f"{milliseconds / 1000:.3f}".rstrip("0").rstrip(".") + " s"
    if us < 10 * MICRO:
        tenths = -(-us // (MICRO // 10))
        return f"{tenths / 10:.1f}".removesuffix(".0") + " s"
    whole = -(-us // MICRO)
    for index, (size, unit) in enumerate(_UNITS[:-1]):
        if whole >= size:
            # Two units, the smaller one rounded up.
            small_size, small_unit = _UNITS[index + 1]
            count = -(-us // (small_size * MICRO)) * small_size
            big, small = divmod(count, size)
            return f"{big} {unit}" + (f" {small // small_size} {small_unit}" if small else "")
    return f"{whole} s"


def describe_rate(limit: LimitConfig, *, kind: bool = True) -> str:
    """Return a one-line description such as "token bucket: 10 per minute, capacity 20".

    Without ``kind``, "10 per minute, capacity 20": for an override, which changes the
    numbers of a limit but never its kind.
    """
    period_us = limit.period
    if period_us % MICRO == 0 and period_us // MICRO in _PERIOD_NAMES:
        per = _PERIOD_NAMES[period_us // MICRO]
    else:
        per = format_duration(period_us)
    rate = f"{format_tokens(limit.rate)} per {per}"
    parts = [f"{limit.kind}: {rate}" if kind else rate, f"capacity {format_tokens(limit.capacity)}"]
    if limit.max_reserved is not None:
        parts.append(f"max_reserved {format_tokens(limit.max_reserved)}")
    if limit.algorithm.phased and limit.start is not None:
        parts.append(f"start {format_duration(limit.start) if limit.start else '0 s'}")
    if limit.shadow:
        parts.append("shadow mode")
    return ", ".join(parts)
