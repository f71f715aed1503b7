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
import time
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from django.db import connections, router, transaction
from django.db.models import Count, Q

from .algorithms import MICRO, State
from .backends import get_backend
from .backends.database import database_now as store_now
from .backends.database import retrying
from .limits import LimitConfig
from .live import cleanup_span, is_idle
from .models import RateLimit
from .registry import known_limits

__all__ = ["MAX_BATCH_SIZE", "UNKNOWN_IDLE", "CleanupReport", "cleanup", "database_alias", "unknown_names"]

logger = logging.getLogger("django_tokenbucket")

#: Larger batches hold their locks (and, on SQLite, the database) for longer.
MAX_BATCH_SIZE = 1000
#: Seconds between batches on SQLite (see ``cleanup``).
SQLITE_PAUSE = 0.1
#: Seconds without a write after which rows of a name no limit here knows may be removed
#: (``remove_unknown``), at the least: another service may use that limit inline.
UNKNOWN_IDLE = 7 * 86400


@dataclass
class CleanupReport:
    """What a cleanup run did. Counts are rows."""

    #: Rows deleted, by limit name (idle rows; unknown names only with remove_unknown).
    deleted: Counter[str] = field(default_factory=Counter)
    #: Candidates confirmed not idle (not full again yet, such as rows in debt): kept.
    kept: int = 0
    #: Rows under names that are not configured, by name (before any removal).
    unknown: dict[str, int] = field(default_factory=dict)
    batches: int = 0
    seconds: float = 0.0
    slowest_batch: float = 0.0
    #: False when ``max_seconds`` ran out before every limit was done.
    complete: bool = True
    dry_run: bool = False

    @property
    def deleted_total(self) -> int:
        return sum(self.deleted.values())

    @property
    def rows_per_second(self) -> float:
        return self.deleted_total / self.seconds if self.seconds > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        """Return the report as plain data (for logs, JSON and Celery results)."""
        return {
            "deleted": dict(self.deleted),
            "deleted_total": self.deleted_total,
            "kept": self.kept,
            "unknown": self.unknown,
            "batches": self.batches,
            "seconds": round(self.seconds, 3),
            "slowest_batch_seconds": round(self.slowest_batch, 4),
            "rows_per_second": round(self.rows_per_second, 1),
            "complete": self.complete,
            "dry_run": self.dry_run,
        }


def database_alias(database: str | None = None) -> str:
    """Return the database the rows live in: ``database``, the backend's, or the router's."""
    if database:
        return database
    return get_backend().database_alias() or router.db_for_write(RateLimit)


def unknown_names(known: Iterable[str], database: str | None = None) -> dict[str, int]:
    """Return the number of stored rows per limit name that is not in ``known``."""
    alias = database_alias(database)
    rows = (
        RateLimit.objects.using(alias)
        .exclude(name__in=list(known))
        .values("name")
        .annotate(rows=Count("pk"))
        .order_by("name")
    )
    return {row["name"]: row["rows"] for row in rows}


