"""The database backend's fast path on PostgreSQL: a whole decision in one statement.

The portable path costs four round trips (BEGIN, SELECT ... FOR UPDATE, UPDATE, COMMIT)
with the row locked throughout. Here a decision is one statement in autocommit, which
reads the row, decides with the database clock, and writes only when something changes
(a denial or a check takes no transaction id: no WAL, no commit flush).

* One limit, one key (``decide_one``): a call of ``django_tokenbucket_single_v3``, in
  bigint, whose text is the same for every call, with bound parameters. Where the
  connection reaches PostgreSQL itself (not a pooler such as PgBouncer: the backend's
  ``PREPARE`` option) the call is a prepared statement.
* Everything else, and the rare single decisions that function hands back (a value
  that could overflow 64 bits, a lost compare-and-set): one call of
  ``django_tokenbucket_decide_v3`` (``decide_in_server``), in numeric.

Both are ports of ``algorithms`` and ``decide_all``; tests/test_pg_fast_path.py holds
them to the same answers.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from importlib import resources
from typing import Any

from django.db import DatabaseError

from ..algorithms import CLOCK_SKEW_TOLERANCE, Decision, lowest_value
from .base import Outcome, Request, RowId, row_id

__all__ = [
    "FUNCTIONS_SQL",
    "FUNCTION_NAME",
    "FUNCTION_VERSION",
    "PREPARE_MODES",
    "SINGLE_STATEMENT_MARK",
    "UNDEFINED_FUNCTION",
    "decide_in_server",
    "decide_one",
    "drop_sql",
    "functions_sql",
    "is_postgresql",
]

#: The version of the SQL this code calls (migration 0004 installs it). A change of
#: behaviour ships as a new version with its own migration, so code and schema briefly
#: out of step never disagree silently: code that finds no function of its version
#: takes the portable path.
FUNCTION_VERSION = 3

_PREFIX = "django_tokenbucket_"
FUNCTION_NAME = f"{_PREFIX}decide_v{FUNCTION_VERSION}"
_STEP_NAME = f"{_PREFIX}step_v{FUNCTION_VERSION}"
_SINGLE_NAME = f"{_PREFIX}single_v{FUNCTION_VERSION}"
#: In the text of every single-decision statement, prepared or not (for tests and logs).
SINGLE_STATEMENT_MARK = _SINGLE_NAME

#: SQLSTATE of a call to a function that does not exist (the migration not applied).
UNDEFINED_FUNCTION = "42883"
#: SQLSTATE of an EXECUTE of a prepared statement the session does not have.
_NO_SUCH_STATEMENT = "26000"

#: Values of the backend's ``PREPARE`` option: "auto" prepares on connections found to
#: reach PostgreSQL itself, True on every connection, False on none.
PREPARE_MODES = ("auto", True, False)


def functions_sql(version: int = FUNCTION_VERSION) -> str:
    """Return the SQL that creates the functions of ``version`` (run by their migration)."""
    return resources.files("django_tokenbucket").joinpath(f"sql/postgresql_v{version}.sql").read_text()


FUNCTIONS_SQL = functions_sql()

_ARGUMENT_TYPES = (
    "text[], text[], text[], integer[], text[], bigint[], bigint[], bigint[], "
    "bigint[], bigint[], bigint[], bigint[], bigint[], boolean, bigint, boolean, bigint"
)
_STEP_ARGUMENT_TYPES = ", ".join(["text"] + ["numeric"] * 10)
_SINGLE_ARGUMENT_TYPES = (
    "text, text, text, text, bigint, bigint, bigint, bigint, bigint, bigint, bigint, bigint, bigint, "
    "boolean, boolean"
)


def _array(values: Sequence[int | None]) -> str:
    """Return an integer array literal. Only ints, written by ``int.__str__``, reach the
    SQL text: dumping thirteen short lists as parameters cost more than the server's work."""
    return "'{" + ",".join("NULL" if value is None else str(int(value)) for value in values) + "}'"


