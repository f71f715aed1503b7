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

import contextvars
import logging
import math
import random
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

try:
    from celery import current_app
    from celery.canvas import Signature
    from celery.exceptions import Ignore
except ImportError as exc:  # pragma: no cover - depends on the installation
    raise ImportError(
        f"django_tokenbucket.celery needs Celery: pip install 'dj-tokenbucket[celery]' ({exc})"
    ) from exc

from django.core.exceptions import ImproperlyConfigured
from django.db import connections, transaction
from django.db.models import F
from django.utils import timezone

from .. import clock
from ..algorithms import MICRO
from ..api import ConfigSpec, limiter
from ..exceptions import RateLimited
from ..keys import EncodedKey
from ..limits import LimitConfig
from ..metrics import count_reservations
from ..settings import tokenbucket_settings
from ..status import Status, ambiguous_truth
from . import reservations
from .reservations import CELERY_DEFAULTS, WAITING, HeldTokens, cancel, refund, reservation_model, took_nothing
from .signatures import dump_signature, load_signature, publish_options

if TYPE_CHECKING:
    from ..models import Reservation

__all__ = [
    "CELERY_DEFAULTS",
    "RESERVATION_HEADER",
    "HeldTokens",
    "RateLimitedTask",
    "Scheduled",
    "SweepReport",
    "cancel",
    "current_reservation",
    "max_eta",
    "refund",
    "run_reservation_work",
    "schedule",
    "sweep",
]

logger = logging.getLogger("django_tokenbucket")

#: The name of the task that runs a reservation's work (``tasks.run_reservation``).
RUN_RESERVATION_TASK = "django_tokenbucket.run_reservation"

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

#: Options of a signature that the reservation decides itself, or that would run
#: outside its bookkeeping (callbacks would also fire for duplicate deliveries).
_FORBIDDEN_OPTIONS = frozenset(
    {"eta", "countdown", "expires", "task_id", "link", "link_error", "chord", "group_id", "parent_id", "root_id"}
)

_current: contextvars.ContextVar[Reservation | HeldTokens | None] = contextvars.ContextVar(
    "django_tokenbucket_reservation", default=None
)


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


class Scheduled(NamedTuple):
    """What ``schedule()`` returns: the limit's status and, when allowed, the reservation.

    ``ok`` is True when scheduled (a Scheduled has no truth value). ``ok`` and
    ``retry_after`` are the status': when denied, ``retry_after`` is the wait until the
    reservation would fit in ``max_reserved``.
    """

    status: Status
    reservation: Reservation | None

    @property
    def ok(self) -> bool:
        return self.status.ok

    @property
    def retry_after(self) -> float | None:
        return self.status.retry_after

    @property
    def eta(self) -> datetime | None:
        """Return when the task runs (None when nothing was scheduled)."""
        return None if self.reservation is None else self.reservation.eta

    def __bool__(self) -> bool:
        raise ambiguous_truth("Scheduled")


def current_reservation() -> Reservation | HeldTokens | None:
    """Return the reservation whose task is running in this context, or None.

    Inside a scheduled task: ``current_reservation().refund(unused)`` returns tokens
    it did not need. In a ``RateLimitedTask`` that ran as soon as it was delivered, it
    is the ``HeldTokens`` the task took, whose ``refund()`` works the same way.
    """
    return _current.get()


def schedule(
    signature: Signature | Mapping[str, Any],
    name: str,
    key: object = None,
    *,
    count: int | float = 1,
    jitter: float = 0.0,
    config: ConfigSpec | None = None,
    atomic: bool = True,
    refund_on_failure: bool = False,
    throws: bool = False,
) -> Scheduled:
    """Reserve ``count`` tokens of limit ``name`` for ``key`` and run ``signature`` when they exist.

    The task is published after the surrounding transaction commits (at once without
    one), with its ETA at the moment the reserved tokens exist plus a random delay of
    up to ``jitter`` seconds; a rolled-back transaction or savepoint publishes nothing
    and returns the tokens. When the reservation would go beyond the limit's
    ``max_reserved``, nothing is scheduled and the result has ``ok=False`` and
    ``retry_after`` (or, with ``throws=True``, RateLimited is raised).

    ``atomic`` runs the task inside the transaction that claims its reservation, so
    that its database writes happen exactly once even when the message is delivered
    twice or a worker dies; ``atomic=False`` runs it outside (at most once: a worker
    that dies mid-task does not run it again). ``refund_on_failure`` returns the
    tokens when the task raises. ``signature`` must be one task's signature; its
    routing options (queue, priority, time limits...) apply.
    """
    sig = _plain_signature(signature)
    if not isinstance(jitter, (int, float)) or isinstance(jitter, bool) or not 0 <= jitter < math.inf:
        raise ValueError(f"jitter must be a number of seconds >= 0, not {jitter!r}")
    limit = limiter.resolve(name, config)
    stored_signature = dump_signature(sig)
    encoded = limiter.encode_for(limit, key)

    with transaction.atomic(using=reservations.database_alias()):
        status = limiter.limit(name, key, count=count, reserve=True, config=config)
        if not status.ok:
            if throws:
                raise RateLimited(name, key, status.retry_after, status)
            return Scheduled(status, None)
        reservation = _record_reservation(
            status,
            limit,
            encoded,
            count,
            stored_signature,
            inline=config is not None,
            atomic=atomic,
            refund_on_failure=refund_on_failure,
            jitter=jitter,
        )
    return Scheduled(status, reservation)


