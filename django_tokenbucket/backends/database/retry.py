"""The database backend's retry policy, and what a database error says.

Serialization failures, deadlocks and creation races only mean that two transactions
collided: running the whole transaction again is the answer (PostgreSQL's documentation
and CockroachDB's client-retry guidance say so). Every piece of the package's database
work that may collide (decisions, cleanup) goes through ``retrying``; ``error_code`` and
``lost_answer`` read a driver's error the same way on PostgreSQL and MySQL/MariaDB.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable
from typing import TypeVar

from django.db import DatabaseError, connections, transaction

from ...settings import tokenbucket_settings

__all__ = ["CONTENTION_ERRORS", "RETRYABLE_ERRORS", "contended", "error_code", "lost_answer", "retrying"]

#: Errors after which the whole transaction may simply run again: serialization
#: failures and deadlocks (PostgreSQL and distributed SQL), a unique violation from a
#: creation race, InnoDB deadlocks and MariaDB's "record has changed".
RETRYABLE_ERRORS = frozenset({"40001", "40P01", "23505", "1213", "1020"})

#: Errors by which a server that is up says it gave up waiting: PostgreSQL's
#: lock_not_available (``lock_timeout``) and query_canceled (``statement_timeout``),
#: InnoDB's lock wait timeout, MariaDB's ``max_statement_time`` and MySQL's
#: ``max_execution_time``. SQLite says "database is locked" (no code).
CONTENTION_ERRORS = frozenset({"55P03", "57014", "1205", "1969", "3024"})


T = TypeVar("T")


def retrying(
    alias: str,
    work: Callable[[], T],
    *,
    atomic: bool = True,
    retried: Counter[str] | None = None,
    gave_up: Counter[str] | None = None,
) -> T:
    """Run ``work`` on database ``alias``, again after errors that only mean a collision.

    The one retry policy of the package's database work (decisions, cleanup): up to
    ``RETRY_ATTEMPTS`` runs, with full-jitter exponential backoff from
    ``RETRY_BASE_DELAY`` capped at ``RETRY_MAX_DELAY`` (``RETRYABLE_ERRORS``: serialization
    failures, deadlocks, creation races). Each run is a transaction of its own unless
    ``atomic`` is false (a single autocommit statement is one already, and work that
    opens its own may say so). ``retried`` and ``gave_up`` count by error code.
    """
    attempt = 0
    while True:
        try:
            if not atomic:
                return work()
            with transaction.atomic(using=alias):
                return work()
        except DatabaseError as exc:
            code = error_code(exc)
            # A connection Django had to close (its rollback failed too) is lost, not
            # in conflict: another attempt would reconnect outside the TIMEOUT watch.
            if code not in RETRYABLE_ERRORS or connections[alias].connection is None:
                raise
            # The settings are read only here: every decision passes through this
            # loop, and almost none fails.
            if attempt >= max(1, int(tokenbucket_settings.RETRY_ATTEMPTS)) - 1:
                if gave_up is not None:
                    gave_up[code] += 1
                raise
            if retried is not None:
                retried[code] += 1
            cap = float(tokenbucket_settings.RETRY_MAX_DELAY)
            # Full jitter: contenders that collided spread out instead of colliding again.
            time.sleep(random.uniform(0, min(cap, float(tokenbucket_settings.RETRY_BASE_DELAY) * 2**attempt)))
            attempt += 1


def lost_answer(exc: BaseException) -> bool:
    """Whether a database error says nothing of what the server did with the statement.

    A server that reports an error (it has a SQLSTATE, or a MySQL server error number)
    rolled the statement back; a connection that failed (no code, SQLSTATE class 08,
    MySQL client errors 2000-2999 such as 2013 "Lost connection") tells nothing, and
    neither does 40003, "statement completion unknown" (CockroachDB's ambiguous result).
    """
    code = error_code(exc)
    return code is None or code.startswith("08") or code == "40003" or (code.isdigit() and 2000 <= int(code) < 3000)


def contended(exc: BaseException) -> bool:
    """Whether a database error says the database is busy (a lock or time limit), not failing."""
    code = error_code(exc)
    if code is not None:
        return code in CONTENTION_ERRORS
    return "database is locked" in str(exc) or "database table is locked" in str(exc)


def error_code(exc: BaseException) -> str | None:
    """Return the SQLSTATE (PostgreSQL) or error number (MySQL) behind a Django DatabaseError."""
    cause = exc.__cause__ or exc
    code = getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)
    if code:
        return str(code)
    args = getattr(cause, "args", ())
    if args and isinstance(args[0], int):
        return str(args[0])
    return None
