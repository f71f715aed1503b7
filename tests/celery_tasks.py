"""Tasks that the Celery tests schedule, and the records that let a test count, across
processes, how often each reservation was delivered and how often its work happened.
"""

from __future__ import annotations

import os
import time

from celery import shared_task
from celery.signals import task_prerun
from django.db import connection

from django_tokenbucket.celery import current_reservation

EFFECTS = "tbtest_celery_effect"
DELIVERIES = "tbtest_celery_delivery"
TABLES = {
    EFFECTS: "tag VARCHAR(100), reservation VARCHAR(64), started DOUBLE PRECISION, pid INTEGER",
    DELIVERIES: "reservation VARCHAR(64), at DOUBLE PRECISION, pid INTEGER",
}


@shared_task(name="tests.record_effect")
def record_effect(tag: str, sleep: float = 0.0, refund: float | None = None, fail: bool = False) -> str:
    """The side effect: one row, written in the reservation's transaction when atomic."""
    started = time.time()
    reservation = current_reservation()
    assert reservation is not None, "run outside a reservation"
    if sleep:
        time.sleep(sleep)
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {EFFECTS} (tag, reservation, started, pid) VALUES (%s, %s, %s, %s)",
            [tag, str(reservation.pk), started, os.getpid()],
        )
    if refund:
        reservation.refund(refund)
    if fail:
        raise RuntimeError(f"{tag}: failing as told")
    return tag


@task_prerun.connect
def _count_delivery(sender=None, task_id=None, task=None, args=None, **kwargs):
    if task is None or task.name != "django_tokenbucket.run_reservation" or task.request.is_eager:
        return
    # Autocommit, before the reservation's transaction: a delivery counts even when the
    # worker dies in the middle of the task.
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {DELIVERIES} (reservation, at, pid) VALUES (%s, %s, %s)",
            [str(args[0]), time.time(), os.getpid()],
        )
