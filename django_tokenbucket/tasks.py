"""Celery tasks (needs the ``celery`` extra): periodic cleanup of idle rows.

Schedule it with Celery beat::

    CELERY_BEAT_SCHEDULE = {
        "tokenbucket-cleanup": {"task": "django_tokenbucket.cleanup", "schedule": 300.0},
    }

Celery's ``autodiscover_tasks()`` finds this module in the installed app.
"""

from __future__ import annotations

from typing import Any

try:
    from celery import shared_task
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "django_tokenbucket.tasks needs Celery: pip install 'dj-tokenbucket[celery]'"
    ) from exc

from .cleanup import MAX_BATCH_SIZE, cleanup

__all__ = ["cleanup_rate_limits"]


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


# Applied as a call rather than a decorator: Celery ships no type information, and the
# function keeps its own signature for type checkers and direct calls.
cleanup_rate_limits = shared_task(name="django_tokenbucket.cleanup", ignore_result=True)(_cleanup_rate_limits)
