"""What the admin and the command do with runtime overrides, beside ``limiter.override``.

``limiter.override``/``exempt``/``block`` take a key as callers give it; an operator
types one (``post:username=Alice@Example.com``, as ``tokenbucket show --key`` takes it),
and on a bucket page, or when editing a stored override, has only its digest (Redis
keeps no label, request data is never stored in clear). This module turns what an
operator types into what the API takes (a key, a duration), makes and edits overrides
of a digest with the API's checks, and says what an override does in words. Every
write goes through ``overrides.make``/``overrides.delete``, which bump the version
stamp in the same transaction, so every process notices.
"""

from __future__ import annotations

import getpass
import json
import re
import socket
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from fractions import Fraction
from typing import Any

from django.core.exceptions import ImproperlyConfigured
from django.utils import timezone

from . import clock, operations, overrides, registry
from .algorithms import MICRO
from .api import limiter
from .backends.base import BackendError
from .compat.ratelimit.keys import key_from_text as compat_key_from_text
from .keys import encode_key, key_from_json, label_as_typed
from .limits import LimitConfig, to_micro
from .models import LimitOverride
from .rates import UNIT_SECONDS, shown, to_fraction
from .request_keys import canonical_spec, key_from_text
from .settings import tokenbucket_settings
from .text import describe_rate, format_duration, format_tokens

__all__ = [
    "DURATION_HINT",
    "KEY_FORMS",
    "KEY_HINT",
    "Panel",
    "author",
    "describe_expiry",
    "describe_numbers",
    "ends",
    "expire",
    "factor_of",
    "in_local_time",
    "key_from_spec",
    "multiplied",
    "now",
    "numbers_from_text",
    "operator_key",
    "override_spec_key",
    "panel",
    "parse_duration",
    "rate_text",
    "reached",
    "refused_views",
    "replaced",
    "resave",
    "save_digest",
    "shown_key",
]

KEY_HINT = "e.g. post:username=alice, username=alice, header:X-Api-Key=..., get:q=..., ip=203.0.113.7, user=42"
DURATION_HINT = "e.g. 90s, 30m, 1h, 7d, 2w"

_WEEK = 7 * 86_400
#: Longer than any number or duration an operator types means: refused before it is read.
_MAX_NUMBER_LENGTH = 40
#: The range of "give ×N".
_MAX_FACTOR = 1_000_000
_FACTOR_RANGE = f"the factor must be a number above 0 and at most {_MAX_FACTOR:,}"
_DURATION = re.compile(r"\s*([0-9]{1,9})\s*([a-z]+)\s*", re.ASCII)
#: The largest unit first: how a period is written back as a rate string.
_RATE_UNITS = ((86_400, "d"), (3_600, "h"), (60, "m"), (1, "s"))


def now() -> datetime:
    """Return the time decisions compare expiries with (pinned by ``frozen_clock``), as an aware datetime."""
    return datetime.fromtimestamp(clock.app_now() / MICRO, tz=UTC)


def parse_duration(text: str) -> timedelta:
    """Return ``"90s"``, ``"30m"``, ``"1h"``, ``"7d"``, ``"2w"`` as a timedelta; ValueError otherwise.

    The units of rate strings (``s``, ``m``/``min``, ``h``, ``d``, and their words) and
    weeks: one number and one unit, which is what an operator writes for "block for a
    week" and never reads two ways. At most ``overrides.LONGEST`` (100 years), the
    longest an override may last.
    """
    # The pattern takes 9 digits at most: int() of them costs nothing, whatever was sent.
    match = _DURATION.fullmatch(text.lower()) if len(text) <= _MAX_NUMBER_LENGTH else None
    seconds = None
    if match is not None:
        unit = match[2]
        size = _WEEK if unit in ("w", "week", "weeks") else UNIT_SECONDS.get(unit)
        seconds = None if size is None else int(match[1]) * size
    if not seconds:
        raise ValueError(f"{shown(text)} is not a duration ({DURATION_HINT})")
    if seconds > overrides.LONGEST.total_seconds():
        raise ValueError(f"{shown(text)} is a duration longer than {overrides.LONGEST_TEXT}")
    return timedelta(seconds=seconds)


