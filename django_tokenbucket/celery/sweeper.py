"""The sweeper: publishes what a crash or a distant ETA kept out of the broker, expires and purges."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from django.db import connections, transaction
from django.db.models import F
from django.utils import timezone

from ..metrics import count_reservations
from . import reservations
from .publishing import celery_settings, max_eta, publish
from .reservations import WAITING, reservation_model

if TYPE_CHECKING:
    from ..models import Reservation

__all__ = ["SweepReport", "sweep"]

logger = logging.getLogger("django_tokenbucket")


@dataclass
class SweepReport:
    """What one sweep did, in reservations."""

    #: Kept back for their distant ETA, and published now that it is near.
    published: int = 0
    #: Sent, but still not run long after their ETA: sent again.
    republished: int = 0
    #: Not run ``EXPIRE_AFTER`` after their ETA: given up.
    expired: int = 0
    #: Finished more than ``KEEP_FINISHED`` ago: deleted.
    purged: int = 0
    #: Publishes that failed (the broker is down): tried again by the next sweep.
    publish_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def sweep(now: datetime | None = None) -> SweepReport:
    """Publish due reservations that are not in the broker, expire stale ones, purge old ones.

    Run it periodically (the ``django_tokenbucket.sweep_reservations`` task with beat).
    Rows that a running task or another sweep holds are skipped, never waited for
    (on PostgreSQL and MySQL/MariaDB; SQLite serializes writers anyway).
    """
    settings = celery_settings()
    alias = reservations.database_alias()
    now = now or timezone.now()
    batch = max(1, int(settings["BATCH_SIZE"]))
    report = SweepReport()
    objects = reservation_model().objects.using(alias)

    expire_before = now - timedelta(seconds=float(settings["EXPIRE_AFTER"]))
    report.expired += _update_batches(
        alias,
        objects.filter(status__in=WAITING, eta__lte=expire_before),
        batch,
        status="expired",
        finished_at=now,
    )
    # Non-atomic work whose worker died mid-task (it is never run twice).
    report.expired += _update_batches(
        alias,
        objects.filter(status="running", started_at__lte=expire_before),
        batch,
        status="expired",
        finished_at=now,
    )

    count_reservations("expired", report.expired)

    horizon = now + timedelta(seconds=max_eta())
    report.published, errors = _publish_batches(alias, objects.filter(status="scheduled", eta__lte=horizon), batch, now)
    report.publish_errors += errors
    if not errors:
        overdue = now - timedelta(seconds=float(settings["REDELIVER_AFTER"]))
        report.republished, errors = _publish_batches(
            alias, objects.filter(status="sent", eta__lte=overdue, sent_at__lte=overdue), batch, now
        )
        report.publish_errors += errors

    if settings["KEEP_FINISHED"] is not None:
        finished_before = now - timedelta(seconds=float(settings["KEEP_FINISHED"]))
        finished = objects.exclude(status__in=(*WAITING, "running")).filter(finished_at__lte=finished_before)
        while True:
            pks = list(finished.values_list("pk", flat=True)[:batch])
            if not pks:
                break
            report.purged += objects.filter(pk__in=pks).delete()[0]
    return report


def _locked(alias: str, queryset: Any, batch: int) -> list[Reservation]:
    if connections[alias].features.has_select_for_update_skip_locked:
        queryset = queryset.select_for_update(skip_locked=True)
    return list(queryset.order_by("eta")[:batch])


def _update_batches(alias: str, queryset: Any, batch: int, **values: Any) -> int:
    total = 0
    while True:
        with transaction.atomic(using=alias):
            rows = _locked(alias, queryset, batch)
            if rows:
                reservation_model().objects.using(alias).filter(pk__in=[r.pk for r in rows]).update(**values)
        total += len(rows)
        if len(rows) < batch:
            return total


def _publish_batches(alias: str, queryset: Any, batch: int, now: datetime) -> tuple[int, int]:
    sent = 0
    while True:
        with transaction.atomic(using=alias):
            rows = _locked(alias, queryset, batch)
            done = []
            for row in rows:
                try:
                    publish(row.pk, row.eta, row.signature)
                except Exception as exc:
                    logger.warning("reservation %s: publishing failed, next sweep retries: %s", row.pk, exc)
                    break
                done.append(row.pk)
            reservation_model().objects.using(alias).filter(pk__in=done).update(
                status="sent", sent_at=now, publish_count=F("publish_count") + 1
            )
        sent += len(done)
        if len(done) < len(rows):
            return sent, 1
        if len(rows) < batch:
            return sent, 0
