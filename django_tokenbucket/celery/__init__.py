"""Celery: reserve tokens now, run the task exactly when they exist.

``schedule(send_email.s(user.pk), "outbound_email", key=tenant_id)`` reserves the
tokens (``reserve=True``) and writes a ``Reservation`` in the same transaction; once
that transaction commits, the task is published with its ETA set to the moment the
tokens exist. A rolled-back transaction (or savepoint) publishes nothing and leaves
the tokens unspent. The task claims its reservation once, so a redelivered message
does nothing; a periodic sweeper publishes what a crash kept from being published
and what was too far in the future to sit in a broker. See ``docs/celery.md``.

Needs the ``celery`` extra. The tasks (``django_tokenbucket.tasks``) are named
``django_tokenbucket.*`` and bound to the project's Celery app with ``shared_task``; the
app config imports them when Celery is installed, so workers know them without any
``imports`` setting.
"""

from __future__ import annotations

try:
    import celery  # noqa: F401  # the message below, rather than an error deep in a submodule
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(f"django_tokenbucket.celery needs Celery: pip install 'dj-tokenbucket[celery]' ({exc})") from exc

from .publishing import RUN_RESERVATION_TASK, celery_settings, max_eta
from .reservations import CELERY_DEFAULTS, HeldTokens, cancel, refund
from .runs import current_reservation, run_reservation_work
from .scheduling import Scheduled, schedule
from .sweeper import SweepReport, sweep
from .task import RESERVATION_HEADER, RateLimitedTask

__all__ = [
    "CELERY_DEFAULTS",
    "RESERVATION_HEADER",
    "RUN_RESERVATION_TASK",
    "HeldTokens",
    "RateLimitedTask",
    "Scheduled",
    "SweepReport",
    "cancel",
    "celery_settings",
    "current_reservation",
    "max_eta",
    "refund",
    "run_reservation_work",
    "schedule",
    "sweep",
]