def key_from_spec(name: str, text: str) -> object:
    """Return the key ``SPEC=VALUE`` stands for (as ``tokenbucket show --key``), None for "" (every key).

    Built as the requests of limit ``name`` build theirs: by ``@ratelimit`` and the DRF
    throttles, or, for a limit of the django-ratelimit layer, as that layer does (a masked
    address, a user id as text). ValueError naming limit ``name`` when it is not
    SPEC=VALUE, or its address is not one.
    """
    if not text.strip():
        return None
    compat = registry.is_compat_limit(name)
    key = compat_key_from_text(text) if compat else key_from_text(text)
    if key is None:
        spec, separator, value = text.partition("=")
        if separator and spec.strip() == "ip":
            problem = f"{shown(value.strip())} is not an IP address"
            raise ValueError(f"rate limit {name!r}: key {shown(text.strip())}: {problem}")
        raise ValueError(f"rate limit {name!r}: key {shown(text.strip())} is not SPEC=VALUE ({KEY_HINT})")
    return key


#: How an operator may write a key (the admin's choice; the command's KEY, --key, --json).
KEY_FORMS = {
    "auto": "SPEC=VALUE as a view's key= builds it (ip=…, user=…, header:…=…), else the text",
    "text": "the text, as passed to the API: 42 and \"42\" are one bucket, a UUID its text",
    "json": 'JSON, as passed to the API: 42, "alice", ["tenant", 7] (a tuple)',
}


def operator_key(name: str, text: str, form: str = "auto") -> tuple[object, str | None]:
    """Return the key an operator wrote for limit ``name`` in ``form`` (``KEY_FORMS``),
    None for an empty text (every key of the limit), and a warning for the operator.

    ``auto`` takes SPEC=VALUE (``override_spec_key``) when the text starts with a spec the
    decorator knows, and the text itself otherwise: the Quick start's
    ``key=request.user.pk`` is reached by typing ``1``. ValueError naming the limit for
    what no key is.
    """
    if not text.strip():
        return None, None
    if form == "json":
        try:
            return key_from_json(json.loads(text)), None
        except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
            raise ValueError(f"rate limit {name!r}: key {shown(text)} is not a key as JSON: {exc}") from None
    if form == "text":
        return text, None
    if form != "auto":
        raise ValueError(f"rate limit {name!r}: {shown(form)} is not a way to write a key ({', '.join(KEY_FORMS)})")
    spec, separator, _value = text.partition("=")
    if not separator or not _is_spec(spec.strip()):
        return text, None
    return override_spec_key(name, text)


def override_spec_key(name: str, text: str) -> tuple[object, str | None]:
    """``key_from_spec`` for an override, and what to tell the operator when the views of
    limit ``name`` are known and none keys by the spec typed: a limit that only views use
    (an inline one) is refused with a ValueError (the override would reach no request's
    bucket); one of ``LIMITS``, which code may also decide with keys of its own, is
    warned about."""
    key = key_from_spec(name, text)
    problem = _unused_spec(name, canonical_spec(text.partition("=")[0].strip()))
    if problem is not None and name not in tokenbucket_settings.limits():
        raise ValueError(problem)
    return key, problem


def _is_spec(spec: str) -> bool:
    kind, colon, field = canonical_spec(spec).partition(":")
    return spec in ("ip", "user", "username") or (bool(colon) and bool(field) and kind in ("header", "get", "post"))


