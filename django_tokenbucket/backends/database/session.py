"""The PostgreSQL fast path's hold on one connection: its cursor, its prepared statements,
and how a statement is run on it.

Django's cursor wrapper costs a fast-path decision about as much as the server's work
beyond ``SELECT 1``; the session keeps a driver cursor of its own (a Django cursor where
something observes the connection's queries), learns whether the connection reaches
PostgreSQL itself or a pooler, prepares its statements only where it may, runs them
once prepared with the protocol's Bind and Execute, and drops the server's cached plans
once a minute (``Session.replan_if_due``). docs/database.md, "Prepared statements and
PgBouncer", says why each.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from django.db import DatabaseError

# psycopg 3's libpq wrapper, to bind prepared statements (``Bind``); without it (psycopg2)
# the driver's cursor sends EXECUTE.
try:
    from psycopg import errors as psycopg_errors
    from psycopg import generators as psycopg_generators
    from psycopg import pq
except ImportError:  # pragma: no cover - depends on the installation
    pq = None  # type: ignore[assignment]

__all__ = ["REPLAN_EVERY", "SESSION_ATTRIBUTE", "UNSENT", "Bind", "Session", "fetch", "prepares_on", "write"]

#: SQLSTATE of an EXECUTE of a prepared statement the session does not have.
_NO_SUCH_STATEMENT = "26000"


class Session:
    """What the fast path keeps for one driver connection: a cursor of its own, the
    names of the statements prepared on it (None where it must not prepare: a pooler
    stands between it and PostgreSQL; ``unknown`` until its first statement tells), and
    how to run those statements without the cursor (``Bind``; None with psycopg2)."""

    __slots__ = ("bind", "cursor", "prepared", "raw", "replan_at", "unknown")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.cursor = raw.cursor()
        self.prepared: set[str] | None = None
        self.unknown = True
        self.bind = Bind.of(raw)
        self.replan_at = time.monotonic() + REPLAN_EVERY

    def replan_if_due(self) -> None:
        """Drop the server session's cached plans once every ``REPLAN_EVERY`` seconds.

        A generic plan is kept until the table's statistics change. Made while the
        table was analyzed small, the lookup by key is a sequential scan and a sort
        (the cheapest plan for a page of rows), and it stays one as the table grows
        until autovacuum analyzes it again, which a busy server may not do for long:
        4 ms a decision at 50,000 rows. Planned again, with the table's size as it is
        now, it goes through the unique index. ``DISCARD PLANS`` keeps the prepared
        statements and makes the PL/pgSQL functions' plans again too; it is sent on the
        driver's cursor, as Django's health check is, not as a decision's statement.
        """
        now = time.monotonic()
        if now >= self.replan_at:
            self.replan_at = now + REPLAN_EVERY
            self.cursor.execute("DISCARD PLANS")


#: Seconds between two ``DISCARD PLANS`` on one connection (``Session.replan_if_due``).
REPLAN_EVERY = 60.0


#: Parsers of the text a prepared statement's columns come back as, by type OID:
#: boolean, bigint, smallint, integer (every column the statements return).
_COLUMN_PARSERS: dict[int, Callable[[bytes], Any]] = {16: lambda text: text == b"t", 20: int, 21: int, 23: int}


class Bind:
    """Runs a statement already prepared on the session with the protocol's own Bind and
    Execute (libpq's ``PQsendQueryPrepared``, through psycopg's ``pq``), its parameters
    sent apart from the text.

    Django's psycopg cursor binds parameters into the text on the client (``EXECUTE
    name ('...', ...)``) and runs its whole ``execute`` machinery for it: ~25 µs of
    Python a decision against the ~90 µs round trip (issue 35, the database hot key).
    The server runs the same prepared plan either way. The statement names a ``PREPARE``
    made on this session: SQL's and the protocol's prepared statements are one namespace.
    Only for psycopg 3, whose ``pq`` this reaches; psycopg's own waiting is kept (an
    interrupted wait cancels the query, as a cursor's would).
    """

    __slots__ = ("encoding", "error_from_result", "execute", "pgconn", "raw", "tuples_ok")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.pgconn = raw.pgconn
        self.execute = psycopg_generators.execute
        self.error_from_result = psycopg_errors.error_from_result
        self.tuples_ok = pq.ExecStatus.TUPLES_OK
        self.encoding = raw.info.encoding

    @classmethod
    def of(cls, raw: Any) -> Bind | None:
        """The binder of driver connection ``raw``; None where it is not psycopg 3's."""
        if pq is None or not hasattr(raw, "pgconn"):
            return None
        return cls(raw)

    def __call__(self, statement: Any, values: Any) -> Any:
        """Run ``statement`` with ``values`` (a mapping for a statement with an ``order``)
        and return its first row (None if none), or ``UNSENT`` for a value the protocol
        cannot carry as it is (text with a NUL, which no name, digest or label holds):
        the cursor then says why."""
        params: list[bytes | None] = []
        for value in values if statement.order is None else [values[name] for name in statement.order]:
            if value is None:
                params.append(None)
            elif value is True or value is False:
                params.append(b"t" if value else b"f")
            elif isinstance(value, int):
                params.append(b"%d" % value)
            elif isinstance(value, str) and "\x00" not in value:
                # A text parameter is a C string to libpq: a NUL would cut it short.
                params.append(value.encode(self.encoding))
            else:
                return UNSENT
        pgconn = self.pgconn
        with self.raw.lock:
            pgconn.send_query_prepared(statement.name.encode(), params)
            results = self.raw.wait(self.execute(pgconn))
        result = results[-1]
        if result.status != self.tuples_ok:
            raise self.error_from_result(result, encoding=self.encoding)
        if not result.ntuples:
            return None
        return tuple(
            None if (text := result.get_value(0, column)) is None else _COLUMN_PARSERS[result.ftype(column)](text)
            for column in range(result.nfields)
        )


