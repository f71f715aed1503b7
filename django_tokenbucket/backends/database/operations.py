"""The database backend's operations for the admin and the command: list, count, reset,
set tokens and clean up ``RateLimit`` rows (``BaseBackend``'s optional capabilities).

Mixed into ``DatabaseBackend``, whose alias (``alias``) and clock (``_read_clock``) they use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from django.db import DatabaseError, transaction
from django.db.models import Count, QuerySet

from ...algorithms import State
from ...limits import LimitConfig
from ...models import RateLimit
from ..base import MAX_BATCH_SIZE, BackendError, BucketPage, CleanupReport, StoredBucket, checked_digests
from . import analytics
from . import cleanup as row_cleanup
from .filters import count_by_state, state_q

__all__ = ["RowOperations"]

_T = TypeVar("_T")

#: Store times are µs since the epoch; analytics count whole minutes.
_MICROS_PER_MINUTE = 60 * 10**6


class RowOperations:
    """List, count, reset and adjust the rows of one database; delete idle ones."""

    # Provided by DatabaseBackend.
    alias: Callable[[], str]
    _read_clock: Callable[[str], int]

    def _store(self, work: Callable[[str], _T]) -> _T:
        alias = self.alias()
        try:
            return work(alias)
        except DatabaseError as exc:
            raise BackendError(f"database {alias!r}: {type(exc).__name__}: {exc}") from exc

    def list_buckets(
        self, config: LimitConfig, *, cursor: str | None = None, page_size: int = 100, digest_prefix: str = ""
    ) -> BucketPage:
        """A page in digest order after ``cursor`` (the last digest of the previous page):
        a range of the ``(name, key)`` unique index."""

        def page(alias: str) -> BucketPage:
            rows = RateLimit.objects.using(alias).filter(name=config.name)
            if digest_prefix:
                rows = rows.filter(key__startswith=digest_prefix)
            if cursor:
                rows = rows.filter(key__gt=cursor)
            found = list(rows.order_by("key").values_list("key", "label", "value", "ts")[: page_size + 1])
            now = self._read_clock(alias)
            buckets = [StoredBucket(key, label, State(value, ts)) for key, label, value, ts in found[:page_size]]
            return BucketPage(buckets, buckets[-1].digest if len(found) > page_size else None, now)

        return self._store(page)

    def count_buckets(self, configs: Sequence[LimitConfig]) -> dict[str, int]:
        names = [config.name for config in configs]

        def count(alias: str) -> dict[str, int]:
            rows = RateLimit.objects.using(alias).filter(name__in=names).order_by().values("name")
            return {row["name"]: row["n"] for row in rows.annotate(n=Count("pk"))}

        counts = self._store(count)
        return {name: counts.get(name, 0) for name in names}

    def stored_names(self) -> dict[str, int]:
        return self._store(row_cleanup.stored_names)

    def count_by_state(
        self, configs: Iterable[LimitConfig], now: int, *, only: Sequence[str] | None = None, partial: bool = True
    ) -> dict[str, dict[str, int]]:
        """Only rows written recently, or in debt, can be limited or partially used: those
        counts come from index ranges and ``full`` is what remains (``filters.count_by_state``)."""

        def count(alias: str) -> dict[str, dict[str, int]]:
            rows = RateLimit.objects.using(alias).all()
            limits = list(configs)
            if only is not None:
                rows = rows.filter(name__in=list(only))
                limits = [limit for limit in limits if limit.name in only]
            return count_by_state(rows, limits, now, partial=partial)

        return self._store(count)

    def rows_in_state(
        self, rows: QuerySet[Any], configs: Iterable[LimitConfig], state: str, now: int
    ) -> QuerySet[Any]:
        return rows.filter(state_q(configs, state, now))

    def reset_buckets(self, name: str, digests: Sequence[str]) -> int:
        keys = checked_digests(name, digests)

        def delete(alias: str) -> int:
            rows = RateLimit.objects.using(alias).filter(name=name)
            return sum(
                rows.filter(key__in=keys[start : start + MAX_BATCH_SIZE]).delete()[0]
                for start in range(0, len(keys), MAX_BATCH_SIZE)
            )

        return self._store(delete)

    def reset_all(self, config: LimitConfig, *, batch_size: int = 1000) -> int:
        """Delete the limit's rows in batches of primary keys, so that no statement locks
        a large part of a live table."""

        def delete(alias: str) -> int:
            manager = RateLimit.objects.using(alias)
            deleted = 0
            while True:
                batch = list(manager.filter(name=config.name).order_by().values_list("pk", flat=True)[:batch_size])
                if not batch:
                    return deleted
                deleted += manager.filter(pk__in=batch).delete()[0]

        return self._store(delete)

    def set_tokens(self, config: LimitConfig, digest: str, value: int) -> tuple[int, int] | None:
        """Under the row lock, at the store's time: what live traffic wrote a moment ago
        is the state adjusted, not a stale copy of it. The state keeps its time base (a
        token bucket's refill phase, a window's start)."""

        def adjust(alias: str) -> tuple[int, int] | None:
            with transaction.atomic(using=alias):
                rows = RateLimit.objects.using(alias).filter(name=config.name, key=digest)
                locked = list(rows.select_for_update().values_list("value", "ts")[:1])
                if not locked:
                    return None
                now = self._read_clock(alias)
                probe = config.decide(State(*locked[0]), now, 0, digest, reserve=True)
                base = probe.state or config.decide(None, now, 0, digest, reserve=True).state
                assert base is not None
                new = replace(base, value=min(value, config.capacity))
                rows.update(value=new.value, ts=new.ts)
                return probe.value, new.value

        return self._store(adjust)

    def cleanup(self, limits: Mapping[str, LimitConfig], **options: Any) -> CleanupReport:
        """Delete idle rows (``cleanup.cleanup``), then trim the denial analytics past
        their retention (``analytics.trim``), unless ``dry_run``.

        Trimmed here because every deployment that keeps rows already runs cleanup on a
        schedule; analytics need no job of their own. At the store's time, as the rows,
        and whatever ``names`` says: retention is by age, the same for every limit.
        """
        # Its database errors reach the caller as they are (the command reports them).
        alias = self.alias()
        report = row_cleanup.cleanup(alias, limits, self._read_clock, **options)
        if not report.dry_run:
            started = time.monotonic()
            report.analytics_trimmed = analytics.trim(alias, self._read_clock(alias) // _MICROS_PER_MINUTE)
            report.seconds += time.monotonic() - started
        return report
