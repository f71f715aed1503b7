"""Delete the rows that no longer matter: limits that read as a fresh key would.

A full token bucket is the same state as a fresh one (and a full fixed window on a
fresh key's phase as a fresh window), so its row can go: the next call recreates it
and decides exactly as it would have. Without cleanup, every key ever seen (an
attacker's 10^6 usernames, say) keeps a row forever.

How it stays out of the way of live traffic:

- Candidates come from an index range, per limit: rows of that name last written
  before ``now - cleanup_span`` (every such row not in debt is full). Each is then
  confirmed with the same pure algorithm the backend decides with; a row that fails
  is kept and skipped.
- Batches of at most 1,000 rows, each in its own short transaction. On PostgreSQL and
  MySQL/MariaDB the rows are locked with ``SELECT ... FOR UPDATE SKIP LOCKED``: a row a
  request is deciding on right now is skipped, never waited for, and a row cleanup
  holds cannot change under it. MySQL/MariaDB batches run at READ COMMITTED, so no gap
  lock holds up the creation of new rows. SQLite has no row locks: its batches are
  one short IMMEDIATE transaction each.
- Rows of limit names this process cannot interpret (removed from ``LIMITS``, or an
  inline limit it has not seen) are reported, and deleted only on request.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from django.db import connections, transaction
from django.db.models import Count, Q

from ...algorithms import MICRO, State
from ...limits import LimitConfig
from ...live import cleanup_span, is_idle
from ...models import RateLimit
from ..base import MAX_BATCH_SIZE, UNKNOWN_IDLE, CleanupReport
from .retry import retrying

__all__ = ["SQLITE_PAUSE", "cleanup", "stored_names"]

logger = logging.getLogger("django_tokenbucket")

#: Seconds between batches on SQLite (see ``cleanup``).
SQLITE_PAUSE = 0.1


#: The bounds of ``unknown_idle`` (100 years: beyond, the span overflows a database
#: integer) and of ``pause`` (an hour between batches; time.sleep fails past 2**63 ns).
_LONGEST_IDLE = 36_525 * 86_400
_LONGEST_PAUSE = 3_600


def _check_seconds(what: str, value: object, most: float) -> None:
    """Raise ValueError unless ``value`` is a number of seconds from 0 to ``most`` (NaN is not)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= most:
        limit = "" if most == math.inf else f" up to {most:,}"
        raise ValueError(f"{what} must be a number of seconds >= 0{limit}, not {value!r}")


def stored_names(alias: str) -> dict[str, int]:
    """Return the number of stored rows per limit name in database ``alias``, in name order."""
    rows = RateLimit.objects.using(alias).order_by("name").values("name").annotate(rows=Count("pk"))
    return {row["name"]: row["rows"] for row in rows}