#: What ``Bind`` returns for values it leaves to the cursor.
UNSENT = object()


#: The attribute of a Django connection (thread-local already) that holds the Session
#: of its current driver connection: it lives and goes with the connection.
SESSION_ATTRIBUTE = "_django_tokenbucket_session"


def prepares_on(connection: Any) -> bool | None:
    """Whether the fast path prepares its statements on ``connection``'s current driver
    connection: None until its first fast-path statement has run there."""
    session = getattr(connection, SESSION_ATTRIBUTE, None)
    if session is None or session.raw is not connection.connection or session.unknown:
        return None
    return session.prepared is not None


def _reaches_postgresql(raw: Any, server_pid: int) -> bool:
    """Whether the driver connection ``raw`` talks to PostgreSQL itself.

    PostgreSQL tells a client the id of the process that serves it when it connects. A
    pooler such as PgBouncer answers that itself, with a cancel key of its own making,
    and hands each transaction to whichever server connection is free, where a named
    prepared statement may be missing or, worse, be another client's. So the process
    id given at connect time must be the one that runs the statement.
    """
    info = getattr(raw, "info", None)
    return info is not None and getattr(info, "backend_pid", None) == server_pid


def driver_cursor(connection: Any) -> tuple[Any, Session]:
    """Return the cursor to run a fast-path statement with, and the connection's session.

    Where anything observes the connection's queries (DEBUG, CaptureQueriesContext,
    ``execute_wrapper``: debug toolbars, APM agents, assertNumQueries), a Django cursor,
    so that they see every statement. Otherwise the session's own driver cursor, as
    Django's cursor would prepare it but without its wrapper, which costs a decision
    as much as the database's work beyond ``SELECT 1`` (issue 19). The caller runs it
    inside ``connection.wrap_database_errors``, as Django's cursor does.
    """
    connection.close_if_health_check_failed()
    connection.ensure_connection()
    raw = connection.connection
    session = getattr(connection, SESSION_ATTRIBUTE, None)
    if session is None or session.raw is not raw:
        with connection.wrap_database_errors:
            session = Session(raw)
        setattr(connection, SESSION_ATTRIBUTE, session)
    connection.validate_thread_sharing()
    with connection.wrap_database_errors:
        session.replan_if_due()
    if connection.queries_logged or connection.execute_wrappers:
        return connection.cursor(), session
    return session.cursor, session


def fetch(connection: Any, statement: Any, values: Any, prepare: str | bool, pid_column: int) -> Any:
    """Run ``statement`` (prepared where the connection may prepare) and return its row;
    learn from its ``pid_column`` whether the connection reaches PostgreSQL itself."""
    cursor, session = driver_cursor(connection)
    try:
        with connection.wrap_database_errors:
            prepared = session.prepared if prepare is not False else None
            if prepared is not None:
                try:
                    if statement.name not in prepared:
                        cursor.execute(statement.prepare)
                        prepared.add(statement.name)
                    if session.bind is not None and cursor is session.cursor:
                        row = session.bind(statement, values)
                        if row is not UNSENT:
                            return row
                    cursor.execute(statement.execute, values)
                    return cursor.fetchone()
                except Exception as exc:
                    # The session lost it (DISCARD ALL, DEALLOCATE): learn again, meanwhile
                    # send the statement itself. Nothing ran: the EXECUTE failed before.
                    # (A Django cursor's error is Django's, the driver's its cause.)
                    cause = exc.__cause__ if isinstance(exc, DatabaseError) else exc
                    if (getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)) != _NO_SUCH_STATEMENT:
                        raise
                    session.prepared, session.unknown = None, True
            cursor.execute(statement.text, values)
            row = cursor.fetchone()
    finally:
        if cursor is not session.cursor:
            cursor.close()
    if prepare is not False and session.unknown and row is not None:
        direct = prepare is True or _reaches_postgresql(session.raw, row[pid_column])
        session.prepared, session.unknown = (set() if direct else None), False
    return row


def write(connection: Any, sql: str, values: Sequence[Any]) -> int:
    """Run one write of the read-first path and return how many rows it changed."""
    cursor, session = driver_cursor(connection)
    try:
        with connection.wrap_database_errors:
            cursor.execute(sql, values)
            return int(cursor.rowcount)
    finally:
        if cursor is not session.cursor:
            cursor.close()
