"""The default backend: rows of ``RateLimit`` on the application's own database.

Each decision locks its rows with ``SELECT ... FOR UPDATE`` (in sorted order, so
that calls touching several limits cannot deadlock each other), reads the database's
clock in the same statement, and writes only what changed. Inside the caller's
transaction the decision joins it: a rollback un-spends the tokens.

On PostgreSQL, outside any transaction, a decision is instead one call of a
server-side function (``postgresql.decide_in_server``): one round trip, same answers.

The async API (``alimit``...) runs these blocking decisions in Django's thread-sensitive
worker thread (``sync_to_async``), where the request's database connection belongs:
Django's async ORM has no ``select_for_update`` inside a transaction, nor async
transactions, which the all-or-nothing step needs.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import replace
from typing import Any

from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.db import DatabaseError, OperationalError, connections, router, transaction
from django.db.models.expressions import RawSQL

from ... import catalogue, clock
from ...algorithms import State
from ...keys import EncodedKey
from ...limits import LimitConfig
from ...models import RateLimit
from ...settings import tokenbucket_settings
from ..base import (
    Answers,
    BackendError,
    BaseBackend,
    Outcome,
    RecentDenials,
    Request,
    RowId,
    decide_all,
    row_id,
    timeout_option,
)
from .analytics import AnalyticsRows
from .deadline import Watch, watching
from .operations import RowOperations
from .postgresql import (
    FUNCTION_NAME,
    PREPARE_MODES,
    UNDEFINED_FUNCTION,
    decide_in_server,
    decide_one,
    is_postgresql,
)
from .retry import RETRYABLE_ERRORS, contended, error_code, lost_answer, retrying

__all__ = ["OPTION_DEFAULTS", "DatabaseBackend", "database_now", "timeout_option"]

logger = logging.getLogger("django_tokenbucket")

#: The database's own time, in microseconds, evaluated when the statement reads the
#: row, so after any lock wait (checked on PostgreSQL 15 and MariaDB 10.11).
_NOW_SQL = {
    "postgresql": "(EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::bigint",
    "mysql": "CAST(UNIX_TIMESTAMP(SYSDATE(6)) * 1000000 AS SIGNED)",
}

#: The database backend's ``OPTIONS`` and their defaults (docs/settings.md).
OPTION_DEFAULTS: dict[str, Any] = {
    "DATABASE": None,
    "FAST_PATH": True,
    "ASYNC_COMMIT": False,
    "TIMEOUT": None,
    "PREPARE": "auto",
}


def _bound_connecting(connection: Any, timeout: float) -> None:
    """Give the driver a connect timeout from TIMEOUT, unless the database's OPTIONS set one.

    There is no socket for the watchdog to watch until the connection exists, and a
    server that accepts and never answers would hold the connect forever. The drivers
    take whole seconds; libpq reads anything under 2 as 2.
    """
    if connection.vendor not in ("postgresql", "mysql"):
        return
    options = connection.settings_dict.setdefault("OPTIONS", {})
    options.setdefault("connect_timeout", max(2 if connection.vendor == "postgresql" else 1, math.ceil(timeout)))


def _valid_prepare(value: Any) -> bool:
    # By identity: 1 == True, and 1 is not a mode.
    return any(value is mode or (isinstance(mode, str) and value == mode) for mode in PREPARE_MODES)


def _prepare_message(setting: str, value: Any) -> str:
    return f"{setting}['OPTIONS']['PREPARE'] must be 'auto', True or False, not {value!r}."


def database_now(alias: str) -> int:
    """Return the time (µs since the epoch) a decision on database ``alias`` would use."""
    return DatabaseBackend({"DATABASE": alias})._read_clock(alias)


class DatabaseBackend(AnalyticsRows, RowOperations, BaseBackend):
    """Store limits in the ``RateLimit`` table.

    Options: ``DATABASE``, the alias to use (default: the router's choice for writes
    of ``RateLimit``); ``FAST_PATH`` (default True), one round trip per decision on
    PostgreSQL when the limiter owns the transaction; ``ASYNC_COMMIT`` (default False),
    let those transactions commit without waiting for the WAL flush; ``TIMEOUT``
    (default None), the seconds after which a decision still waiting on the database
    gives up its connection and takes the fail mode; ``PREPARE`` (default "auto"),
    whether the fast path's statement is prepared on each connection: "auto" where the
    connection reaches PostgreSQL itself rather than a pooler such as PgBouncer, True
    always, False never.
    """

    option_names = frozenset(OPTION_DEFAULTS)
    unknown_option_check = catalogue.E013
    lists_buckets = True
    keeps_labels = True
    counts_cheaply = True
    keeps_rows = True
    needs_cleanup = True
    keeps_analytics = True

    def __init__(self, options: Mapping[str, Any], *, setting: str = "TOKENBUCKET") -> None:
        super().__init__(options, setting=setting)
        self.database: str | None = self.options.get("DATABASE")
        self.fast_path = bool(self.options.get("FAST_PATH", OPTION_DEFAULTS["FAST_PATH"]))
        self.async_commit = bool(self.options.get("ASYNC_COMMIT", OPTION_DEFAULTS["ASYNC_COMMIT"]))
        self.prepare: str | bool = self.options.get("PREPARE", OPTION_DEFAULTS["PREPARE"])
        if not _valid_prepare(self.prepare):
            raise ImproperlyConfigured(_prepare_message(setting, self.prepare))
        try:
            self.timeout = timeout_option(self.options.get("TIMEOUT"), setting)
        except ValueError as exc:
            raise ImproperlyConfigured(str(exc)) from None
        #: Aliases whose database lacks the fast path's function (migration 0004 not
        #: applied): they take the portable path from then on.
        self._without_function: set[str] = set()
        #: Picks how a single decision goes on the fast path (never what it decides).
        self._recent_denials = RecentDenials()
        #: When the database last answered a call made under TIMEOUT: a call that then
        #: runs out of it finds the database busy, not down.
        self.answers = Answers()
        #: Internal errors by code that were retried, and that exhausted the retries:
        #: figures for tests and operations.
        self.retried: Counter[str] = Counter()
        self.gave_up: Counter[str] = Counter()

    def alias(self) -> str:
        return self.database or router.db_for_write(RateLimit)

    def database_alias(self) -> str:
        return self.alias()

    def store_now(self) -> int:
        return self._read_clock(self.alias())

    @classmethod
    def check_options(cls, options: Mapping[str, Any], setting: str) -> list[Any]:
        """Check the options, and warn on SQLite without IMMEDIATE transactions.

        SQLite's default DEFERRED transactions take the write lock only at the first
        write, so two decisions can read the same state and then fail with "database
        is locked".
        """
        messages = super().check_options(options, setting)
        for flag in ("FAST_PATH", "ASYNC_COMMIT"):
            if flag in options and not isinstance(options[flag], bool):
                messages.append(
                    catalogue.E014(setting=setting, option=flag, expected="True or False", value=options[flag])
                )
        try:
            timeout_option(options.get("TIMEOUT"), setting)
        except ValueError as exc:
            messages.append(catalogue.E015(error=exc))
        if not _valid_prepare(options.get("PREPARE", "auto")):
            messages.append(
                catalogue.E014(
                    setting=setting, option="PREPARE", expected="'auto', True or False", value=options["PREPARE"]
                )
            )
        alias = options.get("DATABASE") or router.db_for_write(RateLimit)
        if alias not in settings.DATABASES:
            messages.append(catalogue.E009(setting=setting, alias=alias))
            return messages
        connection = connections[alias]
        if connection.vendor == "sqlite":
            mode = str(connection.settings_dict.get("OPTIONS", {}).get("transaction_mode") or "").upper()
            if mode != "IMMEDIATE":
                messages.append(catalogue.W001(alias=alias))
        return messages

    def _now_sql(self, alias: str) -> str | None:
        if tokenbucket_settings.CLOCK == "app" or clock.override() is not None:
            return None
        return _NOW_SQL.get(connections[alias].vendor)

    def decide(self, requests: Sequence[Request], *, apply: bool) -> Outcome:
        alias = self.alias()
        if self._fast_path_applies(alias):
            try:
                return self._run(
                    alias, lambda: self._decide_in_server(alias, requests, apply), write=apply, atomic=False
                )
            except BackendError as exc:
                if exc.__cause__ is None or error_code(exc.__cause__) != UNDEFINED_FUNCTION:
                    raise
                self._without_function.add(alias)
                logger.warning(
                    "django_tokenbucket: the database %r has no function %s (run `manage.py migrate "
                    "django_tokenbucket`); this process takes the slower portable path until it restarts.",
                    alias,
                    FUNCTION_NAME,
                )
        if not apply:
            return self._run(alias, lambda: self._read(alias, requests), write=False)
        return self._run(alias, lambda: self._consume(alias, requests), write=True)

    def refund(self, config: LimitConfig, key: EncodedKey, amount: int) -> Outcome:
        """Give ``amount`` micro-tokens back under the row lock, joining the caller's transaction.

        Inside the caller's transaction a rollback takes the refund back too, as it does
        a consumption.
        """
        alias = self.alias()
        return self._run(alias, lambda: self._refund(alias, config, key, amount), write=True)

    def _fast_path_applies(self, alias: str) -> bool:
        if not self.fast_path or alias in self._without_function:
            return False
        connection = connections[alias]
        # Inside the caller's transaction the decision must join it (a rollback un-spends
        # the tokens), which only the portable path does. With CLOCK = "app" the time
        # would be read before the rows are, so that mode keeps the portable path too.
        return (
            is_postgresql(connection)
            and not connection.in_atomic_block
            and (tokenbucket_settings.CLOCK != "app" or clock.override() is not None)
            # Without connecting: a store that is down must fail inside the fail mode.
            and (connection.autocommit if connection.connection is not None else connection.settings_dict["AUTOCOMMIT"])
        )

    def _decide_in_server(self, alias: str, requests: Sequence[Request], apply: bool) -> Outcome:
        connection = connections[alias]
        pinned_now = clock.override()
        if len(requests) == 1:
            request = requests[0]
            recent = self._recent_denials
            outcome = decide_one(
                connection,
                request,
                apply=apply,
                pinned_now=pinned_now,
                async_commit=self.async_commit,
                prepare=self.prepare,
                read_first=apply and recent.likely(alias, request),
            )
            if outcome is None:
                with connection.cursor() as cursor:
                    outcome = decide_in_server(
                        cursor, requests, apply=apply, pinned_now=pinned_now, async_commit=self.async_commit
                    )
            if apply:
                recent.learn(alias, request, outcome.decisions[0])
            return outcome
        with connection.cursor() as cursor:
            return decide_in_server(
                cursor, requests, apply=apply, pinned_now=pinned_now, async_commit=self.async_commit
            )

    def _run(self, alias: str, work: Callable[[], Outcome], *, write: bool, atomic: bool = True) -> Outcome:
        connection = connections[alias]
        in_callers_transaction = connection.in_atomic_block
        watch: Watch | None = None
        maybe_applied = False

        def attempt() -> Outcome:
            nonlocal maybe_applied
            # One autocommit statement may commit on the server although its answer is
            # lost; a transaction of the limiter's own, once its COMMIT is on the way.
            maybe_applied = write and not atomic
            outcome = work()
            maybe_applied = write
            return outcome

        try:
            if self.timeout is None and not in_callers_transaction:
                # No watchdog to set up: the common case, without the context manager.
                return self._retrying(alias, attempt, atomic=atomic and write)
            with self._deadline(alias) as watch:
                if not in_callers_transaction:
                    # A read is retried too: it writes nothing, and on SERIALIZABLE even
                    # a read can fail with 40001.
                    outcome = self._retrying(alias, attempt, atomic=atomic and write)
                elif not write:
                    outcome = work()
                else:
                    # Join the caller's transaction through a savepoint. A serialization
                    # failure here cannot be retried: only the caller can rerun its
                    # transaction, so it propagates as it is.
                    with transaction.atomic(using=alias):
                        outcome = work()
        except DatabaseError as exc:
            # Inside the caller's transaction nothing is committed yet: a lost connection
            # rolls it all back, so there maybe_applied stays false.
            ambiguous = maybe_applied and lost_answer(exc)
            if watch is not None and watch.fired:
                self._abandon(alias, in_callers_transaction, exc)
                raise BackendError(self._no_answer(alias), ambiguous=ambiguous, busy=self.answers.recently()) from exc
            if in_callers_transaction:
                if error_code(exc) in RETRYABLE_ERRORS:
                    raise
            else:
                # A connection the server dropped would fail every later call of this
                # thread outside a request cycle; Django reconnects once it is closed.
                connection.close_if_unusable_or_obsolete()
            raise BackendError(
                f"database {alias!r}: {type(exc).__name__}: {exc}", ambiguous=ambiguous, busy=contended(exc)
            ) from exc
        if watch is not None:
            if watch.fired:
                # The answer came just as the deadline passed: the decision stands, but its
                # socket is shut down, so the connection must not be used again.
                self._abandon(alias, in_callers_transaction, None)
            self.answers.answered()
        return outcome

    def _no_answer(self, alias: str) -> str:
        return f"database {alias!r}: no answer within TIMEOUT = {self.timeout:g} s; the connection was closed"

    def _abandon(self, alias: str, in_callers_transaction: bool, cause: BaseException | None) -> None:
        """Close a connection whose socket the TIMEOUT watchdog shut down.

        Inside the caller's transaction that transaction is lost with it, and the caller
        must hear so whatever the fail mode: Django would otherwise leave the atomic block
        without committing and without a word.
        """
        connections[alias].close()
        if in_callers_transaction:
            raise OperationalError(self._no_answer(alias) + ", and your transaction with it") from cause

    @contextmanager
    def _deadline(self, alias: str) -> Iterator[Watch | None]:
        if self.timeout is None:
            yield None
            return
        connection = connections[alias]
        if connection.connection is None:
            _bound_connecting(connection, self.timeout)
        connection.ensure_connection()
        with connection.wrap_database_errors:  # a closed or broken connection raises here
            fileno = connection.connection.fileno() if hasattr(connection.connection, "fileno") else None
        if fileno is None:  # SQLite: no server to stall
            yield None
            return
        with ExitStack() as stack:
            try:
                watch = stack.enter_context(watching(fileno, self.timeout))
            except (OSError, RuntimeError) as exc:  # no descriptor or thread to spare
                raise DatabaseError(f"the TIMEOUT watchdog cannot watch the connection: {exc}") from exc
            yield watch

    def reset(self, config: LimitConfig, key: EncodedKey) -> None:
        alias = self.alias()
        try:
            RateLimit.objects.using(alias).filter(name=config.name, key=key.digest).delete()
        except DatabaseError as exc:
            raise BackendError(f"database {alias!r}: {type(exc).__name__}: {exc}") from exc

    def _retrying(self, alias: str, work: Callable[[], Outcome], *, atomic: bool) -> Outcome:
        return retrying(alias, work, atomic=atomic, retried=self.retried, gave_up=self.gave_up)

    def _consume(self, alias: str, requests: Sequence[Request]) -> Outcome:
        manager = RateLimit.objects.using(alias)
        now_sql = self._now_sql(alias)
        unique: dict[RowId, Request] = {}
        for request in requests:
            unique.setdefault(row_id(request), request)

        pks: dict[RowId, int] = {}
        states: dict[RowId, State | None] = {}
        created: list[RowId] = []
        now: int | None = None
        for rid in sorted(unique):
            row = self._lock(manager, rid, now_sql)
            if row is None:
                request = unique[rid]
                fresh = request.config.fresh_state(request.key.digest)
                row = self._create_and_lock(manager, rid, request.key.label, fresh, now_sql)
                if (row[1], row[2]) == (fresh.value, fresh.ts):
                    created.append(rid)
            pk, value, ts, store_now = row
            pks[rid] = pk
            states[rid] = State(value, ts)
            now = store_now
        if now is None or now_sql is None:
            # Taken once every row is locked, so no later decision can carry an earlier time.
            now = clock.app_now()

        decisions, writes = decide_all(requests, states, int(now))
        for rid, state in writes.items():
            manager.filter(pk=pks[rid]).update(value=state.value, ts=state.ts)
        # A refused call leaves no row behind: the rows it made only to lock them, still
        # fresh, read the same as no row. (An attacker must not fill the table with the
        # names of accounts it was refused for.)
        unused = [pks[rid] for rid in created if rid not in writes]
        if unused:
            manager.filter(pk__in=unused).delete()
        return Outcome(decisions, int(now))

    def _create_and_lock(
        self, manager: Any, rid: RowId, label: str, fresh: State, now_sql: str | None
    ) -> tuple[int, int, int, int | None]:
        # Many callers may create the row at once: exactly one insert wins and the others
        # wait for it, then lock the row it made. A caller refused meanwhile deletes the
        # row it made, and the next one makes it again.
        for _ in range(3):
            manager.bulk_create(
                [RateLimit(name=rid[0], key=rid[1], label=label, value=fresh.value, ts=fresh.ts)],
                ignore_conflicts=True,
            )
            row = self._lock(manager, rid, now_sql)
            if row is not None:
                return row
        raise DatabaseError(f"rate limit {rid[0]!r}: the row vanished while being created")

    def _refund(self, alias: str, config: LimitConfig, key: EncodedKey, amount: int) -> Outcome:
        manager = RateLimit.objects.using(alias)
        now_sql = self._now_sql(alias)
        rid = (config.name, key.digest)
        row = self._lock(manager, rid, now_sql)
        if row is None:
            # No row reads as a fresh, full limit: there is nothing to give back to.
            now = self._read_clock(alias)
            state = config.fresh_state(key.digest)
        else:
            pk, value, ts, store_now = row
            now = int(store_now) if store_now is not None else clock.app_now()
            state = config.refund(State(value, ts), now, amount, key.digest)
            manager.filter(pk=pk).update(value=state.value, ts=state.ts)
        # Reported as a zero-token read that any debt allows, so that a limit whose
        # config shrank below its debt still reports its value.
        reading = replace(config, max_reserved=None)
        return Outcome([reading.decide(state, now, 0, key.digest, reserve=True)], now)

    @staticmethod
    def _lock(manager: Any, rid: RowId, now_sql: str | None) -> tuple[int, int, int, int | None] | None:
        queryset = manager.select_for_update().filter(name=rid[0], key=rid[1])
        if now_sql is None:
            rows = list(queryset.values_list("pk", "value", "ts")[:1])
            return (*rows[0], None) if rows else None
        rows = list(queryset.annotate(store_now=RawSQL(now_sql, ())).values_list("pk", "value", "ts", "store_now")[:1])
        return rows[0] if rows else None

    def _read(self, alias: str, requests: Sequence[Request]) -> Outcome:
        manager = RateLimit.objects.using(alias)
        states: dict[RowId, State | None] = {}
        for request in requests:
            rid = row_id(request)
            if rid not in states:
                rows = list(manager.filter(name=rid[0], key=rid[1]).values_list("value", "ts")[:1])
                states[rid] = State(*rows[0]) if rows else None
        now = self._read_clock(alias)
        decisions, _ = decide_all(requests, states, now)
        return Outcome(decisions, now)

    def _read_clock(self, alias: str) -> int:
        now_sql = self._now_sql(alias)
        if now_sql is None:
            return clock.app_now()
        with connections[alias].cursor() as cursor:
            cursor.execute(f"SELECT {now_sql}")
            return int(cursor.fetchone()[0])