def cleanup(
    alias: str,
    limits: Mapping[str, LimitConfig],
    store_now: Callable[[str], int],
    *,
    names: Iterable[str] | None = None,
    batch_size: int = MAX_BATCH_SIZE,
    remove_unknown: bool = False,
    unknown_idle: float | None = None,
    dry_run: bool = False,
    max_seconds: float | None = None,
    pause: float | None = None,
) -> CleanupReport:
    """Delete idle rows of database ``alias`` in batches, read at ``store_now(alias)``;
    return what was done. The options are ``django_tokenbucket.cleanup.cleanup``'s (its
    docstring says what each does); on SQLite ``pause`` defaults to ``SQLITE_PAUSE``.
    """
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ValueError(f"batch_size must be between 1 and {MAX_BATCH_SIZE}, not {batch_size!r}")
    if unknown_idle is None:
        unknown_idle = UNKNOWN_IDLE
    # Checked before the first batch: a bad pause used to fail after it (time.sleep of
    # -1, NaN or inf), a NaN deadline never came, and an infinite idle time failed to round.
    _check_seconds("unknown_idle", unknown_idle, _LONGEST_IDLE)
    if max_seconds is not None:
        _check_seconds("max_seconds", max_seconds, math.inf)
    if pause is not None:
        _check_seconds("pause", pause, _LONGEST_PAUSE)
    unknown_span = round(unknown_idle * MICRO)
    if pause is None:
        # SQLite writers waiting for the lock poll, sleeping up to 100 ms between tries:
        # a cleanup that began its next batch at once would win the lock again and
        # again, starving them. Row-lock waiters elsewhere are woken at once.
        pause = SQLITE_PAUSE if connections[alias].vendor == "sqlite" else 0.0
    started = time.monotonic()
    deadline = None if max_seconds is None else started + max_seconds
    report = CleanupReport(dry_run=dry_run)

    stored = stored_names(alias)
    report.unknown = {name: rows for name, rows in stored.items() if name not in limits}
    # ``limits`` may read names it does not list (the buckets of a plan, named after
    # their config): those stored are walked too.
    listed = set(limits)
    found = [name for name in stored if name not in listed and name in limits]
    selected = [*limits, *found] if names is None else [name for name in names if name in limits]
    work: list[tuple[str, LimitConfig | None]] = [(name, limits[name]) for name in sorted(selected)]
    if remove_unknown and names is None:
        work += [(name, None) for name in sorted(report.unknown)]
    elif report.unknown:
        logger.info(
            "rate-limit cleanup: rows of limits this process cannot read were kept (decided with config= "
            "at call sites elsewhere, or no longer used): %s",
            ", ".join(f"{name!r} ({rows})" for name, rows in report.unknown.items()),
        )

    for name, limit in work:
        walk = _Walk(alias, store_now, name, limit, batch_size, dry_run, unknown_span)
        after: tuple[int, int] | None = None
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                report.complete = False
                break
            batch_started = time.monotonic()
            seen, idle, last = _batch(walk, after)
            elapsed = time.monotonic() - batch_started
            report.batches += 1
            report.slowest_batch = max(report.slowest_batch, elapsed)
            if idle:
                report.deleted[name] += idle
            report.kept += seen - idle
            if seen < batch_size or last is None:
                break
            after = last
            if pause and idle and not dry_run:
                time.sleep(pause)
        if not report.complete:
            break
    report.seconds = time.monotonic() - started
    if report.deleted_total or report.kept:
        logger.info("rate-limit cleanup: %s", report.as_dict())
    return report


@dataclass(frozen=True)
class _Walk:
    """One name's walk over its rows, in batches: what every batch of it shares."""

    alias: str
    store_now: Callable[[str], int]
    name: str
    #: None for a name no limit here knows: its rows go after ``unknown_span`` µs.
    limit: LimitConfig | None
    batch_size: int
    dry_run: bool
    unknown_span: int


def _batch(walk: _Walk, after: tuple[int, int] | None) -> tuple[int, int, tuple[int, int] | None]:
    """Run one batch; return (rows looked at, rows idle, keyset position to continue after).

    A serialization failure or deadlock (PostgreSQL SERIALIZABLE, InnoDB) only means the
    batch collided with live traffic: it runs again under the decisions' retry policy.
    """
    return retrying(walk.alias, lambda: _batch_once(walk, after), atomic=False)


def _batch_once(walk: _Walk, after: tuple[int, int] | None) -> tuple[int, int, tuple[int, int] | None]:
    alias, limit, batch_size = walk.alias, walk.limit, walk.batch_size
    connection = connections[alias]
    outermost = not connection.in_atomic_block
    with transaction.atomic(using=alias):
        if connection.vendor == "mysql" and outermost:
            # Must come before the transaction's first read. At REPEATABLE READ the
            # locking range read would also lock the gaps, holding up the insert of
            # every new key that falls into the range (new buckets have ts = 0).
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        now = walk.store_now(alias)
        rows_qs = RateLimit.objects.using(alias).filter(name=walk.name)
        rows_qs = rows_qs.filter(ts__lte=now - (walk.unknown_span if limit is None else cleanup_span(limit)))
        if after is not None:
            # Keyset pagination over (ts, id): rows kept or skipped are never looked at
            # twice, so a run always ends.
            rows_qs = rows_qs.filter(ts__gte=after[0]).filter(Q(ts__gt=after[0]) | Q(pk__gt=after[1]))
        rows_qs = rows_qs.order_by("ts", "pk")
        if connection.features.has_select_for_update_skip_locked and not walk.dry_run:
            rows_qs = rows_qs.select_for_update(skip_locked=True)
        rows = list(rows_qs.values_list("pk", "key", "value", "ts")[:batch_size])
        idle = [
            pk for pk, key, value, ts in rows if limit is None or is_idle(limit, State(value, ts), key, now)
        ]
        if idle and not walk.dry_run:
            RateLimit.objects.using(alias).filter(pk__in=idle).delete()
    last = (rows[-1][3], rows[-1][0]) if rows else None
    return len(rows), len(idle), last
