"""``schedule()``: reserve tokens now, publish the task once the transaction commits."""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from celery.canvas import Signature
from django.db import transaction
from django.utils import timezone

from .. import clock
from ..algorithms import MICRO
from ..api import ConfigSpec, limiter
from ..exceptions import RateLimited
from ..keys import EncodedKey
from ..limits import LimitConfig
from ..status import Status, ambiguous_truth
from . import reservations
from .publishing import max_eta, publish_after_commit
from .reservations import reservation_model, took_nothing
from .signatures import dump_signature

if TYPE_CHECKING:
    from ..models import Reservation

__all__ = ["Scheduled", "record_reservation", "schedule", "undo_reservation"]

logger = logging.getLogger("django_tokenbucket")

_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)

#: Options of a signature that the reservation decides itself, or that would run
#: outside its bookkeeping (callbacks would also fire for duplicate deliveries).
_FORBIDDEN_OPTIONS = frozenset(
    {"eta", "countdown", "expires", "task_id", "link", "link_error", "chord", "group_id", "parent_id", "root_id"}
)


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
        reservation = record_reservation(
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


def record_reservation(
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
        reservation = (
            reservation_model()
            .objects.using(alias)
            .create(
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
        )
    except BaseException:
        # Committed tokens are the caller's to return after the rollback (a refund here would fail).
        if not shared and reserved and not tokens_committed:
            undo_reservation(limit, encoded, reserved)
        raise
    pk = reservation.pk

    def publish() -> None:
        if not held:
            publish_after_commit(pk, eta, stored_signature, alias)

    if shared or not reserved:
        if not held:
            reservations.after_commit(alias, publish)
    else:
        reservations.after_commit(alias, publish, lambda: undo_reservation(limit, encoded, reserved))
    reservations.count_on_commit(alias, "scheduled")
    return reservation


def undo_reservation(limit: LimitConfig, key: EncodedKey, amount: int) -> None:
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
