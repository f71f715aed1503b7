"""The database backend's fast path on PostgreSQL: a whole decision in one statement.

The portable path costs four round trips (BEGIN, SELECT ... FOR UPDATE, UPDATE, COMMIT)
with the row locked throughout. Here a decision is one statement in autocommit, which
reads the row, decides with the database clock, and writes only when something changes
(a denial or a check takes no transaction id: no WAL, no commit flush).

* One limit, one key (``decide_one``): a call of ``django_tokenbucket_single_v3``, in
  bigint, whose text is the same for every call, with bound parameters. Where the
  connection reaches PostgreSQL itself (not a pooler such as PgBouncer: the backend's
  ``PREPARE`` option) the call is a prepared statement.
* A token-bucket admission with durable commits, on a connection that prepares
  (``_Admit``): one plain
  upsert whose conflict update decides again on the locked row, cheaper for the server
  than the PL/pgSQL call; what it does not admit, the function decides.
* One limit, one key that is likely denied (``RecentDenials``), or a check: a plain
  read of the row and the clock in one statement, decided in Python (``LimitConfig.decide``).
  A denial or a check ends there, one indexed SELECT (a PL/pgSQL call costs about
  three times as much on the server: the function re-initialises its expressions in
  every transaction). An admission then writes with a compare-and-set.
* Everything else, and the rare single decisions that function hands back (a value
  that could overflow 64 bits, a lost compare-and-set): one call of
  ``django_tokenbucket_decide_v3`` (``decide_in_server``), in numeric.

Both are ports of ``algorithms`` and ``decide_all``; tests/test_pg_fast_path.py holds
them to the same answers.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import Any

from ...algorithms import CLOCK_SKEW_TOLERANCE, Decision, State, lowest_value, token_bucket_taken
from ..base import Outcome, Request, RowId, row_id
from .session import fetch, prepares_on, write

__all__ = [
    "ADMIT_STATEMENT_MARK",
    "FUNCTIONS_SQL",
    "FUNCTION_NAME",
    "FUNCTION_VERSION",
    "PREPARE_MODES",
    "READ_STATEMENT_MARK",
    "SINGLE_STATEMENT_MARK",
    "UNDEFINED_FUNCTION",
    "decide_in_server",
    "decide_one",
    "drop_sql",
    "functions_sql",
    "is_postgresql",
    "prepares_on",
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
#: In the text of every read-first statement, prepared or not (for tests and logs).
READ_STATEMENT_MARK = f"{_PREFIX}read_v{FUNCTION_VERSION}"
#: In the text of every admission statement, prepared or not (for tests and logs).
ADMIT_STATEMENT_MARK = f"{_PREFIX}admit_v{FUNCTION_VERSION}"

#: SQLSTATE of a call to a function that does not exist (the migration not applied).
UNDEFINED_FUNCTION = "42883"

#: Values of the backend's ``PREPARE`` option: "auto" prepares on connections found to
#: reach PostgreSQL itself, True on every connection, False on none.
PREPARE_MODES = ("auto", True, False)


def functions_sql(version: int = FUNCTION_VERSION) -> str:
    """Return the SQL that creates the functions of ``version`` (run by their migration)."""
    sql = resources.files("django_tokenbucket.backends.database").joinpath("sql")
    return sql.joinpath(f"postgresql_v{version}.sql").read_text()


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
    #: Its values come as a sequence, in the order of the parameters.
    order: tuple[str, ...] | None = None


class _Read:
    """The read-first statement: the row (if any) and the clock, read after the row as in
    the function. A LEFT JOIN from one row, so a missing row still gives the clock; the
    key asked for as a range in key order, for the reason "How a row is looked up" in
    the SQL file gives (a generic plan must keep to the unique index)."""

    name = READ_STATEMENT_MARK
    _body = (
        "SELECT COALESCE({0}::bigint, (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::bigint), "
        "r.value, r.ts, pg_backend_pid() FROM (VALUES (1)) AS one LEFT JOIN LATERAL ("
        "SELECT value, ts FROM django_tokenbucket_ratelimit WHERE name = {1} AND key >= {2} AND key <= {2} "
        "ORDER BY key LIMIT 1) AS r ON true"
    )
    text = f"/* {name} */ " + _body.format("%(pinned)s", "%(name)s", "%(key)s")
    prepare = f"PREPARE {name} (bigint, text, text) AS " + _body.format("$1", "$2", "$3")
    execute = f"EXECUTE {name} (%(pinned)s, %(name)s, %(key)s)"
    order = ("pinned", "name", "key")


#: Times the statements below decide (±2^61 µs, as django_tokenbucket_single_v3).
_TIME_BOUND = 2**61


def _bucket_now(value: str, ts: str, at: str, value_or_ts: str) -> str:
    """SQL for a token bucket's value (or its date) at ``at``, refilled from the stored
    (``value``, ``ts``), as algorithms.token_bucket computes it; the value is NULL where
    the statement's bounds do not hold (a clock behind the stored time included)."""
    full = f"{at} - {ts} >= (({{capacity}} - LEAST({value}, {{capacity}})) * {{period}} + {{rate}} - 1) / {{rate}}"
    if value_or_ts == "ts":
        return f"CASE WHEN {full} THEN {at} ELSE {at} - mod({{rate}} * ({at} - {ts}), {{period}}) / {{rate}} END"
    return (
        f"CASE WHEN {at} < {ts} OR {ts} < -{_TIME_BOUND} OR {value} < {{exact_from}} THEN NULL "
        f"WHEN {full} THEN {{capacity}} ELSE LEAST({value}, {{capacity}}) + {{rate}} * ({at} - {ts}) / {{period}} END"
    )