def _unused_spec(name: str, spec: str) -> str | None:
    """Say so when the views of limit ``name`` are known and none keys by ``spec``: an
    override of it reaches a bucket no view's request uses (``user=1`` on a limit keyed by
    address). None when one does, or when no view is known or one keys by a callable."""
    uses = registry.uses(name)
    if not uses or any(use.key is None or "." in use.key for use in uses):
        return None
    keyed_by = {canonical_spec(use.key) for use in uses if use.key is not None}
    reachable = set(keyed_by) | ({"ip", "user"} if "user_or_ip" in keyed_by else set())
    if spec in reachable:
        return None
    views = ", ".join(sorted(f"{use.view} (key={use.key!r})" for use in uses))
    return (
        f"rate limit {name!r}: no view keys it by {spec!r}, so an override of {spec}=… reaches a bucket "
        f"no view's request uses; its views: {views}"
    )


def reached(limit: LimitConfig, key: object) -> str:
    """Say which bucket an override of ``key`` reaches, and whether the store holds it: an
    operator who typed the wrong key sees "never stored" rather than a silent no-op."""
    if key is None:
        return "every key of the limit"
    encoded = encode_key(key)
    shown = encoded.label or f"{encoded.digest[:12]}…"
    try:
        stored = operations.is_stored(operations.store_of(limit), limit, encoded)
    except BackendError:
        stored = None
    if stored is None:
        state = "the store cannot say whether it holds it"
    elif stored:
        state = "stored: requests have used it"
    else:
        state = "not stored: no request has used it lately (a key nobody uses, or one full again)"
    return f"the bucket {shown} (digest {encoded.digest[:12]}…), {state}"


def author(user: str | None = None) -> str:
    """Return ``created_by`` for a change made from a shell: ``manage.py tokenbucket (user@host)``.

    The OS account and the host say who ran it where a web login cannot; ``user``, when
    given (``--created-by``), replaces them (the limiter refuses one past 150 characters).
    """
    if user:
        return user
    try:
        login = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry for the uid (a container)
        login = "unknown"
    return f"manage.py tokenbucket ({login}@{socket.gethostname()})"[:150]


def shown_key(row: LimitOverride) -> str:
    """The key of ``row`` as the admin and the command show it: its label, its digest's prefix, or every key."""
    if row.every_key:
        return "every key"
    return label_as_typed(row.label) or f"{row.key[:12]}…"


def _stored(row: LimitOverride) -> dict[str, int | None]:
    return {number: getattr(row, number) for number in overrides.NUMBERS}


def _derived(row: LimitOverride, limit: LimitConfig | None) -> LimitConfig | None:
    if limit is None:
        return None
    try:
        return overrides.derive(limit, **_stored(row))
    except ImproperlyConfigured:  # the limit changed since: its numbers no longer fit
        return None


def refused_views(row: LimitOverride, limit: LimitConfig | None) -> list[str]:
    """Return a warning for each view whose ``count=`` is more than ``row`` lets any call
    take: every request of the keys it covers is refused there (429) until it ends."""
    derived = _derived(row, limit) if row.action == overrides.LIMIT else None
    if derived is None:
        return []
    return [
        f"{use.view} counts {format_tokens(use.count)} per request, more than this override's capacity "
        f"{format_tokens(derived.capacity)}: its requests of {shown_key(row)} are refused until the override ends"
        for use in sorted(registry.uses(row.name), key=lambda use: use.view)
        if use.count is not None and use.count > derived.max_plain_count
    ]


def describe_numbers(row: LimitOverride, limit: LimitConfig | None) -> str:
    """What ``row`` lets through, in words: "always allowed", "always refused", or the rate in force.

    ``limit`` is the limit's config (None when it is no longer configured: the stored
    numbers are shown as they are).
    """
    if row.action == overrides.EXEMPT:
        return "always allowed, nothing counted"
    if row.action == overrides.BLOCK:
        return "always refused"
    derived = _derived(row, limit)
    if derived is not None:
        return describe_rate(derived, kind=False)
    parts = []
    if row.rate is not None:
        period = f" per {format_duration(row.period)}" if row.period is not None else ""
        parts.append(f"rate {format_tokens(row.rate)}{period}")
    elif row.period is not None:
        parts.append(f"period {format_duration(row.period)}")
    for number in ("capacity", "max_reserved"):
        if getattr(row, number) is not None:
            parts.append(f"{number} {format_tokens(getattr(row, number))}")
    return ", ".join(parts) or "the limit's own numbers"


