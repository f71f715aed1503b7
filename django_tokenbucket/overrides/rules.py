"""What an override is and how it changes a limit: pure, no I/O.

An override replaces some of a limit's numbers for one key (``limit``), lets every call
through (``exempt``) or refuses every call (``block``), for every key of the limit or
one, until it expires. This module holds its value (``Override``), how a ``limit``
override changes a ``LimitConfig`` (``derive``, checked by ``check_admits``), the one
parser of the numbers a caller gives an override (``numbers``: the API, the admin and
the command all use it), and the key it is stored under, built as requests build
theirs (``key_digest``). The snapshot (``snapshot``) and the rows (``store``) use it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from fractions import Fraction
from typing import Any, NamedTuple

from django.core.exceptions import ImproperlyConfigured

from ..algorithms import MICRO
from ..keys import Redacted, encode_key, is_request_data_key
from ..limits import LimitConfig, parse_limit, to_micro
from ..rates import parse_period, parse_rate, to_fraction
from ..request_keys import canonical_spec, ip_key_from_text, normalize_identity
from ..settings import OverridesSettings as Settings

__all__ = [
    "ACTIONS",
    "BLOCK",
    "EXEMPT",
    "LIMIT",
    "LONGEST",
    "LONGEST_TEXT",
    "NUMBERS",
    "Digest",
    "Override",
    "Settings",
    "check_admits",
    "derive",
    "key_digest",
    "numbers",
]

LIMIT = "limit"
EXEMPT = "exempt"
BLOCK = "block"
ACTIONS = (LIMIT, EXEMPT, BLOCK)
#: The fields of a ``limit`` override, as LimitConfig and the model name them.
NUMBERS = ("rate", "period", "capacity", "max_reserved")


@dataclass(frozen=True, slots=True)  # slots: a process may hold 10^5 of them (docs/settings.md#overrides)
class Override:
    """One override as this process holds it: what a ``LimitOverride`` row says, in the
    units decisions use."""

    name: str
    #: The key's digest; "" for every key of the limit.
    digest: str
    action: str
    rate: int | None = None
    period: int | None = None
    capacity: int | None = None
    max_reserved: int | None = None
    #: µs since the epoch; None: never.
    expires: int | None = None
    #: The last limit this override was applied to, and the result: a decision applies
    #: it to the same LimitConfig object every time.
    _applied: tuple[LimitConfig, LimitConfig] | None = field(default=None, compare=False, repr=False)

    def in_force(self, now: int) -> bool:
        """Whether this override applies at ``now`` (µs since the epoch)."""
        return self.expires is None or now < self.expires

    def wait(self, now: int) -> float | None:
        """Seconds from ``now`` (µs) until this override ends; None when it never does."""
        return None if self.expires is None else max(0, self.expires - now) / MICRO

    def config(self, base: LimitConfig) -> LimitConfig:
        """Return ``base`` with this override's numbers in place (a ``limit`` override)."""
        applied = self._applied
        if applied is not None and applied[0] is base:
            return applied[1]
        derived = derive(base, self.rate, self.period, self.capacity, self.max_reserved)
        object.__setattr__(self, "_applied", (base, derived))
        return derived


def derive(
    base: LimitConfig, rate: int | None, period: int | None, capacity: int | None, max_reserved: int | None
) -> LimitConfig:
    """Return ``base`` with the numbers given (micro-units) replacing its own.

    Validated as a limit in ``LIMITS`` is (ImproperlyConfigured naming the limit). A
    capacity not given follows a new rate when the limit's capacity is its rate (the
    default, as in a limit written with that rate), and stays what it was otherwise.
    """
    spec: dict[str, Any] = {
        "kind": base.kind,
        "rate": Fraction(base.rate if rate is None else rate, MICRO),
        "period": Fraction(base.period if period is None else period, MICRO),
        "shadow": base.shadow,
        "shards": base.shards,
        "backend": base.backend,
        "deny_cache": base.deny_cache,
    }
    if capacity is not None:
        spec["capacity"] = Fraction(capacity, MICRO)
    elif rate is None or base.capacity != base.rate:
        spec["capacity"] = Fraction(base.capacity, MICRO)
    reserved = base.max_reserved if max_reserved is None else max_reserved
    if reserved is not None:
        spec["max_reserved"] = Fraction(reserved, MICRO)
    if base.start is not None:
        spec["start"] = Fraction(base.start, MICRO)
    return parse_limit(base.name, spec)


