"""Every Celery task of the app (needs the ``celery`` extra).

- ``django_tokenbucket.run_reservation``: runs the work of one reservation made by
  ``django_tokenbucket.celery.schedule()``, once.
- ``django_tokenbucket.sweep_reservations``: the reservations' sweeper (``celery.sweep``).
- ``django_tokenbucket.cleanup``: deletes idle rate-limit rows (``cleanup.cleanup``).

Schedule the periodic ones with Celery beat::

    CELERY_BEAT_SCHEDULE = {
        "tokenbucket-sweep": {"task": "django_tokenbucket.sweep_reservations", "schedule": 30.0},
        "tokenbucket-cleanup": {"task": "django_tokenbucket.cleanup", "schedule": 300.0},
    }

The app config imports this module when Celery is installed (as does Celery's
``autodiscover_tasks()``), so workers know the tasks without any ``imports`` setting.
"""

from __future__ import annotations

from typing import Any

try:
    from celery import shared_task
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "django_tokenbucket.tasks needs Celery: pip install 'dj-tokenbucket[celery]'"
    ) from exc

from .celery import RUN_RESERVATION_TASK, run_reservation_work, sweep
from .cleanup import MAX_BATCH_SIZE, cleanup

__all__ = ["cleanup_rate_limits", "run_reservation", "sweep_reservations"]


def _cleanup_rate_limits(
    batch_size: int = MAX_BATCH_SIZE,
    remove_unknown: bool = False,
    max_seconds: float | None = 240.0,
    pause: float | None = None,
    database: str | None = None,
) -> dict[str, Any]:
    """Delete idle rate-limit rows (see ``django_tokenbucket.cleanup``); return the report.

    ``max_seconds`` defaults below a 5-minute beat interval, so that runs never overlap:
    whatever is left is picked up by the next one.
    """
    report = cleanup(
        batch_size=batch_size,
        remove_unknown=remove_unknown,
        max_seconds=max_seconds,
        pause=pause,
        database=database,
    )
    return report.as_dict()


def _sweep_reservations() -> dict[str, int]:
    """Sweep reservations (see ``django_tokenbucket.celery.sweep``); return the report."""
    return sweep().as_dict()


# Applied as calls rather than decorators: Celery ships no type information, and the
# functions keep their own signatures for type checkers and direct calls.
run_reservation = shared_task(
    bind=True,
    name=RUN_RESERVATION_TASK,
    # Acknowledged once it ran, and given back to the broker when its worker dies, so
    # that no reservation is lost; the claim makes the duplicates harmless.
    acks_late=True,
    reject_on_worker_lost=True,
)(run_reservation_work)
sweep_reservations = shared_task(name="django_tokenbucket.sweep_reservations", ignore_result=True)(_sweep_reservations)
cleanup_rate_limits = shared_task(name="django_tokenbucket.cleanup", ignore_result=True)(_cleanup_rate_limits)