def ends(row: LimitOverride) -> datetime | None:
    """Return when ``row`` ends as an aware datetime (None: never), whatever ``USE_TZ`` says."""
    if row.expires_at is None or timezone.is_aware(row.expires_at):
        return row.expires_at
    return timezone.make_aware(row.expires_at)


def in_local_time(moment: datetime) -> datetime:
    """Return ``moment`` in the project's time zone, or as it is (UTC, from the database)
    when that zone's clock would pass year 9999: an end stored before ``overrides.LONGEST``
    bounded it must not make every page and listing that shows it fail."""
    try:
        return timezone.localtime(moment)
    except OverflowError:
        return moment


def describe_expiry(row: LimitOverride, at: datetime | None = None) -> str:
    """When ``row`` ends: "never", "in 2 h (2026-11-26 12:00 UTC)", or "expired 2026-11-26 12:00 UTC"."""
    end = ends(row)
    if end is None:
        return "never"
    at = at or now()
    moment = in_local_time(end).strftime("%Y-%m-%d %H:%M:%S %Z")
    if end <= at:
        return f"expired {moment}"
    left = (end - at) // timedelta(microseconds=1)
    return f"in {format_duration(left)} ({moment})"


def rate_text(row: LimitOverride, limit: LimitConfig | None) -> str:
    """Return ``row``'s rate as a rate string (``"100/m"``, ``"5/90s"``), "" when it has none.

    A rate in fractions of a token has no rate string: it shows as ``tokens/seconds``,
    which a form given it back unchanged keeps as it is.
    """
    if row.rate is None:
        return ""
    period = row.period if row.period is not None else (limit.period if limit is not None else None)
    if period is None:
        return ""
    tokens = format_tokens(row.rate).replace(",", "")
    if period % MICRO:
        return f"{tokens}/{Decimal(period) / MICRO}s"
    seconds = period // MICRO
    for size, unit in _RATE_UNITS:
        if seconds % size == 0:
            count = seconds // size
            return f"{tokens}/{'' if count == 1 else count}{unit}"
    return f"{tokens}/{seconds}s"  # pragma: no cover - 1 divides every period


def numbers_from_text(
    limit: LimitConfig, rate: str | None, capacity: Decimal | None, max_reserved: Decimal | None
) -> dict[str, int | None]:
    """Return the numbers of a ``limit`` override as a form gives them (``overrides.numbers``).

    ``rate`` is a rate string (``"100/m"``: its period replaces the limit's), "" or None
    for the limit's own. ValueError naming the limit: the checks ``limiter.override`` makes.
    """
    return overrides.numbers(limit, rate or None, None, capacity, max_reserved)


def factor_of(text: str) -> Fraction:
    """Return the N of "give ×N" as typed in a form; ValueError when it is not a number above 0
    and at most 1,000,000.

    Bounded before it is built: the exact Fraction of ``"1e3000000"`` is a 10**3000000
    integer, seconds of CPU per POST, before any range check could refuse it.
    """
    text = text.strip()
    if len(text) > _MAX_NUMBER_LENGTH:
        raise ValueError(f"×{shown(text)}: {_FACTOR_RANGE}")
    try:
        number = Decimal(text)
    except ArithmeticError:
        raise ValueError(f"×{text!r}: not a number; {_FACTOR_RANGE}") from None
    # Compared as a Decimal (its exponent first, whatever its size), then made exact:
    # to_fraction refuses what has more digits or places than a factor can use.
    if not number.is_finite() or not 0 < number <= _MAX_FACTOR:
        raise ValueError(f"×{text}: {_FACTOR_RANGE}")
    try:
        return to_fraction(number, "the factor")
    except ValueError as exc:
        raise ValueError(f"×{text}: {exc}; {_FACTOR_RANGE}") from None


