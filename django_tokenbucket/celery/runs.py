"""Running a reservation's work: once, however often its message arrives.

``run_reservation_work`` is the body of ``django_tokenbucket.run_reservation`` and of a
``RateLimitedTask``'s deferred run; ``current_reservation()`` is what the work sees.
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore
from django.db import transaction
from django.utils import timezone

from ..metrics import count_reservations
from . import reservations
from .publishing import publish
from .reservations import WAITING, HeldTokens, reservation_model
from .signatures import load_signature

if TYPE_CHECKING:
    from ..models import Reservation

__all__ = ["RESERVATION_VAR", "current_reservation", "run_reservation_work"]

logger = logging.getLogger("django_tokenbucket")

#: The reservation (or a ``RateLimitedTask``'s held tokens) of the work running in this context.
RESERVATION_VAR: contextvars.ContextVar[Reservation | HeldTokens | None] = contextvars.ContextVar(
    "django_tokenbucket_reservation", default=None
)


def current_reservation() -> Reservation | HeldTokens | None:
    """Return the reservation whose task is running in this context, or None.

    Inside a scheduled task: ``current_reservation().refund(unused)`` returns tokens
    it did not need. In a ``RateLimitedTask`` that ran as soon as it was delivered, it
    is the ``HeldTokens`` the task took, whose ``refund()`` works the same way.
    """
    return RESERVATION_VAR.get()


@contextmanager
def _running(reservation: Reservation) -> Iterator[None]:
    count_reservations("ran")
    token = RESERVATION_VAR.set(reservation)
    try:
        yield
    finally:
        RESERVATION_VAR.reset(token)


def _ignore(pk: Any, status: str) -> NoReturn:
    """End a delivery that has nothing to do: acknowledged, and no result stored over the first run's."""
    logger.info("reservation %s is %s: duplicate delivery ignored", pk, status)
    raise Ignore()


def run_reservation_work(task: Any, reservation_id: str, body: Any = None) -> Any:
    """Run the work of one reservation, once, however often its message arrives.

    The body of the ``django_tokenbucket.run_reservation`` task (``tasks.run_reservation``),
    bound: ``task`` is the running task. A ``RateLimitedTask`` delivered as a reservation's
    run passes its own ``run`` as ``body``, and runs only a reservation of its own.
    """
    alias = reservations.database_alias()
    row = reservation_model().objects.using(alias).filter(pk=reservation_id).first()
    if row is None:
        logger.warning("reservation %s does not exist (deleted?): nothing to run", reservation_id)
        raise Ignore()
    if body is not None and row.task != task.name:
        logger.warning("reservation %s is %s's, not %s's: nothing to run", row.pk, row.task, task.name)
        raise Ignore()
    if row.status not in WAITING:
        _ignore(row.pk, row.status)
    if row.eta > timezone.now() and not task.request.is_eager:
        # Too early (published again without its ETA): the tokens do not exist yet.
        publish(row.pk, row.eta, row.signature)
        raise Ignore()
    stored = load_signature(row.signature)
    if body is None:
        body = task.app.tasks[stored["task"]]
    args, kwargs = stored.get("args", ()), stored.get("kwargs", {})
    if row.atomic:
        return _run_atomic(row.pk, alias, body, args, kwargs)
    return _run_claimed(row.pk, alias, body, args, kwargs)


def _run_atomic(pk: Any, alias: str, body: Any, args: Any, kwargs: Any) -> Any:
    failure: BaseException | None = None
    try:
        with transaction.atomic(using=alias):
            # A second delivery waits here for the first to finish, then finds it done.
            row = reservation_model().objects.using(alias).select_for_update().filter(pk=pk, status__in=WAITING).first()
            if row is None:
                _ignore(pk, "no longer waiting")
            row.status, row.started_at = "running", timezone.now()
            row.save(update_fields=["status", "started_at"])
            try:
                with _running(row):
                    result = body(*args, **kwargs)
            except Exception as exc:
                failure = exc
                raise
            row.status, row.finished_at = "done", timezone.now()
            row.save(update_fields=["status", "finished_at"])
            return result
    except Exception as exc:
        # Only the task's own failure is final; a failed claim or commit leaves the
        # reservation waiting, for a redelivery or the sweeper.
        if exc is failure:
            _failed(pk, alias, exc)
        raise


def _run_claimed(pk: Any, alias: str, body: Any, args: Any, kwargs: Any) -> Any:
    claimed = (
        reservation_model()
        .objects.using(alias)
        .filter(pk=pk, status__in=WAITING)
        .update(status="running", started_at=timezone.now())
    )
    if not claimed:
        _ignore(pk, "no longer waiting")
    row = reservation_model().objects.using(alias).get(pk=pk)
    try:
        with _running(row):
            result = body(*args, **kwargs)
    except Exception as exc:
        _failed(pk, alias, exc)
        raise
    reservation_model().objects.using(alias).filter(pk=pk, status="running").update(
        status="done", finished_at=timezone.now()
    )
    return result


def _failed(pk: Any, alias: str, exc: BaseException) -> None:
    try:
        with transaction.atomic(using=alias):
            row = (
                reservation_model()
                .objects.using(alias)
                .select_for_update()
                .filter(pk=pk, status__in=(*WAITING, "running"))
                .first()
            )
            if row is None:
                return
            row.status, row.finished_at = "failed", timezone.now()
            row.error = f"{type(exc).__name__}: {exc}"[:2000]
            names = ["status", "finished_at", "error"]
            if row.refund_on_failure and row.count > row.refunded:
                reservations.give_back(row, row.count - row.refunded, alias)
                row.refunded, row.refunded_at = row.count, row.finished_at
                names += ["refunded", "refunded_at"]
            row.save(update_fields=names)
            if "refunded" in names:
                reservations.count_on_commit(alias, "refunded")
    except Exception:
        logger.warning("reservation %s: could not record its failure", pk, exc_info=True)
