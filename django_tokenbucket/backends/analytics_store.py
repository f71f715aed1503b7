"""What every backend's denial-analytics storage checks and shares (``BaseBackend.write_analytics``...).

The backends only store what the aggregation (``django_tokenbucket.analytics``) hands
them; these helpers make the two stores refuse the same bad input with the same
messages, and merge the records of one write that land on the same stored counter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from .base import MINUTES_KEPT, DeniedKeyCount, MinuteCounts

__all__ = [
    "MAX_SPAN_MINUTES",
    "checked_limit",
    "checked_span",
    "merged_keys",
    "merged_minutes",
]

#: The longest span a read may cover: twice the retention. Longer reads could only add
#: minutes that are no longer stored, and on Redis each hour read is one more command.
MAX_SPAN_MINUTES = 2 * MINUTES_KEPT

_DIGEST = re.compile(r"[0-9a-f]{64}")


def _is_int(value: object) -> bool:
    # bool is an int to Python, never a count or a minute here.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value: object) -> bool:
    return _is_int(value) and isinstance(value, int) and value >= 0


def checked_span(what: str, since: object, until: object) -> tuple[int, int]:
    """Return (since, until) checked: whole minutes, 0 <= since <= until, at most ``MAX_SPAN_MINUTES`` apart.

    ``what`` names the limit(s) read, for the message.
    """
    if not (_is_int(since) and _is_int(until) and isinstance(since, int) and isinstance(until, int)):
        raise ValueError(f"{what}: since and until are whole minutes since the epoch, not {since!r} and {until!r}")
    if since < 0:
        raise ValueError(f"{what}: since must be >= 0, not {since}")
    if since > until:
        raise ValueError(f"{what}: since ({since}) is after until ({until})")
    if until - since > MAX_SPAN_MINUTES:
        raise ValueError(
            f"{what}: a span of {until - since} minutes is longer than the {MAX_SPAN_MINUTES} a read may cover"
        )
    return since, until


def checked_limit(name: str, limit: object) -> int:
    """Return ``limit`` checked to be a whole number >= 1 (how many keys to return)."""
    if not (_is_count(limit) and isinstance(limit, int) and limit >= 1):
        raise ValueError(f"rate limit {name!r}: limit must be a whole number >= 1, not {limit!r}")
    return limit


def _check_common(name: object, minute: object, counts: Iterable[tuple[str, object]], max_name: int | None) -> None:
    if not isinstance(name, str) or not name:
        raise ValueError(f"analytics: {name!r} is not a limit name")
    if max_name is not None and len(name) > max_name:
        raise ValueError(f"rate limit {name!r}: the name is longer than {max_name} characters")
    if not _is_count(minute):
        raise ValueError(f"rate limit {name!r}: {minute!r} is not a minute (whole minutes since the epoch)")
    for field, count in counts:
        if not _is_count(count):
            raise ValueError(f"rate limit {name!r}: {field} must be a whole number >= 0, not {count!r}")


def merged_minutes(minutes: Sequence[MinuteCounts], *, max_name: int | None = None) -> list[tuple[str, int, int, int]]:
    """Return (name, minute, allowed, denied) per stored counter, checked, summed and sorted.

    Summed: a single upsert statement may not touch one row twice (PostgreSQL refuses
    "ON CONFLICT DO UPDATE command cannot affect row a second time"). Sorted: writers
    then lock the rows they share in the same order, which keeps concurrent flushes
    from deadlocking each other. ``max_name`` is the longest name the store can hold.
    """
    summed: dict[tuple[str, int], list[int]] = {}
    for counts in minutes:
        _check_common(counts.name, counts.minute, (("allowed", counts.allowed), ("denied", counts.denied)), max_name)
        total = summed.setdefault((counts.name, counts.minute), [0, 0])
        total[0] += counts.allowed
        total[1] += counts.denied
    return [(name, minute, allowed, denied) for (name, minute), (allowed, denied) in sorted(summed.items())]


def merged_keys(
    keys: Sequence[DeniedKeyCount], *, max_name: int | None = None, label_length: int | None = None
) -> list[tuple[str, int, str, str, int]]:
    """Return (name, minute, digest, label, denied) per stored counter, checked, summed and
    sorted (see ``merged_minutes``); labels cut to ``label_length`` (the first one seen wins)."""
    summed: dict[tuple[str, int, str], tuple[str, int]] = {}
    for key in keys:
        _check_common(key.name, key.minute, (("denied", key.denied),), max_name)
        if not isinstance(key.digest, str) or not _DIGEST.fullmatch(key.digest):
            raise ValueError(f"rate limit {key.name!r}: {key.digest!r} is not a key digest (64 lowercase hex digits)")
        if not isinstance(key.label, str):
            raise ValueError(f"rate limit {key.name!r}: the label of key {key.digest} is not a string: {key.label!r}")
        label = key.label if label_length is None else key.label[:label_length]
        kept, denied = summed.get((key.name, key.minute, key.digest), (label, 0))
        summed[key.name, key.minute, key.digest] = (kept, denied + key.denied)
    return [(name, minute, digest, label, denied) for (name, minute, digest), (label, denied) in sorted(summed.items())]
