"""Tasks that the Celery tests schedule, and the records that let a test count, across
processes, how often each reservation was delivered and how often its work happened.
"""

from __future__ import annotations

import os
import time

from celery import shared_task
from celery.signals import task_failure, task_postrun, task_prerun, task_retry, task_success
from django.db import connection

from django_tokenbucket import limiter
from django_tokenbucket.celery import RESERVATION_HEADER, RateLimitedTask, current_reservation
from django_tokenbucket.celery import refund as refund_tokens

EFFECTS = "tbtest_celery_effect"
DELIVERIES = "tbtest_celery_delivery"
#: One row per run of a RateLimitedTask (``held``: what current_reservation() was) or
#: of the plain task queued behind them, one per death on purpose ("died") and one per
#: delivery of the dying test's message ("delivered").
RUNS = "tbtest_celery_run"
TABLES = {
    EFFECTS: "tag VARCHAR(100), reservation VARCHAR(64), started DOUBLE PRECISION, pid INTEGER",
    DELIVERIES: "reservation VARCHAR(64), at DOUBLE PRECISION, pid INTEGER",
    RUNS: "tag VARCHAR(100), task_id VARCHAR(64), started DOUBLE PRECISION, pid INTEGER, held VARCHAR(32)",
}
#: What Celery's signals said about tests.limited_retry (and run_reservation, which must
#: stay silent about it): the task's name as the signal gave it, the delivery's id and
#: retries, and the reservation a delivery is the run of (its mark), if any.
SIGNALS = "tbtest_celery_signal"
TABLES[SIGNALS] = (
    "task VARCHAR(100), task_id VARCHAR(64), event VARCHAR(16), retries INTEGER, reservation VARCHAR(64), "
    "at DOUBLE PRECISION"
)
#: The global limit of the RateLimitedTask tests (in tests/settings.py's LIMITS).
TASKS_LIMIT = "celery_tasks"


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
        refund_tokens(reservation, refund)
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


def _record_run(tag: str, task_id: str | None, started: float, held: str) -> None:
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {RUNS} (tag, task_id, started, pid, held) VALUES (%s, %s, %s, %s, %s)",
            [tag, task_id, started, os.getpid(), held],
        )


@shared_task(
    bind=True,
    base=RateLimitedTask,
    name="tests.limited_effect",
    tokenbucket_limit=TASKS_LIMIT,
    tokenbucket_key=lambda tag, **kwargs: kwargs.get("tenant", "global"),
    tokenbucket_count=lambda tag, **kwargs: kwargs.get("count", 1),
    acks_late=True,
    reject_on_worker_lost=True,
)
def limited_effect(
    self, tag: str, *, tenant: str | None = "global", count: float = 1, refund: float | None = None
) -> str:
    """A task under one global limit: records its run, with the id it was delivered under."""
    started = time.time()
    held = current_reservation()
    _record_run(tag, self.request.id, started, type(held).__name__)
    if refund:
        refund_tokens(held, refund)
    return tag


@shared_task(
    bind=True,
    base=RateLimitedTask,
    name="tests.limited_retry",
    tokenbucket_limit=TASKS_LIMIT,
    tokenbucket_key=lambda tag, **kwargs: kwargs["tenant"],
    max_retries=3,
)
def limited_retry(self, tag: str, *, tenant: str, retries: int = 0, debt: float = 0) -> str:
    """Records each run with its retries, and retries until it has retried ``retries``
    times, first putting the bucket ``debt`` tokens in debt (so that the retry is short of
    tokens and deferred in turn). Not ``acks_late``: its runs are outside a transaction,
    so the debt holds whatever the run does next."""
    _record_run(tag, self.request.id, time.time(), f"{type(current_reservation()).__name__} {self.request.retries}")
    if self.request.retries < retries:
        if debt:
            limiter.limit(TASKS_LIMIT, tenant, count=debt, reserve=True)
        raise self.retry(countdown=0)
    return tag


def _record_signal(task, event: str) -> None:
    if task is None or task.request.is_eager:
        return
    if task.name not in ("tests.limited_retry", "django_tokenbucket.run_reservation"):
        return
    request = task.request
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {SIGNALS} (task, task_id, event, retries, reservation, at) VALUES (%s, %s, %s, %s, %s, %s)",
            [
                task.name,
                request.id,
                event,
                request.retries or 0,
                (request.headers or {}).get(RESERVATION_HEADER),
                time.time(),
            ],
        )


@task_prerun.connect
def _prerun_signal(sender=None, task=None, **kwargs):
    _record_signal(task, "prerun")


@task_success.connect
def _success_signal(sender=None, **kwargs):
    _record_signal(sender, "success")


@task_failure.connect
def _failure_signal(sender=None, **kwargs):
    _record_signal(sender, "failure")


@task_retry.connect
def _retry_signal(sender=None, **kwargs):
    _record_signal(sender, "retry")


@shared_task(name="tests.plain_effect")
def plain_effect(tag: str) -> str:
    """A task with no limit, queued behind limited ones: it must not wait for them."""
    _record_run(tag, None, time.time(), "plain")
    return tag


@task_postrun.connect
def _die_after_deferring(sender=None, task_id=None, task=None, args=None, kwargs=None, state=None, **extra):
    # The crash window of a deferral: committed and published, not yet acknowledged.
    # The pool process dies once per tag (a row marks it), so the redelivery survives.
    if task is None or task.name != "tests.limited_effect" or state != "IGNORED" or task.request.is_eager:
        return
    tag = (args or [""])[0]
    if not tag.startswith("die-after-defer"):
        return
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT COUNT(*) FROM {RUNS} WHERE tag = %s AND held = 'died'", [tag])
        if cursor.fetchone()[0]:
            return
    _record_run(tag, task_id, time.time(), "died")
    os._exit(1)


@shared_task(name="tests.native_limited", rate_limit="10/s")
def native_limited(tag: str) -> str:
    """Celery's own rate_limit, for make bench-tasks to compare with: counted per worker."""
    _record_run(tag, None, time.time(), "native")
    return tag


@task_prerun.connect
def _count_limited_delivery(sender=None, task_id=None, task=None, args=None, **kwargs):
    # Deliveries of the dying test's message, before anything of the task runs.
    if task is None or task.name != "tests.limited_effect" or task.request.is_eager:
        return
    if (task.request.headers or {}).get(RESERVATION_HEADER):
        return  # the deferred run, not a delivery of the message that was deferred
    if (args or [""])[0].startswith("die-after-defer"):
        _record_run(args[0], task_id, time.time(), "delivered")