def _record_reservation(
    status: Status,
    limit: LimitConfig,
    encoded: EncodedKey,
    count: int | float,
    stored_signature: dict[str, Any],
    *,
    inline: bool,
    atomic: bool,
    refund_on_failure: bool,
    jitter: float = 0.0,
    pk: Any = None,
    tokens_committed: bool = False,
) -> Reservation:
    """Record the reservation that ``status`` allowed and publish its task once the
    surrounding transaction commits. Called inside that transaction, right after the
    decision: a rollback publishes nothing and returns the tokens, except ``tokens_committed``
    ones (decided in a transaction of their own): the caller returns those after the rollback."""
    alias = reservations.database_alias()
    shared = not tokens_committed and reservations.shares_transaction(alias, limit)
    # A failed-open store, a shadow limit that would deny and an exempt key reserved
    # nothing: giving those tokens back on a cancel or refund would mint them.
    reserved = 0 if took_nothing(status) else limit.validate_count(count, True)
    now_us = clock.app_now() if status.timestamp is None else round(status.timestamp * MICRO)
    wait_us = round(status.retry_after * MICRO) if reserved and status.retry_after else 0
    jitter_us = round(random.uniform(0, jitter) * MICRO) if jitter else 0
    eta = _EPOCH + timedelta(microseconds=now_us + wait_us + jitter_us)
    held = (eta - timezone.now()).total_seconds() > max_eta()
    try:
        reservation = reservation_model().objects.using(alias).create(
            **({} if pk is None else {"pk": pk}),
            name=limit.name,
            key=encoded.digest,
            label=encoded.label,
            limit=reservations.snapshot(limit, inline=inline),
            count=reserved,
            eta=eta,
            status="scheduled" if held else "sent",
            sent_at=None if held else timezone.now(),
            publish_count=0 if held else 1,
            task=stored_signature["task"],
            signature=stored_signature,
            atomic=atomic,
            refund_on_failure=refund_on_failure,
        )
    except BaseException:
        # Committed tokens are the caller's to return after the rollback (a refund here would fail).
        if not shared and reserved and not tokens_committed:
            _undo_reservation(limit, encoded, reserved)
        raise
    pk = reservation.pk

    def publish() -> None:
        if not held:
            _publish_after_commit(pk, eta, stored_signature, alias)

    if shared or not reserved:
        if not held:
            reservations.after_commit(alias, publish)
    else:
        reservations.after_commit(alias, publish, lambda: _undo_reservation(limit, encoded, reserved))
    reservations.count_on_commit(alias, "scheduled")
    return reservation


def _undo_reservation(limit: LimitConfig, key: EncodedKey, amount: int) -> None:
    """Return the tokens of a reservation whose record was never committed (a store outside the database)."""
    try:
        limiter.refund_encoded(limit, key, amount, key.label)
    except Exception as exc:  # the tokens refill on their own; never hide the caller's own error
        logger.warning("rate limit %r: the tokens of a rolled-back reservation stay spent: %s", limit.name, exc)


def _plain_signature(signature: Signature | Mapping[str, Any]) -> Signature:
    if isinstance(signature, Mapping) and not isinstance(signature, Signature):
        signature = Signature.from_dict(dict(signature))
    if not isinstance(signature, Signature):
        raise TypeError(f"schedule() needs a task signature such as send_email.s(user_id), not {signature!r}")
    if signature.get("subtask_type") or not isinstance(signature.task, str):
        raise ValueError(
            f"schedule() runs one task; {signature!r} is a {signature.get('subtask_type') or 'canvas'}: "
            f"schedule a task that starts it instead"
        )
    forbidden = sorted(_FORBIDDEN_OPTIONS & set(signature.options))
    if forbidden:
        raise ValueError(
            f"schedule() decides when and under which id the task runs, and runs no callbacks; "
            f"remove {', '.join(forbidden)} from the signature of {signature.task!r}"
        )
    return signature


def _publish(pk: Any, eta: datetime, stored: Mapping[str, Any]) -> None:
    """Publish the run of reservation ``pk``, whose task is the ``stored`` signature.

    A ``RateLimitedTask`` runs under its own name (logs, monitoring and Celery's signals
    see the task that was written), marked as the reservation's run; any other task
    runs inside ``django_tokenbucket.run_reservation``.
    """
    task = current_app.tasks.get(stored["task"])
    if isinstance(task, RateLimitedTask):
        task._publish_run(pk, eta, stored)
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


def _publish_after_commit(pk: Any, eta: datetime, stored: Mapping[str, Any], alias: str) -> None:
    try:
        _publish(pk, eta, stored)
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


# -- the task ----------------------------------------------------------------------------


@contextmanager
def _running(reservation: Reservation) -> Iterator[None]:
    count_reservations("ran")
    token = _current.set(reservation)
    try:
        yield
    finally:
        _current.reset(token)


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
        _publish(row.pk, row.eta, row.signature)
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
        reservation_model().objects.using(alias)
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
                reservation_model().objects.using(alias)
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


# -- the sweeper -------------------------------------------------------------------------


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
    report.published, errors = _publish_batches(
        alias, objects.filter(status="scheduled", eta__lte=horizon), batch, now
    )
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
                    _publish(row.pk, row.eta, row.signature)
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


# Last: the task base builds on the names above.
from .task import RESERVATION_HEADER, RateLimitedTask  # noqa: E402
