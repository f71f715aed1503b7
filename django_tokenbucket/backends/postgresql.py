"""The database backend's fast path on PostgreSQL: a whole decision in one statement.

The portable path costs four round trips (BEGIN, SELECT ... FOR UPDATE, UPDATE, COMMIT)
with the row locked throughout. Here one call of a server-side function, installed by
migration 0005 from ``sql/postgresql_decide_v2.sql``, reads the rows, decides with the
database clock, and writes only when something changes (a denial or a check costs no
WAL). The function is a port of ``algorithms`` and ``decide_all``;
tests/test_pg_fast_path.py holds the two to the same answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

from ..algorithms import Decision, lowest_value
from ..limits import FIXED_WINDOW
from .base import Outcome, Request, RowId, row_id

__all__ = [
    "FUNCTIONS_SQL",
    "FUNCTION_NAME",
    "FUNCTION_VERSION",
    "UNDEFINED_FUNCTION",
    "decide_in_server",
    "drop_sql",
    "functions_sql",
    "is_postgresql",
]

#: The version of the functions this code calls. A change of behaviour ships as a new
#: version with its own migration (0004 installed 1, 0005 installed 2 and removed 1), so
#: code and schema briefly out of step never disagree silently: code that finds no
#: function of its version takes the portable path.
FUNCTION_VERSION = 2


def _names(version: int) -> tuple[str, str]:
    return f"django_tokenbucket_decide_v{version}", f"django_tokenbucket_step_v{version}"


FUNCTION_NAME = _names(FUNCTION_VERSION)[0]

#: SQLSTATE of a call to a function that does not exist (the migration not applied).
UNDEFINED_FUNCTION = "42883"


def functions_sql(version: int) -> str:
    """Return the SQL that creates the functions of ``version`` (run by their migration)."""
    return resources.files("django_tokenbucket").joinpath(f"sql/postgresql_decide_v{version}.sql").read_text()


FUNCTIONS_SQL = functions_sql(FUNCTION_VERSION)

_ARGUMENT_TYPES = (
    "text[], text[], text[], integer[], text[], bigint[], bigint[], bigint[], "
    "bigint[], bigint[], bigint[], bigint[], bigint[], boolean, bigint, boolean"
)
_STEP_ARGUMENT_TYPES = ", ".join(["text"] + ["numeric"] * 9)


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
    decide, step = _names(version)
    return (
        f"DROP FUNCTION IF EXISTS {decide}({_ARGUMENT_TYPES}); "
        f"DROP FUNCTION IF EXISTS {step}({_STEP_ARGUMENT_TYPES});"
    )


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
        is_window = config.kind == FIXED_WINDOW
        kinds.append("f" if is_window else "t")
        rates.append(config.rate)
        periods.append(config.period)
        capacities.append(config.capacity)
        lowests.append(lowest_value(request.reserve, config.max_reserved))
        counts.append(request.count)
        offsets.append(config.window_offset(digest) if is_window else 0)
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
        f"'{{{','.join(kinds)}}}'::text[], {numbers}, {bool(apply)}, {pinned}::bigint, {bool(async_commit)})",
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
