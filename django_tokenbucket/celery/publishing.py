"""Publishing a reservation's run: to the broker, with its ETA, once its transaction commits.

A ``RateLimitedTask`` publishes its own run (``publish_run``), under its own name; any
other task runs inside ``django_tokenbucket.run_reservation``. ``TOKENBUCKET["CELERY"]``
is read here: ``MAX_ETA`` bounds what is handed to the broker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from celery import current_app
from django.core.exceptions import ImproperlyConfigured
from django.db.models import F
from django.utils import timezone

from ..settings import tokenbucket_settings
from .reservations import CELERY_DEFAULTS, reservation_model
from .signatures import publish_options

__all__ = ["RUN_RESERVATION_TASK", "celery_settings", "max_eta", "publish", "publish_after_commit"]

logger = logging.getLogger("django_tokenbucket")

#: The name of the task that runs a reservation's work (``tasks.run_reservation``).
RUN_RESERVATION_TASK = "django_tokenbucket.run_reservation"


def celery_settings() -> dict[str, Any]:
    """Return ``TOKENBUCKET["CELERY"]`` merged over CELERY_DEFAULTS."""
    given = tokenbucket_settings.CELERY
    if not isinstance(given, Mapping):
        raise ImproperlyConfigured(f"TOKENBUCKET['CELERY'] must be a dict, not {type(given).__name__}")
    unknown = set(given) - set(CELERY_DEFAULTS)
    if unknown:
        raise ImproperlyConfigured(
            f"TOKENBUCKET['CELERY'] has unknown setting(s) {', '.join(sorted(map(repr, unknown)))}; "
            f"expected some of {', '.join(sorted(CELERY_DEFAULTS))}"
        )
    return {**CELERY_DEFAULTS, **given}


def max_eta(app: Any = None) -> float:
    """Return the furthest ETA, in seconds from now, that is handed to the broker.

    ``MAX_ETA``, or half the broker's ``visibility_timeout`` when that is smaller: the
    other half leaves the task time to run before the broker redelivers it.
    """
    limit = float(celery_settings()["MAX_ETA"])
    options = (app or current_app).conf.broker_transport_options or {}
    visibility = options.get("visibility_timeout")
    if visibility:
        limit = min(limit, float(visibility) / 2)
    return limit


def publish(pk: Any, eta: datetime, stored: Mapping[str, Any]) -> None:
    """Publish the run of reservation ``pk``, whose task is the ``stored`` signature.

    A ``RateLimitedTask`` runs under its own name (logs, monitoring and Celery's signals
    see the task that was written), marked as the reservation's run; any other task
    runs inside ``django_tokenbucket.run_reservation``.
    """
    # Looked up rather than isinstance(RateLimitedTask): that class publishes through this module.
    publish_run = getattr(current_app.tasks.get(stored["task"]), "publish_run", None)
    if publish_run is not None:
        publish_run(pk, eta, stored)
    else:
        _send(pk, eta, publish_options(stored))


def _send(pk: Any, eta: datetime, options: Mapping[str, Any]) -> None:
    """Publish ``run_reservation`` for reservation ``pk`` (its id is the reservation's)."""
    when = eta if eta > timezone.now() else None
    # By name: the task lives in tasks.py, which imports this module.
    try:
        task = current_app.tasks[RUN_RESERVATION_TASK]
    except KeyError:
        raise ImproperlyConfigured(
            f"the Celery app {current_app.main!r} does not know the task {RUN_RESERVATION_TASK!r}: "
            f"add 'django_tokenbucket' to INSTALLED_APPS (its app config registers the task)"
        ) from None
    task.apply_async((str(pk),), task_id=str(pk), eta=when, **options)


def publish_after_commit(pk: Any, eta: datetime, stored: Mapping[str, Any], alias: str) -> None:
    """``publish``, from a commit callback: a failure leaves the reservation to the sweeper."""
    try:
        publish(pk, eta, stored)
    except Exception as exc:
        # Committed but not published (broker down): marked for the sweeper's next run.
        # An error here would reach a caller whose transaction has already committed.
        logger.warning("reservation %s: publishing failed, the sweeper will send it: %s", pk, exc)
        try:
            reservation_model().objects.using(alias).filter(pk=pk, status="sent").update(
                status="scheduled", publish_count=F("publish_count") - 1
            )
        except Exception:
            logger.warning("reservation %s: could not mark it unsent; it is sent again later", pk, exc_info=True)