def multiplied(limit: LimitConfig, factor: Fraction) -> dict[str, int | None]:
    """Return the numbers of "give ×``factor``": the limit's rate and capacity times ``factor``."""
    if factor <= 0:
        raise ValueError(f"rate limit {limit.name!r}: the factor must be positive, not {float(factor):g}")
    numbers: dict[str, int | None] = dict.fromkeys(overrides.NUMBERS)
    try:
        numbers["rate"] = to_micro(Fraction(limit.rate, MICRO) * factor, "rate", float(factor))
        numbers["capacity"] = to_micro(Fraction(limit.capacity, MICRO) * factor, "capacity", float(factor))
    except ValueError as exc:
        raise ValueError(f"rate limit {limit.name!r}: ×{float(factor):g}: {exc}") from None
    overrides.check_admits(limit, numbers)
    return numbers


def replaced(name: str, digest: str) -> LimitOverride | None:
    """Return the stored override (in force or not) that one of key ``digest`` of ``name`` would replace."""
    return LimitOverride.objects.using(overrides.database_alias()).filter(name=name, key=digest).first()


def save_digest(
    name: str,
    digest: str,
    label: str,
    action: str,
    *,
    numbers: dict[str, int | None] | None = None,
    until: timedelta | datetime | None = None,
    reason: str = "",
    created_by: str = "",
) -> LimitOverride:
    """Create or replace the override of the key whose digest is ``digest`` ("" every key).

    For a bucket page, which knows a key by its digest only: ``limiter.override`` with
    a key otherwise. ``numbers`` come from ``numbers_from_text`` or ``multiplied``
    (checked there); ImproperlyConfigured when the limit is unknown or overrides are
    off, ValueError naming the limit for an ``until`` not in the future.
    """
    limiter.resolve(name)  # an unknown limit is an error, not a row nobody reads
    return overrides.make(
        name,
        overrides.Digest(digest, label),
        action,
        numbers,
        until=until,
        reason=reason,
        created_by=created_by[:150],
    )


def resave(row: LimitOverride, **changes: Any) -> LimitOverride:
    """Write ``row`` again with ``changes`` (numbers, ``expires_at``, ``reason``) through
    ``overrides.make``: its checks, the version stamp bumped.

    An ``expires_at`` is kept as given, even if it passed: an edited reason must not fail
    on an override that expired, and ``expire`` ends one now.
    """
    current: dict[str, Any] = {**_stored(row), "expires_at": row.expires_at, "reason": row.reason, **changes}
    return overrides.make(
        row.name,
        overrides.Digest(row.key, row.label),
        row.action,
        {number: current[number] for number in overrides.NUMBERS},
        ends=current["expires_at"],
        reason=current["reason"],
        created_by=row.created_by,
    )


def expire(row: LimitOverride) -> bool:
    """End ``row`` now (it stays listed, marked expired); False when it had ended already."""
    at, end = now(), ends(row)
    if end is not None and end <= at:
        return False
    resave(row, expires_at=at)
    return True


@dataclass(frozen=True)
class Panel:
    """What a bucket page says about overrides: the key's own and its limit's, in force now."""

    own: LimitOverride | None
    every_key: LimitOverride | None

    @property
    def in_force(self) -> LimitOverride | None:
        """The override a decision on this key meets now: its own wins over its limit's."""
        return self.own or self.every_key


def panel(name: str, digest: str) -> Panel:
    """Return the overrides in force for key ``digest`` of limit ``name``, read from the database.

    Read from the rows rather than this process' snapshot, which may be MAX_AGE old.
    """
    rows = {
        row.key: row
        for row in LimitOverride.objects.using(overrides.database_alias()).filter(name=name, key__in=[digest, ""])
        if (end := ends(row)) is None or end > now()
    }
    return Panel(rows.get(digest), rows.get(""))