def is_postgresql(connection: Any) -> bool:
    """Return whether ``connection`` is PostgreSQL itself, where the functions can live.

    Backends for databases that speak PostgreSQL's protocol (CockroachDB's subclasses
    Django's PostgreSQL backend) keep ``vendor = "postgresql"`` but run PL/pgSQL in part
    or not at all: they take the portable path.
    """
    return bool(connection.vendor == "postgresql" and connection.display_name == "PostgreSQL")


def drop_sql(version: int = FUNCTION_VERSION) -> str:
    """Return the SQL that removes the functions of ``version`` (their migration reversed)."""
    name = f"{_PREFIX}%s_v{version}"
    return (
        f"DROP FUNCTION IF EXISTS {name % 'decide'}({_ARGUMENT_TYPES}); "
        f"DROP FUNCTION IF EXISTS {name % 'step'}({_STEP_ARGUMENT_TYPES}); "
        f"DROP FUNCTION IF EXISTS {name % 'single'}({_SINGLE_ARGUMENT_TYPES});"
    )


# ---------------------------------------------------------------------------------------
# One limit, one key: one statement
# ---------------------------------------------------------------------------------------

#: Bounds within which django_tokenbucket_single_v3's bigint arithmetic is exact: it
#: checks times (within +-2^61) and the stored value (at least ``exact_from``); the
#: caller sends only configs and counts whose products of a deficit and the period stay
#: below 2^62 for stored values down to ``exact_from``.
_PRODUCT_BOUND = 2**62

#: The function's parameters, in the order of PREPARE's $1, $2...
_PARAMETER_TYPES = _SINGLE_ARGUMENT_TYPES
_PLACEHOLDERS = ", ".join(["%s"] * 15)


class _Statement:
    """The single decision's statement: the call of django_tokenbucket_single_v3, the same
    text for every call, sent as it is or prepared once per connection."""

    name = SINGLE_STATEMENT_MARK
    text = f"SELECT * FROM {_SINGLE_NAME}({_PLACEHOLDERS})"
    prepare = (
        f"PREPARE {name} ({_PARAMETER_TYPES}) AS "
        f"SELECT * FROM {_SINGLE_NAME}({', '.join(f'${n}' for n in range(1, 16))})"
    )
    execute = f"EXECUTE {name} ({_PLACEHOLDERS})"


#: Per driver connection: whether it has prepared the statement, or None where it must
#: not (a pooler stands between it and PostgreSQL). Absent: not known yet.
_prepared: weakref.WeakKeyDictionary[Any, bool | None] = weakref.WeakKeyDictionary()


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


def decide_one(
    connection: Any,
    request: Request,
    *,
    apply: bool,
    pinned_now: int | None,
    async_commit: bool,
    prepare: str | bool = "auto",
) -> Outcome | None:
    """Decide one request with one statement, or return None for the general function.

    None comes back, having written nothing, when the config or the stored state is
    beyond the statement's exact bounds, or when another decision changed the row
    between this one's read and its write (then the general function decides under
    the row lock). ``connection`` is a Django connection in autocommit.
    """
    config = request.config
    rate, period, count = config.rate, config.period, request.count
    # How far below the capacity the stored value may be for every product to stay
    # under the bound (see _PRODUCT_BOUND); below 0, not even a full bucket is safe.
    slack = (_PRODUCT_BOUND - rate) // period - 1 - count
    if slack < 0:
        return None
    algorithm = config.algorithm
    digest = request.key.digest
    values = (
        config.name,
        digest,
        request.key.label,
        algorithm.code,
        rate,
        period,
        config.capacity,
        lowest_value(request.reserve, config.max_reserved),
        count,
        config.window_offset(digest) if algorithm.phased else 0,
        pinned_now,
        CLOCK_SKEW_TOLERANCE,
        config.capacity - slack,
        apply,
        async_commit,
    )
    with connection.cursor() as cursor:
        raw = connection.connection
        prepared = _prepared.get(raw) if prepare is not False else None
        row = None
        if prepared is not None:
            try:
                if not prepared:
                    cursor.execute(_Statement.prepare)
                    _prepared[raw] = True
                cursor.execute(_Statement.execute, values)
                row = cursor.fetchone()
            except DatabaseError as exc:
                # The session lost it (DISCARD ALL, DEALLOCATE): learn again, meanwhile
                # send the statement itself. Nothing ran: the EXECUTE failed before.
                cause = exc.__cause__
                if (getattr(cause, "sqlstate", None) or getattr(cause, "pgcode", None)) != _NO_SUCH_STATEMENT:
                    raise
                del _prepared[raw]
        if row is None:
            cursor.execute(_Statement.text, values)
            row = cursor.fetchone()
            if prepare is not False and raw not in _prepared:
                direct = prepare is True or _reaches_postgresql(raw, row[6])
                _prepared[raw] = False if direct else None
    decided, allowed, value, retry_after, full_after, now = row[:6]
    if not decided:
        return None
    return Outcome(
        [Decision(allowed=allowed, value=value, retry_after=retry_after, full_after=full_after, state=None)], now
    )