def cleanup(
    *,
    limits: Mapping[str, LimitConfig] | None = None,
    names: Iterable[str] | None = None,
    batch_size: int = MAX_BATCH_SIZE,
    remove_unknown: bool = False,
    unknown_idle: float | None = None,
    dry_run: bool = False,
    max_seconds: float | None = None,
    pause: float | None = None,
    database: str | None = None,
) -> CleanupReport:
    """Delete idle rows in batches; return what was done.

    ``limits`` maps names to configs (default: every limit this process knows, see
    ``registry.known_limits``); ``names`` restricts the run to some of them.
    ``remove_unknown`` also deletes rows of names not in ``limits`` that nothing has
    written for ``unknown_idle`` seconds (default: ``UNKNOWN_IDLE``, a week): such a name
    may be a limit this process cannot see (used inline by another service), whose live
    rows must survive. ``dry_run``
    deletes nothing and reports what would go. ``max_seconds`` bounds the run
    (``report.complete`` says whether it finished); ``pause`` sleeps between batches
    to leave the database to live traffic (default: none, except on SQLite, below).
    """
    if not 1 <= batch_size <= MAX_BATCH_SIZE:
        raise ValueError(f"batch_size must be between 1 and {MAX_BATCH_SIZE}, not {batch_size!r}")
    if limits is None:
        limits = {name: known.config for name, known in known_limits().items()}
    if unknown_idle is None:
        unknown_idle = UNKNOWN_IDLE
    if isinstance(unknown_idle, bool) or not isinstance(unknown_idle, (int, float)) or not unknown_idle >= 0:
        raise ValueError(f"unknown_idle must be a number of seconds >= 0, not {unknown_idle!r}")
    unknown_span = round(unknown_idle * MICRO)
    alias = database_alias(database)
    if pause is None:
        # SQLite writers waiting for the lock poll, sleeping up to 100 ms between tries:
        # a cleanup that began its next batch at once would win the lock again and
        # again, starving them. Row-lock waiters elsewhere are woken at once.
        pause = SQLITE_PAUSE if connections[alias].vendor == "sqlite" else 0.0
    started = time.monotonic()
    deadline = None if max_seconds is None else started + max_seconds
    report = CleanupReport(dry_run=dry_run)

    report.unknown = unknown_names(limits, alias)
    selected = list(limits) if names is None else [name for name in names if name in limits]
    work: list[tuple[str, LimitConfig | None]] = [(name, limits[name]) for name in sorted(selected)]
    if remove_unknown and names is None:
        work += [(name, None) for name in sorted(report.unknown)]
    elif report.unknown:
        logger.info(
            "rate-limit cleanup: rows of limits that are not configured were kept: %s "
            "(delete them with remove_unknown / --remove-unknown)",
            ", ".join(f"{name!r} ({rows})" for name, rows in report.unknown.items()),
        )

    for name, limit in work:
        after: tuple[int, int] | None = None
        while True:
            if deadline is not None and time.monotonic() >= deadline:
                report.complete = False
                break
            batch_started = time.monotonic()
            seen, idle, last = _batch(alias, name, limit, after, batch_size, dry_run, unknown_span)
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


def _batch(
    alias: str,
    name: str,
    limit: LimitConfig | None,
    after: tuple[int, int] | None,
    batch_size: int,
    dry_run: bool,
    unknown_span: int,
) -> tuple[int, int, tuple[int, int] | None]:
    """Run one batch; return (rows looked at, rows idle, keyset position to continue after).

    A serialization failure or deadlock (PostgreSQL SERIALIZABLE, InnoDB) only means the
    batch collided with live traffic: it runs again under the decisions' retry policy.
    """
    return retrying(
        alias, lambda: _batch_once(alias, name, limit, after, batch_size, dry_run, unknown_span), atomic=False
    )


def _batch_once(
    alias: str,
    name: str,
    limit: LimitConfig | None,
    after: tuple[int, int] | None,
    batch_size: int,
    dry_run: bool,
    unknown_span: int,
) -> tuple[int, int, tuple[int, int] | None]:
    connection = connections[alias]
    outermost = not connection.in_atomic_block
    with transaction.atomic(using=alias):
        if connection.vendor == "mysql" and outermost:
            # Must come before the transaction's first read. At REPEATABLE READ the
            # locking range read would also lock the gaps, holding up the insert of
            # every new key that falls into the range (new buckets have ts = 0).
            with connection.cursor() as cursor:
                cursor.execute("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
        now = store_now(alias)
        rows_qs = RateLimit.objects.using(alias).filter(name=name)
        rows_qs = rows_qs.filter(ts__lte=now - (unknown_span if limit is None else cleanup_span(limit)))
        if after is not None:
            # Keyset pagination over (ts, id): rows kept or skipped are never looked at
            # twice, so a run always ends.
            rows_qs = rows_qs.filter(ts__gte=after[0]).filter(Q(ts__gt=after[0]) | Q(pk__gt=after[1]))
        rows_qs = rows_qs.order_by("ts", "pk")
        if connection.features.has_select_for_update_skip_locked and not dry_run:
            rows_qs = rows_qs.select_for_update(skip_locked=True)
        rows = list(rows_qs.values_list("pk", "key", "value", "ts")[:batch_size])
        idle = [
            pk for pk, key, value, ts in rows if limit is None or is_idle(limit, State(value, ts), key, now)
        ]
        if idle and not dry_run:
            RateLimit.objects.using(alias).filter(pk__in=idle).delete()
    last = (rows[-1][3], rows[-1][0]) if rows else None
    return len(rows), len(idle), last
