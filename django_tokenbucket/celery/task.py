"""``RateLimitedTask``: a Celery task base that holds every run of a task to one global rate.

Celery's own ``rate_limit`` is counted in each worker; this one is the limit's, shared
by every worker and every producer. A delivery first takes its tokens. When they are
there, the task runs at once. When they are not, the tokens are reserved, the task is
recorded as a ``Reservation`` and published again for the moment they exist, and the
delivery ends: the worker slot is free at once, nothing sleeps and nothing retries in a
loop. The deferred run is a message of the task itself, under its id, marked with the
reservation's (``RESERVATION_HEADER``): logs, monitoring and Celery's signals see the
task that was written. The deferral is keyed by the task's id and its ``retries``, so
that a message delivered again after its worker died between deferring and
acknowledging finds the deferral and does nothing more, while a retry (the same id, one
more retry) is a delivery of its own, deferred in turn. See "Global task rate limits"
in ``docs/celery.md``.
"""

from __future__ import annotations

import functools
import inspect
import logging
import uuid
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from datetime import datetime
from typing import Any

from celery import Task
from celery._state import _task_stack
from celery.exceptions import Ignore
from django.core.exceptions import ImproperlyConfigured
from django.db import IntegrityError, transaction
from django.utils import timezone

from ..api import limiter
from ..exceptions import RateLimited
from ..limits import LimitConfig
from ..status import Status
from . import reservations
from .publishing import publish
from .reservations import WAITING, HeldTokens, reservation_model, took_nothing
from .runs import RESERVATION_VAR, run_reservation_work
from .scheduling import record_reservation, undo_reservation
from .signatures import dump_signature, load_signature

__all__ = ["RESERVATION_HEADER", "RateLimitedTask", "deferral_id"]

logger = logging.getLogger("django_tokenbucket")

#: kombu transports that set ``redelivered`` on every message delivered again.
_REDELIVERY_FLAGGING_DRIVERS = frozenset({"amqp", "redis"})

#: The message header that makes a delivery of a ``RateLimitedTask`` the run of a
#: reservation (its id): the task runs under its own name, in the reservation's bookkeeping.
RESERVATION_HEADER = "tokenbucket_reservation"
#: Where a deferral keeps, beside the stored signature, the delivery it defers: the task's
#: id, its ``retries`` and its place in a workflow, which its deferred run carries on.
DELIVERY = "delivery"

#: Deferrals of tasks whose ids are not UUIDs get one derived from the id.
_DEFERRAL_NAMESPACE = uuid.UUID("0e1f6a52-3c57-4bd2-9a44-7f3bb1a1e2a9")


def deferral_id(task_id: str, retries: int = 0) -> uuid.UUID:
    """Return the id of the reservation that defers delivery ``retries`` of the task ``task_id``.

    The task's own id when it is a UUID (Celery's are) and not a retry; a retry (the
    same id, ``retries`` > 0) is a new delivery of the task, not the first one delivered
    again, and gets an id of its own, derived from both.
    """
    if retries:
        return uuid.uuid5(_DEFERRAL_NAMESPACE, f"{task_id}\x00retry {int(retries)}")
    try:
        return uuid.UUID(task_id)
    except (TypeError, ValueError, AttributeError):
        return uuid.uuid5(_DEFERRAL_NAMESPACE, str(task_id))