# ---------------------------------------------------------------------------------------
# The general case: one call of the PL/pgSQL function
# ---------------------------------------------------------------------------------------


def decide_in_server(
    cursor: Any, requests: Sequence[Request], *, apply: bool, pinned_now: int | None, async_commit: bool
) -> Outcome:
    """Decide ``requests`` all or nothing with one call of the server-side function.

    ``cursor`` must be in autocommit: the call is its own transaction. Rows are passed
    in the portable path's locking order (sorted), so the two paths cannot deadlock.
    ``pinned_now`` replaces the database clock (``frozen_clock`` in tests).
    """
    positions: dict[RowId, int] = {}
    labels: dict[RowId, str] = {}
    for request in requests:
        labels.setdefault(row_id(request), request.key.label)
    ordered = sorted(labels)
    for position, rid in enumerate(ordered, start=1):
        positions[rid] = position

    kinds, rates, periods, capacities, lowests, counts, offsets, fresh_values, fresh_ts = ([] for _ in range(9))
    for request in requests:
        config = request.config
        digest = request.key.digest
        fresh = config.fresh_state(digest)
        algorithm = config.algorithm
        kinds.append(algorithm.code)
        rates.append(config.rate)
        periods.append(config.period)
        capacities.append(config.capacity)
        lowests.append(lowest_value(request.reserve, config.max_reserved))
        counts.append(request.count)
        offsets.append(config.window_offset(digest) if algorithm.phased else 0)
        fresh_values.append(fresh.value)
        fresh_ts.append(fresh.ts)

    numbers = ", ".join(
        f"{_array(column)}::bigint[]"
        for column in (rates, periods, capacities, lowests, counts, offsets, fresh_values, fresh_ts)
    )
    pinned = "NULL" if pinned_now is None else str(int(pinned_now))
    rows = _array([positions[row_id(request)] for request in requests])
    cursor.execute(
        f"SELECT * FROM {FUNCTION_NAME}(%s::text[], %s::text[], %s::text[], {rows}::integer[], "
        f"'{{{','.join(kinds)}}}'::text[], {numbers}, {bool(apply)}, {pinned}::bigint, {bool(async_commit)}, "
        f"{CLOCK_SKEW_TOLERANCE})",
        [[rid[0] for rid in ordered], [rid[1] for rid in ordered], [labels[rid] for rid in ordered]],
    )
    # numeric arrays arrive as Decimals, every one of them whole.
    now, allowed, values, waits, full_waits = cursor.fetchone()
    decisions = [
        Decision(
            allowed=bool(allowed[i]),
            value=int(values[i]),
            retry_after=None if waits[i] is None else int(waits[i]),
            full_after=int(full_waits[i]),
            state=None,
        )
        for i in range(len(requests))
    ]
    return Outcome(decisions, int(now))