class _Admit:
    """The admission statement: one token-bucket admission as a plain upsert, for
    connections that prepare (planned per call, it costs more than the function).

    It reads the row and the clock, and inserts (a new key) or updates the row only if
    the call is allowed: the conflict's update decides again on the row it locked, the
    latest. It returns the stored state and the time it decided at, from which
    ``algorithms.token_bucket_taken`` makes the decision; no row back means nothing was
    written, and the function decides (a denial, a row beyond the bounds, a race lost).
    A denial locks nothing: the read gates the insert, and only an allowed call reaches
    the row lock. (A PL/pgSQL call costs the server ~30 µs more than this statement:
    the function sets up its expressions in every transaction; issue 19.)

    Deciding at a clock read before the row lock is exact: the update requires the time
    to be no earlier than the stored one, and a bucket only gains with time, so a
    decision that waited for the lock decides on less refill, never on more.
    """

    name = ADMIT_STATEMENT_MARK
    parameters = (
        ("name", "text"),
        ("key", "text"),
        ("label", "text"),
        ("rate", "bigint"),
        ("period", "bigint"),
        ("capacity", "bigint"),
        ("count", "bigint"),
        ("lowest", "bigint"),
        ("exact_from", "bigint"),
        ("pinned", "bigint"),
    )
    _body = (
        "WITH c AS (SELECT COALESCE({pinned}, (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::bigint) AS at) "
        "INSERT INTO django_tokenbucket_ratelimit AS r (name, key, label, value, ts) "
        "SELECT {name}, {key}, {label}, {capacity} - {count}, c.at FROM c LEFT JOIN LATERAL ("
        "SELECT value, ts FROM django_tokenbucket_ratelimit WHERE name = {name} AND key >= {key} AND key <= {key} "
        "ORDER BY key LIMIT 1) AS s ON true "
        f"WHERE CASE WHEN s.ts IS NULL THEN {{capacity}} ELSE {_bucket_now('s.value', 's.ts', 'c.at', 'value')} END "
        "- {count} >= {lowest} "
        "ON CONFLICT (name, key) DO UPDATE "
        f"SET value = {_bucket_now('r.value', 'r.ts', 'excluded.ts', 'value')} - {{count}}, "
        f"ts = {_bucket_now('r.value', 'r.ts', 'excluded.ts', 'ts')} "
        f"WHERE {_bucket_now('r.value', 'r.ts', 'excluded.ts', 'value')} - {{count}} >= {{lowest}} "
        "RETURNING r.value, r.ts, (SELECT at FROM c), pg_backend_pid()"
    )

    def __init__(self) -> None:
        body = self._body
        self.text = f"/* {self.name} */ " + body.format(**{n: f"%({n})s::{t}" for n, t in self.parameters})
        self.prepare = f"PREPARE {self.name} ({', '.join(t for _, t in self.parameters)}) AS " + body.format(
            **{n: f"${i}" for i, (n, _) in enumerate(self.parameters, start=1)}
        )
        self.execute = f"EXECUTE {self.name} ({', '.join(f'%({n})s' for n, _ in self.parameters)})"
        self.order = tuple(n for n, _ in self.parameters)


#: The compare-and-set writes of the read-first path: they match nothing if another
#: decision changed (or made) the row since it was read. With ASYNC_COMMIT the
#: transaction-local setting rides in the statement itself (an autocommit statement is
#: its own transaction), evaluated only on the row being written.
_ASYNC = " AND set_config('synchronous_commit', 'off', true) IS NOT NULL"
_UPDATE = (
    "UPDATE django_tokenbucket_ratelimit SET value = %s, ts = %s "
    "WHERE name = %s AND key = %s AND value = %s AND ts = %s"
)
_INSERT = (
    "INSERT INTO django_tokenbucket_ratelimit (name, key, label, value, ts) SELECT %s, %s, %s, %s, %s "
    "WHERE true{} ON CONFLICT (name, key) DO NOTHING"
)
_ADMIT = _Admit()


