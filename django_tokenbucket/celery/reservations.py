"""Reservations: work that holds reserved tokens until it runs, and its bookkeeping.

``django_tokenbucket.celery`` schedules and runs the work; this module has what needs
no Celery: where reservations live, how their tokens are returned (``cancel`` and
``refund``, each at most once), and how a limit is recovered from a stored record.

Tokens and records share one transaction when the limits live in the same database
as the records (the database backend). Otherwise (Redis) the tokens change right away
and the records follow with the transaction: see ``docs/celery.md`` for what that
means when something fails in between.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Any, Union
from uuid import UUID

from django.apps import apps
from django.db import router, transaction
from django.utils import timezone

from .. import metrics
from ..algorithms import MICRO
from ..api import limiter
from ..exceptions import BackendUnavailable
from ..keys import EncodedKey
from ..limits import LimitConfig, count_to_micro
from ..settings import tokenbucket_settings
from ..status import Status

if TYPE_CHECKING:
    from ..models import Reservation

__all__ = [
    "CELERY_DEFAULTS",
    "STARTED",
    "WAITING",
    "HeldTokens",
    "after_commit",
    "cancel",
    "database_alias",
    "limit_of",
    "refund",
    "shares_transaction",
    "snapshot",
    "took_nothing",
]

logger = logging.getLogger("django_tokenbucket")

#: Not claimed by a worker yet: may still be cancelled, may still run (``Reservation.Status``).
WAITING = ("scheduled", "sent")
#: The work started: unused tokens may be refunded.
STARTED = ("running", "done", "failed")


def took_nothing(status: Status) -> bool:
    """Whether an allowed reservation took no tokens: the store failed open, a shadow limit
    would have denied it, or the key is exempt (an override). There is nothing to give
    back for it, and giving back anyway would mint tokens."""
    return status.failed_open or status.would_deny or status.override == "exempt"


def reservation_model() -> type[Reservation]:
    """Return the ``Reservation`` model. Looked up, not imported: this package may be
    imported before the app registry is ready (a settings module, a Celery app module)."""
    return apps.get_model("django_tokenbucket", "Reservation")

#: ``TOKENBUCKET["CELERY"]``'s settings and their defaults (read by django_tokenbucket.celery).
CELERY_DEFAULTS: dict[str, Any] = {
    # ETAs further away are kept in the database and published by the sweeper when
    # they come this close: a message with an ETA waits unacknowledged in a worker's
    # memory, and a Redis or SQS broker hands it to another worker once its
    # visibility_timeout passes (so the cap is also half that timeout, when set).
    "MAX_ETA": 600,
    # A reservation sent to the broker that has still not run this long after its ETA
    # (and after it was last sent) is sent again: its message was lost, or never
    # published because the process died right after the commit.
    "REDELIVER_AFTER": 30,
    # A reservation that has still not run this long after its ETA is given up
    # (status "expired"; its tokens stay spent).
    "EXPIRE_AFTER": 86400,
    # Finished reservations are deleted this long after they finished (None keeps them).
    "KEEP_FINISHED": 7 * 86400,
    # Rows handled per sweeper transaction.
    "BATCH_SIZE": 500,
}


ReservationRef = Union["Reservation", UUID, str]


def database_alias() -> str:
    """Return the database that holds reservations (the router's choice for writes)."""
    return router.db_for_write(reservation_model())


def shares_transaction(alias: str, limit: LimitConfig) -> bool:
    """Return True when ``limit``'s tokens and reservations are written in one transaction on ``alias``."""
    return limiter.backend(limit).database_alias() == alias


def snapshot(limit: LimitConfig, *, inline: bool) -> dict[str, Any]:
    """Return what a reservation stores of its limit: the parsed config, in exact integers."""
    return {**asdict(limit), "inline": inline}


def limit_of(reservation: Reservation) -> LimitConfig:
    """Return the limit to give a reservation's tokens back to.

    A limit from ``LIMITS`` is read as configured now, as every other call reads it
    (a changed rate reinterprets the state); an inline limit, or one removed from
    ``LIMITS`` since, as it was when the tokens were reserved.
    """
    data = dict(reservation.limit)
    if not data.pop("inline", True):
        current = tokenbucket_settings.limits().get(reservation.name)
        if current is not None:
            return current
    known = {f.name for f in fields(LimitConfig)}
    return LimitConfig(**{k: v for k, v in data.items() if k in known})


def _pk(reservation: ReservationRef) -> Any:
    return reservation.pk if isinstance(reservation, reservation_model()) else reservation


def _lock(alias: str, reservation: ReservationRef) -> Reservation:
    row = reservation_model().objects.using(alias).select_for_update().filter(pk=_pk(reservation)).first()
    if row is None:
        raise reservation_model().DoesNotExist(f"no reservation {_pk(reservation)}")
    return row


def _copy_back(row: Reservation, reservation: ReservationRef, names: list[str]) -> None:
    if isinstance(reservation, reservation_model()) and reservation is not row:
        for name in names:
            setattr(reservation, name, getattr(row, name))


def give_back(row: Reservation, amount: int, alias: str) -> None:
    """Return ``amount`` micro-tokens of ``row`` to its limit, with the current transaction.

    With the database backend the refund joins the transaction that records it, so
    both happen or neither. Otherwise the tokens go back once that transaction has
    committed: at most once, never for a rolled-back record, and lost (with a warning)
    if the store fails or the process dies in between.
    """
    if amount <= 0:
        return
    limit = limit_of(row)
    encoded = EncodedKey(row.key, row.label)
    if shares_transaction(alias, limit):
        limiter.refund_encoded(limit, encoded, amount, row.label)
        return
    pk = row.pk

    def later() -> None:
        try:
            limiter.refund_encoded(limit, encoded, amount, row.label)
        except (BackendUnavailable, NotImplementedError) as exc:
            logger.warning("reservation %s: %s tokens could not be returned: %s", pk, amount / 1e6, exc)

    transaction.on_commit(later, using=alias)


def cancel(reservation: ReservationRef) -> bool:
    """Cancel a reservation that has not started, returning all its tokens.

    Returns True when this call cancelled it, False when it had already started,
    finished, expired or been cancelled: tokens are returned at most once. A message
    already in the broker finds the reservation cancelled and does nothing.
    """
    alias = database_alias()
    with transaction.atomic(using=alias):
        row = _lock(alias, reservation)
        if row.status not in WAITING:
            return False
        now = timezone.now()
        row.status = "cancelled"
        row.finished_at = now
        if row.count > row.refunded:
            give_back(row, row.count - row.refunded, alias)
            row.refunded, row.refunded_at = row.count, now
        names = ["status", "finished_at", "refunded", "refunded_at"]
        row.save(update_fields=names)
        count_on_commit(alias, "cancelled")
    _copy_back(row, reservation, names)
    return True


def refund(reservation: ReservationRef | HeldTokens, count: int | float) -> bool:
    """Give back ``count`` unused tokens of a reservation whose work has started.

    For work that used less than it reserved: an LLM call that reserved 4,000 tokens
    and used 1,200 refunds 2,800. At most once per reservation: returns True when this
    call refunded, False when a refund was already made (the count of a second call is
    ignored). Called from the task itself (``current_reservation().refund(...)``) it
    joins the task's transaction. Raises ValueError for a reservation that has not
    started (cancel it instead) or never ran, or a count above what it reserved.
    ``refund(current_reservation(), n)`` also gives back a ``RateLimitedTask``'s
    ``HeldTokens`` (see ``HeldTokens.refund``).
    """
    if isinstance(reservation, HeldTokens):
        return reservation.refund(count)
    try:
        amount = count_to_micro(count)
    except ValueError as exc:
        raise ValueError(f"refund of reservation {_pk(reservation)}: {exc}") from None
    alias = database_alias()
    with transaction.atomic(using=alias):
        row = _lock(alias, reservation)
        if row.refunded_at is not None:
            return False
        if row.status not in STARTED:
            hint = "cancel() it instead" if row.status in WAITING else "it never ran"
            raise ValueError(f"reservation {row.pk} is {row.status}: nothing to refund ({hint})")
        if amount > row.count:
            raise ValueError(f"reservation {row.pk}: cannot refund {count!r} tokens of the {row.tokens:g} it reserved")
        give_back(row, amount, alias)
        row.refunded, row.refunded_at = amount, timezone.now()
        names = ["refunded", "refunded_at"]
        row.save(update_fields=names)
        count_on_commit(alias, "refunded")
    _copy_back(row, reservation, names)
    return True


class HeldTokens:
    """The tokens a ``RateLimitedTask`` took when it was delivered and ran at once.

    What ``current_reservation()`` returns in such a run: there is no ``Reservation``
    row (nothing was deferred), but unused tokens are given back the same way, at most
    once, with ``refund()``.
    """

    pk = None

    def __init__(self, limit: LimitConfig, key: EncodedKey, amount: int) -> None:
        self.limit, self.key, self.count = limit, key, amount
        self.refunded = 0

    @property
    def name(self) -> str:
        return self.limit.name

    @property
    def tokens(self) -> float:
        """Return the tokens the task took."""
        return self.count / MICRO

    def refund(self, count: int | float) -> bool:
        """Give back ``count`` unused tokens; False when a refund was already made."""
        try:
            amount = count_to_micro(count)
        except ValueError as exc:
            raise ValueError(f"refund of a task's tokens for rate limit {self.name!r}: {exc}") from None
        if self.refunded:
            return False
        if amount > self.count:
            raise ValueError(
                f"rate limit {self.name!r}: cannot refund {count!r} tokens of the {self.tokens:g} the task took"
            )
        limiter.refund_encoded(self.limit, self.key, amount, self.key.label)
        self.refunded = amount
        metrics.count_reservations("refunded")
        return True

    def __repr__(self) -> str:
        return f"<HeldTokens {self.name!r} {self.tokens:g} tokens>"


class _Pending:
    """A transaction.on_commit callback that also learns about a rollback.

    Django has no on_rollback hook, but it drops the callbacks of a rolled-back
    transaction or savepoint (and of a closed connection) from the connection's list:
    once this object is garbage, the transaction it was registered in can no longer
    commit. The finalizer is skipped at interpreter exit, where the safe side is to
    keep the tokens reserved.
    """

    def __init__(self, on_commit: Callable[[], None], on_rollback: Callable[[], None]) -> None:
        self._on_commit = on_commit
        self._state = {"committed": False}
        weakref.finalize(self, _rolled_back, self._state, on_rollback).atexit = False

    def __call__(self) -> None:
        self._state["committed"] = True
        self._on_commit()


def _rolled_back(state: dict[str, bool], on_rollback: Callable[[], None]) -> None:
    if not state["committed"]:
        try:
            on_rollback()
        except Exception:  # a finalizer must not raise; the tokens refill on their own
            logger.warning("could not undo the reservation of a rolled-back transaction", exc_info=True)


def count_on_commit(alias: str, event: str) -> None:
    """Count a reservation ``event`` once the transaction on ``alias`` commits (metrics on only:
    with them off, no callback is added to the transaction)."""
    if metrics.active() is not None:
        after_commit(alias, lambda: metrics.count_reservations(event))


def after_commit(alias: str, on_commit: Callable[[], None], on_rollback: Callable[[], None] | None = None) -> None:
    """Run ``on_commit`` when the transaction on ``alias`` commits, ``on_rollback`` if it cannot.

    ``on_rollback`` runs when the transaction (or the savepoint the call is in) is
    rolled back, as the callbacks are dropped, in CPython at once. It serves stores
    outside the database, which a rollback does not undo.
    """
    callback: Callable[[], None] = on_commit if on_rollback is None else _Pending(on_commit, on_rollback)
    transaction.on_commit(callback, using=alias, robust=False)