#: The furthest an override may end from now (100 years). Further is a slip of the
#: keyboard rather than a plan (None lasts until cleared), and soon past what a datetime
#: holds (year 9999): ``now + until`` would raise OverflowError, and a database would
#: store an end it cannot read back.
LONGEST = timedelta(days=36_525)
LONGEST_TEXT = "100 years"


class Digest(NamedTuple):
    """A key known by its digest only (a bucket page's, a stored row's): stored as it is."""

    digest: str
    label: str = ""


def key_digest(name: str, key: object) -> Digest:
    """Return the digest and label an override of ``key`` is stored under ("" for every key).

    A key of request data (``("post:username", "Alice@Example.com ")``,
    ``("header:X-Api-Key", ...)``) is normalised as the decorator normalises what a
    request sends, and an address (``("ip", "2001:db8::7")``, ``("ip", "::ffff:192.0.2.9")``)
    becomes the network or IPv4 address that keys its requests, so that the override
    reaches the bucket that request's decisions use. ValueError naming limit ``name``
    when ``key`` cannot be a key.
    """
    if key is None:
        return Digest("")
    if isinstance(key, Digest):
        return key
    if is_request_data_key(key) and isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], str):
        key = (canonical_spec(key[0]), Redacted(normalize_identity(key[1])))
    elif isinstance(key, tuple) and len(key) == 2 and key[0] == "ip" and isinstance(key[1], str):
        key = ip_key_from_text(key[1]) or key
    try:
        encoded = encode_key(key)
    except TypeError as exc:
        raise ValueError(f"rate limit {name!r}: {exc}") from None
    return Digest(encoded.digest, encoded.label)


def check_admits(limit: LimitConfig, numbers: Mapping[str, int | None]) -> None:
    """Raise ValueError naming the limit unless ``numbers`` (micro-units, None: the limit's
    own) make a valid limit of ``limit`` that can admit a call of one token."""
    try:
        derived = derive(limit, **(dict.fromkeys(NUMBERS) | dict(numbers)))
    except ImproperlyConfigured as exc:
        raise ValueError(f"{exc} (in an override)") from None
    if derived.max_plain_count < MICRO and (derived.max_count or 0) < MICRO:
        raise ValueError(
            f"rate limit {limit.name!r}: this override could never admit a call of one token "
            f"(capacity {derived.capacity_tokens:g}); give a capacity of at least 1, or block the key"
        )


def numbers(
    limit: LimitConfig,
    rate: str | int | float | Fraction | None = None,
    period: int | float | timedelta | None = None,
    capacity: object = None,
    max_reserved: object = None,
) -> dict[str, int | None]:
    """Return the numbers of a ``limit`` override of ``limit`` in micro-units (None: the limit's own).

    ``rate`` is a rate string (``"100/m"``: its period replaces the limit's) or tokens
    per ``period``; ``period`` seconds or a timedelta; ``capacity`` and ``max_reserved``
    tokens (a number, a Decimal from a form). Only the numbers given are stored, so that
    the others follow LIMITS if it changes. ValueError naming the limit when they are
    not numbers a limit can have, or could never admit a call of one token.
    """
    found: dict[str, int | None] = dict.fromkeys(NUMBERS)
    try:
        if rate is None and period is None and capacity is None and max_reserved is None:
            raise ValueError(
                "give at least one of rate, period, capacity and max_reserved (or use exempt() or block())"
            )
        seconds = None
        if isinstance(rate, str):
            if period is not None:
                raise ValueError(f"give the period either in the rate string {rate!r} or as period, not both")
            tokens, seconds = parse_rate(rate.strip())
        elif rate is not None:
            tokens = to_fraction(rate, "rate")
        if rate is not None:
            if tokens <= 0:
                raise ValueError(f"rate must be positive, not {rate!r}")
            found["rate"] = to_micro(tokens, "rate", rate)
        if period is not None:
            seconds = parse_period(period)
        if seconds is not None:
            micro = seconds * MICRO
            if micro.denominator != 1:
                raise ValueError(f"period must be a whole number of microseconds, not {float(seconds)!r} seconds")
            found["period"] = int(micro)
        for what, amount in (("capacity", capacity), ("max_reserved", max_reserved)):
            if amount is None:
                continue
            tokens = to_fraction(amount, what)
            if tokens < 0 or (tokens == 0 and what == "capacity"):
                raise ValueError(f"{what} must be {'positive' if what == 'capacity' else 'at least 0'}, not {amount}")
            found[what] = to_micro(tokens, what, amount)
    except ValueError as exc:
        raise ValueError(f"rate limit {limit.name!r}: override: {exc}") from None
    check_admits(limit, found)
    return found