def decide_one(
    connection: Any,
    request: Request,
    *,
    apply: bool,
    pinned_now: int | None,
    async_commit: bool,
    prepare: str | bool = "auto",
    read_first: bool = False,
) -> Outcome | None:
    """Decide one request with one statement, or return None for the general function.

    With ``read_first`` (a denial is likely), and for every check (``apply`` false),
    the decision reads the row and decides in Python (``_read_first``). Otherwise a
    token bucket on a connection known to prepare tries the admission statement
    (``_Admit``), and what that does not admit is one call of the single-decision
    function. All are exact whichever is taken.

    None comes back, having written nothing, when the config or the stored state is
    beyond the statement's exact bounds, or when another decision changed the row
    between this one's read and its write (then the general function decides under
    the row lock). ``connection`` is a Django connection in autocommit.
    """
    if read_first or not apply:
        return _read_first(
            connection, request, apply=apply, pinned_now=pinned_now, async_commit=async_commit, prepare=prepare
        )
    config = request.config
    rate, period, count = config.rate, config.period, request.count
    # How far below the capacity the stored value may be for every product to stay
    # under the bound (see _PRODUCT_BOUND); below 0, not even a full bucket is safe.
    slack = (_PRODUCT_BOUND - rate) // period - 1 - count
    if slack < 0:
        return None
    algorithm = config.algorithm
    digest = request.key.digest
    lowest = lowest_value(request.reserve, config.max_reserved)
    # With ASYNC_COMMIT the function stays: amid other writers the upsert measured ~480 µs
    # against the function's ~140 (alone, both ~140), cause not found yet (docs/database.md).
    if (
        algorithm.code == "t"
        and not async_commit
        and prepare is not False
        and prepares_on(connection)
        and (pinned_now is None or 0 <= pinned_now <= _TIME_BOUND)
    ):
        admitted = fetch(
            connection,
            _ADMIT,
            {
                "name": config.name,
                "key": digest,
                "label": request.key.label,
                "rate": rate,
                "period": period,
                "capacity": config.capacity,
                "count": count,
                "lowest": -(2**63) if lowest is None else lowest,
                "exact_from": config.capacity - slack,
                "pinned": pinned_now,
            },
            prepare,
            3,
        )
        if admitted is not None:
            taken, now = State(admitted[0], admitted[1]), admitted[2]
            decision = token_bucket_taken(taken, now, rate=rate, period=period, capacity=config.capacity)
            return Outcome([decision], now)
    values = (
        config.name,
        digest,
        request.key.label,
        algorithm.code,
        rate,
        period,
        config.capacity,
        lowest,
        count,
        config.window_offset(digest) if algorithm.phased else 0,
        pinned_now,
        CLOCK_SKEW_TOLERANCE,
        config.capacity - slack,
        apply,
        async_commit,
    )
    row = fetch(connection, _Statement, values, prepare, 6)
    decided, allowed, value, retry_after, full_after, now = row[:6]
    if not decided:
        return None
    return Outcome(
        [Decision(allowed=allowed, value=value, retry_after=retry_after, full_after=full_after, state=None)], now
    )


def _read_first(
    connection: Any, request: Request, *, apply: bool, pinned_now: int | None, async_commit: bool, prepare: str | bool
) -> Outcome | None:
    """Read the row and the clock, decide in Python, write (compare-and-set) only what changed.

    Python's integers need no bounds. The read takes no row lock and no transaction id,
    like the function's own read; a write matches nothing if the row changed since, and
    then None hands the decision to the general function, which decides under the lock.
    """
    config, digest = request.config, request.key.digest
    now, value, ts, _ = fetch(
        connection, _Read, {"pinned": pinned_now, "name": config.name, "key": digest}, prepare, 3
    )
    state = None if value is None else State(value, ts)
    # decide_all for one request, without its dicts: what changed is what to write.
    decision = config.decide(state, now, request.count, digest, request.reserve)
    new = decision.state if apply else None
    if new is not None and new != state:
        if state is None:
            written = write(
                connection,
                _INSERT.format(_ASYNC if async_commit else ""),
                [config.name, digest, request.key.label, new.value, new.ts],
            )
        else:
            written = write(
                connection,
                _UPDATE + _ASYNC if async_commit else _UPDATE,
                [new.value, new.ts, config.name, digest, state.value, state.ts],
            )
        if written != 1:
            return None
    return Outcome([decision], now)




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