class RateLimitedTask(Task):  # type: ignore[misc]  # Celery ships no type information
    """A Celery task base: each run first takes ``tokenbucket_count`` tokens of the limit
    ``tokenbucket_limit`` for the key ``tokenbucket_key``; without them it is deferred.

    Set the attributes as options of the task decorator::

        @shared_task(base=RateLimitedTask, tokenbucket_limit="openai",
                     tokenbucket_key=lambda *args, **kwargs: kwargs["tenant_id"],
                     tokenbucket_count=lambda *args, **kwargs: kwargs["max_tokens"])
        def complete(prompt, *, tenant_id, max_tokens): ...

    ``tokenbucket_key`` and ``tokenbucket_count`` are values or callables of the task's
    arguments. The default key (None) is the limit's one bucket; a callable that returns
    None runs that call unlimited. Inside the task ``current_reservation().refund(n)``
    gives back unused tokens. A deferred run happens once: with ``acks_late``, inside a
    transaction that a worker dying mid-task rolls back, so it runs again, as Celery's
    ``acks_late`` promises; without, at most once. A count that can never be covered
    (above ``capacity + max_reserved``) fails the task with ValueError. Calling the task
    as a function (``complete(...)``) runs it at once, unlimited, as Celery does; under
    ``task_always_eager`` the caller waits for the tokens (``limiter.acquire``).
    """

    #: The name of the limit, in ``TOKENBUCKET["LIMITS"]``.
    tokenbucket_limit: str | None = None
    #: The key, or a callable of the task's arguments that returns it.
    tokenbucket_key: Any = None
    #: Tokens per run, or a callable of the task's arguments that returns them.
    tokenbucket_count: int | float | Callable[..., int | float] = 1
    #: Return the tokens of a run whose task raised.
    tokenbucket_refund_on_failure: bool = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # A direct call, or a deferred run inside run_reservation (what this version no
        # longer publishes, but a message already in a broker may be): the tokens are
        # not this call's to take.
        if self.request.called_directly:
            deferred = RESERVATION_VAR.get()
            if isinstance(deferred, reservation_model()) and deferred.task == self.name:
                return self._run_deferred(deferred, args, kwargs)
            return super().__call__(*args, **kwargs)
        reservation = self._reservation_run()
        if reservation is not None:
            # The run of a reservation: its tokens were taken when it was made.
            return run_reservation_work(self, reservation, body=self.run)
        limit = self.tokenbucket_config()
        key = self._argument("tokenbucket_key", args, kwargs)
        if key is None and callable(_static(self, "tokenbucket_key")):
            return super().__call__(*args, **kwargs)
        count = self._argument("tokenbucket_count", args, kwargs)
        try:
            amount = limit.validate_count(count, True)
        except ValueError as exc:
            raise ValueError(f"task {self.name!r}: {exc}") from None
        if self.request.is_eager:
            status = limiter.acquire(limit.name, key, count)
            return self._run_holding(took_nothing(status), limit, key, amount, args, kwargs)
        return self._take_or_defer(limit, key, count, amount, args, kwargs)

    def tokenbucket_config(self) -> LimitConfig:
        """Return the parsed limit of this task, or raise ImproperlyConfigured naming the task."""
        name = self.tokenbucket_limit
        if not isinstance(name, str) or not name:
            raise ImproperlyConfigured(
                f"task {self.name!r}: a RateLimitedTask needs tokenbucket_limit, the name of a limit in "
                f"TOKENBUCKET['LIMITS'], not {name!r}"
            )
        try:
            return limiter.resolve(name)
        except ImproperlyConfigured as exc:
            raise ImproperlyConfigured(f"task {self.name!r}: {exc}") from None

    def _argument(self, attribute: str, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
        value = _static(self, attribute)
        if not callable(value):
            return value
        try:
            return value(*args, **kwargs)
        except Exception as exc:
            raise ValueError(f"task {self.name!r}: {attribute} raised {type(exc).__name__}: {exc}") from exc

    def _reservation_run(self) -> str | None:
        """Return the reservation this delivery is the run of, or None.

        Only when the mark names the deferral of this very delivery (its id and
        ``retries``): a retry made from a deferred run inherits the message's headers,
        and is a delivery of its own that takes its own tokens.
        """
        marked = (self.request.headers or {}).get(RESERVATION_HEADER)
        if marked is None or str(marked) != str(deferral_id(self.request.id, self.request.retries or 0)):
            return None
        return str(marked)

    def signature_from_request(self, request: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Celery's, without the mark of a reservation's run: what it makes (a retry) is
        a delivery of its own."""
        signature = super().signature_from_request(request, *args, **kwargs)
        headers = signature.options.get("headers")
        if headers and RESERVATION_HEADER in headers:
            signature.options["headers"] = {k: v for k, v in headers.items() if k != RESERVATION_HEADER}
        return signature

    def publish_run(self, pk: Any, eta: datetime, stored: Mapping[str, Any]) -> None:
        """Publish the run of reservation ``pk`` (this task's ``stored`` signature) as a
        message of this task, under the deferred delivery's id and ``retries`` (the
        reservation's id for ``schedule()``'s), marked with ``pk``. ``publishing.publish``
        calls it for every task that has it."""
        loaded = load_signature(stored)
        options = dict(loaded.get("options") or {})
        headers = {**(options.pop("headers", None) or {}), RESERVATION_HEADER: str(pk)}
        delivery = stored.get(DELIVERY) or {}
        self.apply_async(
            loaded.get("args") or (),
            loaded.get("kwargs") or {},
            task_id=delivery.get("id") or str(pk),
            retries=int(delivery.get("retries") or 0),
            root_id=delivery.get("root_id"),
            parent_id=delivery.get("parent_id"),
            eta=eta if eta > timezone.now() else None,
            headers=headers,
            # Published by the delivery it defers: not a subtask of it.
            add_to_parent=False,
            **options,
        )

    def _take_or_defer(
        self, limit: LimitConfig, key: Any, count: Any, amount: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        pk = deferral_id(self.request.id, self.request.retries or 0)
        alias = reservations.database_alias()
        objects = reservation_model().objects.using(alias)
        if self._maybe_delivered_before() and self._deferred_already(objects, pk, alias):
            raise Ignore()
        # The decision commits on its own, so that a hot limit's row (database backend)
        # is locked for one statement, not for the deferral's writes too: a flood of
        # deferrals then runs at the store's speed. A crash before the deferral is
        # recorded leaves its tokens spent (the limit errs on the safe side) and the
        # message, delivered again, defers once.
        status = limiter.limit(limit.name, key, count=count, reserve=True)
        if not status.ok:
            raise self._refused(limit, key, status)
        unspent = took_nothing(status)
        if unspent or not status.retry_after:
            return self._run_holding(unspent, limit, key, amount, args, kwargs)
        encoded = limiter.encode_for(limit, key)
        # One INSERT needs no transaction of its own (two round trips fewer per deferral),
        # unless it joins one that an IntegrityError must not break.
        nested = transaction.get_connection(alias).in_atomic_block
        try:
            with transaction.atomic(using=alias) if nested else nullcontext():
                record_reservation(
                    status,
                    limit,
                    encoded,
                    count,
                    # Arguments that cannot be stored fail inside: the tokens go back.
                    self._stored_signature(args, kwargs),
                    inline=False,
                    atomic=bool(self.acks_late),
                    refund_on_failure=self.tokenbucket_refund_on_failure,
                    pk=pk,
                    tokens_committed=True,
                )
        except BaseException as exc:
            # The decision committed on its own: its tokens go back now that the record's
            # transaction has rolled back (the same message delivered twice at once, whose
            # other delivery deferred it; or a record the database refused).
            undo_reservation(limit, encoded, amount)
            if isinstance(exc, IntegrityError) and self._deferred_already(objects, pk, alias):
                raise Ignore() from None
            raise
        # Celery logs the delivery as "ignored" next: this line says why.
        logger.info(
            "Task %s[%s] deferred by %.3f s for rate limit %r (reservation %s)",
            self.name,
            self.request.id,
            status.retry_after,
            limit.name,
            pk,
        )
        raise Ignore()

    def _refused(self, limit: LimitConfig, key: Any, status: Status) -> BaseException:
        """Return what ends a delivery the limit refused outright: ``max_reserved`` is
        full for now, or an override blocks the key.

        Retried (Celery's ``retry``, within the task's ``max_retries`` and ``expires``)
        for the moment a reservation would fit; once ``max_retries`` is spent, or for a
        block without end (nothing changes that but an operator), the task fails with
        RateLimited.
        """
        refused = RateLimited(limit.name, key, status.retry_after, status)
        if status.retry_after is None:
            logger.warning(
                "Task %s[%s]: rate limit %r refuses it with no end (%s): failed",
                self.name,
                self.request.id,
                limit.name,
                "the key is blocked" if status.override == "block" else "it can never fit",
            )
            return refused
        return self.retry(exc=refused, countdown=status.retry_after)  # type: ignore[no-any-return]

    def _stored_signature(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """Return the task's signature as a deferral stores it, with the delivery it defers."""
        stored = dump_signature(self.signature(args, kwargs, **self._same_route()))
        request = self.request
        stored[DELIVERY] = {
            "id": request.id,
            "retries": request.retries or 0,
            "root_id": request.root_id,
            "parent_id": request.parent_id,
        }
        return stored

    def _maybe_delivered_before(self) -> bool:
        """Return False only for a first delivery on a broker that flags redeliveries.

        RabbitMQ and kombu's Redis transport mark every message they deliver again; other
        transports may not, so every delivery there looks for its deferral first. A first
        delivery that meets its twin's deferral anyway finds it when its own record fails.
        """
        info = self.request.delivery_info or {}
        return bool(info.get("redelivered")) or not _flags_redeliveries(self.app)

    def _deferred_already(self, objects: Any, pk: uuid.UUID, alias: str) -> bool:
        """Return True when this message was deferred before (delivered again after its
        worker died before acknowledging); make sure its run is in the broker."""
        row = objects.filter(pk=pk).only("status", "eta", "signature").first()
        if row is None:
            return False
        if row.status in WAITING:
            # Sent again: the claim makes a second message harmless, and a lost one is found.
            reservations.after_commit(alias, lambda: publish(row.pk, row.eta, row.signature))
        logger.info("task %s: delivered again after it was deferred (%s); nothing more to do", pk, row.status)
        return True

    def _same_route(self) -> dict[str, Any]:
        """Return the publishing options that send the deferred run where this delivery came from."""
        info = self.request.delivery_info or {}
        exchange, routing_key = info.get("exchange"), info.get("routing_key")
        options: dict[str, Any] = {}
        if routing_key and not exchange:
            # The default exchange routes by queue name, and Celery reads an empty
            # exchange as "not given": name the queue instead.
            options["queue"] = routing_key
        elif routing_key:
            options["exchange"], options["routing_key"] = exchange, routing_key
        if info.get("priority") is not None:
            options["priority"] = info["priority"]
        return options

    def _run_deferred(self, deferred: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # As Task.__call__, but with the request of the delivery that was deferred: the
        # task sees the id it was given and its retries, not a direct call's None and 0.
        delivery = deferred.signature.get(DELIVERY) or {}
        _task_stack.push(self)
        self.push_request(
            id=delivery.get("id") or str(deferred.pk),
            retries=delivery.get("retries") or 0,
            args=args,
            kwargs=kwargs,
            called_directly=False,
        )
        try:
            return self.run(*args, **kwargs)
        finally:
            self.pop_request()
            _task_stack.pop()

    def _run_holding(
        self, unspent: bool, limit: LimitConfig, key: Any, amount: int, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        held = None if unspent else HeldTokens(limit, limiter.encode_for(limit, key), amount)
        token = RESERVATION_VAR.set(held)
        try:
            return super().__call__(*args, **kwargs)
        except Exception:
            if held is not None and self.tokenbucket_refund_on_failure and not held.refunded:
                held.refund(held.tokens)
            raise
        finally:
            RESERVATION_VAR.reset(token)


@functools.cache
def _flags_redeliveries(app: Any) -> bool:
    # Made without connecting: the transport class is all that is read.
    try:
        return app.connection_for_read().transport.driver_type in _REDELIVERY_FLAGGING_DRIVERS
    except Exception:  # an unknown transport: look first, as for any that may not flag
        return False


def _static(task: Task, attribute: str) -> Any:
    # A function set as a class attribute by the task decorator must not become a method.
    value = inspect.getattr_static(task, attribute)
    return value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
