"""The database backend's PostgreSQL fast path: one statement per decision.

Parity: generated traces replayed through the server-side functions (the single
decision, prepared and sent as it is, handing back what is past its bigint bounds; and
the general function alone) and through the Python algorithms give identical decisions
and stored states. Then what the fast path promises beyond the portable one: one round
trip, no row version written and no transaction id taken by a denial or a check, the
bigint bounds, the caller's transaction still honoured, a missing function survived, and
commits that skip the WAL flush when ASYNC_COMMIT is on. Exactness under several
processes is in test_concurrency.py, which on PostgreSQL runs through this path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace

import pytest
from django.conf import settings as django_settings
from django.core.management import call_command
from django.db import connection, connections, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext
from hypothesis import event, given
from hypothesis import settings as hypothesis_settings

from django_tokenbucket import BackendUnavailable, LimitRequest, limiter
from django_tokenbucket import clock as clock_module
from django_tokenbucket.algorithms import MICRO, State
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.base import Request
from django_tokenbucket.backends.database import DatabaseBackend
from django_tokenbucket.backends.database.postgresql import (
    _PRODUCT_BOUND,
    ADMIT_STATEMENT_MARK,
    FUNCTION_NAME,
    FUNCTIONS_SQL,
    READ_STATEMENT_MARK,
    SINGLE_STATEMENT_MARK,
    _Read,
    decide_in_server,
    decide_one,
    drop_sql,
)
from django_tokenbucket.backends.database.session import REPLAN_EVERY, SESSION_ATTRIBUTE, UNSENT
from django_tokenbucket.keys import encode_key
from django_tokenbucket.models import LimitOverride, OverridesVersion, RateLimit
from django_tokenbucket.testing import frozen_clock

from . import parity
from .concurrency import in_another_thread, sized
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = [pytest.mark.only_on("postgres"), pytest.mark.django_db(transaction=True)]

T0 = 1_700_000_000.0


@contextmanager
def backend_with(**options: object) -> Iterator[DatabaseBackend]:
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "OPTIONS": options}):
        backend = get_backend()
        assert isinstance(backend, DatabaseBackend)
        yield backend


@pytest.fixture
def backend() -> Iterator[DatabaseBackend]:
    with backend_with() as backend:
        yield backend


@pytest.fixture
def async_backend() -> Iterator[DatabaseBackend]:
    with backend_with(ASYNC_COMMIT=True) as backend:
        yield backend


# ---------------------------------------------------------------------------------------
# Parity: the PL/pgSQL port and the Python algorithms agree on every generated trace
# ---------------------------------------------------------------------------------------


def stored(request: Request) -> State | None:
    rows = RateLimit.objects.filter(name=request.config.name, key=request.key.digest).values_list("value", "ts")
    return State(*rows[0]) if rows else None


#: The ways a decision reaches the server: the single statement (prepared, or sent as it
#: is, as behind PgBouncer), falling back to the general function where it hands the
#: decision back; the read-first path (a plain read decided in Python, then a
#: compare-and-set), as a key recently denied takes; and the general function alone.
PATHS = ["single-prepared", "single-sent", "read-first", "general"]


def deciding(path: str, async_commit: bool = False, note=lambda label: None):
    """Return a ``decide(requests, apply)`` that takes ``path`` at the pinned time."""

    def decide(requests, apply):
        pinned_now = clock_module.override()
        if path != "general" and len(requests) == 1:
            prepare = path != "single-sent"
            outcome = decide_one(
                connection,
                requests[0],
                apply=apply,
                pinned_now=pinned_now,
                async_commit=async_commit,
                prepare=prepare,
                read_first=path == "read-first",
            )
            if outcome is not None:
                note("decided by the single statement")
                return outcome
            note("handed to the general function")
        with connection.cursor() as cursor:
            return decide_in_server(cursor, requests, apply=apply, pinned_now=pinned_now, async_commit=async_commit)

    return decide


def replay(path: str, start: int, trace, note=lambda label: None, async_commit: bool = False) -> None:
    RateLimit.objects.all().delete()
    parity.replay(deciding(path, async_commit, note), stored, start, trace, note)


@pytest.fixture(params=PATHS)
def path(request) -> str:
    return request.param


# Four paths, each a database round trip per step: 400 traces of each took 20 s in each
# PostgreSQL env; the nightly tier runs them all.
@hypothesis_settings(parent=parity.PARITY, max_examples=sized(150, 400))
@given(parity.traces())
def test_sql_and_python_agree_on_every_decision(path, case):
    """Decisions, values, retry_after, full_after and stored states, bit for bit."""
    replay(path, *case, note=event)


@hypothesis_settings(parent=parity.PARITY, max_examples=sized(150, 400))
@given(parity.near_ties())
def test_sql_and_python_agree_on_near_ties(path, case):
    replay(path, *case, note=event)


@pytest.mark.parametrize("config, trace", parity.BEYOND_53_BITS, ids=parity.BEYOND_53_BITS_IDS)
def test_sql_and_python_agree_beyond_53_bits(path, config, trace):
    replay(path, parity.T0_US, parity.beyond_53_bits_trace(config, trace))


def test_sql_and_python_agree_when_a_window_moves(path):
    replay(path, parity.T0_US, parity.window_move_trace())


def test_sql_and_python_agree_at_the_clock_skew_tolerance(path):
    replay(path, parity.T0_US, parity.clock_skew_trace())


def test_async_commit_decides_alike(path):
    replay(path, parity.T0_US, parity.window_move_trace(), async_commit=True)


# ---------------------------------------------------------------------------------------
# What the fast path adds
# ---------------------------------------------------------------------------------------


def row_version(name: str) -> tuple[str, int, int]:
    """Return the row's xmin (the transaction that wrote its current version) and state."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT xmin::text, value, ts FROM django_tokenbucket_ratelimit WHERE name = %s", [name])
        return cursor.fetchone()


def on_fast_path(sql: str) -> bool:
    return FUNCTION_NAME in sql or SINGLE_STATEMENT_MARK in sql or READ_STATEMENT_MARK in sql


#: What a process reads of the runtime overrides, at most once per OVERRIDES["MAX_AGE"]
#: (its first decision after a settings change included): not a decision's statement.
OVERRIDE_TABLES = (LimitOverride._meta.db_table, OverridesVersion._meta.db_table)


def decisions_sent(queries) -> list[str]:
    """The statements that decided, without the one PREPARE a connection sends and the
    overrides' refresh."""
    return [
        q["sql"]
        for q in queries
        if not q["sql"].startswith("PREPARE") and not any(table in q["sql"] for table in OVERRIDE_TABLES)
    ]


def test_a_decision_is_one_statement(backend):
    with frozen_clock(T0), CaptureQueriesContext(connection) as queries:
        assert limiter.limit("ten_per_minute", "one").value == 9
        assert limiter.limit("ten_per_minute", "one").value == 8
        assert limiter.limit("ten_per_minute", "new").value == 9
        assert limiter.check("ten_per_minute", "one").ok
        limiter.limit_many(
            [LimitRequest("ten_per_minute", "one"), LimitRequest("inline", "one", config={"rate": 1, "period": 1})]
        )
    sent = decisions_sent(queries)
    # The function until the connection is known to reach PostgreSQL itself, then the
    # admission statement, for a stored key and a new one alike. A check writes nothing
    # whatever it finds: it reads the row, a plain SELECT.
    assert [path_of(sql) for sql in sent] == ["single", "admit", "admit", "read", "general"]
    refreshes = [q for q in queries if any(table in q["sql"] for table in OVERRIDE_TABLES)]
    assert len(refreshes) <= 2  # the version stamp, and the overrides when it is new
    assert len(queries) - len(sent) - len(refreshes) <= 3


def test_denials_and_checks_write_no_row_version(backend):
    with frozen_clock(T0) as clock:
        for _ in range(10):
            assert limiter.limit("ten_per_minute", "k").ok
        written = row_version("ten_per_minute")
        assert written[1] == 0
        for _ in range(5):
            assert not limiter.limit("ten_per_minute", "k").ok
            assert limiter.check("ten_per_minute", "k").ok is False
        assert row_version("ten_per_minute") == written
        clock.advance(6)
        assert limiter.limit("ten_per_minute", "k").ok
        assert row_version("ten_per_minute")[0] != written[0]


@pytest.mark.parametrize("read_first", [False, True], ids=["single", "read-first"])
def test_a_denial_and_a_check_take_no_transaction_id_and_lock_no_row(backend, read_first):
    """The single statement (or the read-first one) run inside a transaction of the
    test's own, which shows whether it took a transaction id (any write, or a row lock,
    would)."""
    config = parity._config(name="xid", rate=10 * MICRO, period=60 * MICRO, capacity=10 * MICRO)
    request = Request(config, parity.ALICE, MICRO)

    def decide(apply: bool) -> bool:
        outcome = decide_one(
            connection, request, apply=apply, pinned_now=parity.T0_US, async_commit=False, read_first=read_first
        )
        assert outcome is not None
        return outcome.decisions[0].allowed

    def xmax() -> str:
        with connection.cursor() as cursor:
            cursor.execute("SELECT xmax::text FROM django_tokenbucket_ratelimit WHERE name = 'xid'")
            return cursor.fetchone()[0]

    assert all(decide(apply=True) for _ in range(10))
    # (An admission by the upsert leaves its own transaction in xmax, as a lock.)
    admitted = xmax()
    # The admission statement finds the call denied and hands it to the function; the
    # function is sent, then prepared: alike.
    assert not any(decide(apply=True) for _ in range(7))
    for apply in (True, False):  # a denial, and a check
        with transaction.atomic():
            assert not decide(apply)
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_current_xact_id_if_assigned()")
                assert cursor.fetchone()[0] is None
    assert xmax() == admitted


def paths_taken(trace) -> list[str]:
    labels: list[str] = []
    replay("single-prepared", parity.T0_US, trace, note=labels.append)
    return [label for label in labels if label.startswith(("decided", "handed"))]


SINGLE, GENERAL = "decided by the single statement", "handed to the general function"


def test_configs_beyond_the_bigint_bounds_go_to_the_general_function():
    """The caller's bound: every product of a deficit (here the count) and the period
    below 2^62. One period more, and the same call goes to the general function."""
    rate, count = MICRO, MICRO
    period = (_PRODUCT_BOUND - rate) // (count + 1)
    inside = parity._config(rate=rate, period=period, capacity=MICRO)
    outside = replace(inside, period=period + 2)
    assert paths_taken([(0, [Request(inside, parity.ALICE, count)], True)]) == [SINGLE]
    assert paths_taken([(0, [Request(outside, parity.ALICE, count)], True)]) == [GENERAL]


def test_states_beyond_the_bigint_bounds_go_to_the_general_function():
    """The function's bounds, checked in SQL on the stored state: a debt deeper than the
    bound allows for this config, and clocks beyond 2^61 µs."""
    config = parity._config(rate=MICRO, period=2**40, capacity=MICRO)
    slack = (_PRODUCT_BOUND - config.rate) // config.period - 1 - 1  # for a count of 1
    # Taking more than slack from a full bucket leaves a value below what the bound allows.
    shallow, deep = slack, slack + 1
    for debt, path in ((shallow, SINGLE), (deep, GENERAL)):
        trace = [
            (0, [Request(config, parity.ALICE, debt, True)], True),
            (0, [Request(config, parity.ALICE, 1, True)], True),
        ]
        assert paths_taken(trace)[-1] == path
    late = 2**61 - parity.T0_US
    trace = [(late, [Request(config, parity.ALICE, 1)], True), (1, [Request(config, parity.ALICE, 1)], True)]
    assert paths_taken(trace) == [SINGLE, GENERAL]


def test_a_statement_the_session_lost_is_sent_and_prepared_again(backend):
    """DISCARD ALL or DEALLOCATE (a pooler's reset query, say) drops the prepared statement:
    the next decision sends it as it is, and the one after prepares it again."""
    with frozen_clock(T0):
        for expected in (9, 8):  # sent, then the admission statement prepared
            assert limiter.limit("ten_per_minute", "lost").value == expected
        with connection.cursor() as cursor:
            cursor.execute("DEALLOCATE ALL")
        with CaptureQueriesContext(connection) as queries:
            for expected in (7, 6, 5, 4):
                assert limiter.limit("ten_per_minute", "lost").value == expected
    kinds = [(q["sql"].split(" ", 1)[0], path_of(q["sql"])) for q in queries]
    assert kinds == [
        ("EXECUTE", "admit"),  # lost: sent as it is, and the session is learned again
        ("/*", "admit"),
        ("PREPARE", "admit"),
        ("EXECUTE", "admit"),
        ("EXECUTE", "admit"),
        ("EXECUTE", "admit"),
    ]



@contextmanager
def observer() -> Iterator[Callable[[int], str]]:
    """A second connection, returning the last statement the server ran for a backend pid."""
    import psycopg

    with psycopg.connect(**connection.get_connection_params(), autocommit=True) as other:
        yield lambda pid: other.execute("SELECT query FROM pg_stat_activity WHERE pid = %s", [pid]).fetchone()[0]


def test_a_prepared_statement_is_bound_by_the_protocol_not_quoted_into_an_execute(backend):
    """Once prepared, a decision's values go to the server apart from the statement
    (libpq's Bind and Execute): the server runs the prepared text, not an ``EXECUTE``
    with the values quoted into it as Django's cursor would send them."""
    with frozen_clock(T0), observer() as last_statement_of:
        assert limiter.limit("ten_per_minute", "bound").value == 9  # sent, and the session learned
        for expected in (8, 7):  # prepared, then bound
            assert limiter.limit("ten_per_minute", "bound").value == expected
            assert last_statement_of(connection.connection.info.backend_pid).startswith(
                f"PREPARE {ADMIT_STATEMENT_MARK} "
            )
        for _ in range(2):  # a check (what would be left): the read, prepared and bound likewise
            assert limiter.check("ten_per_minute", "bound").value == 6
        assert last_statement_of(connection.connection.info.backend_pid).startswith(f"PREPARE {READ_STATEMENT_MARK} ")
        assert limiter.get_value("ten_per_minute", "bound") == 7


def test_a_bound_statement_the_session_lost_is_sent_then_prepared_again(backend):
    """After DEALLOCATE ALL, binding fails before anything ran: the decision is sent as
    it is (spending once), and the next one prepares and binds again."""
    with frozen_clock(T0), observer() as last_statement_of:
        for expected in (9, 8, 7):
            assert limiter.limit("ten_per_minute", "lost").value == expected
        with connection.cursor() as cursor:
            cursor.execute("DEALLOCATE ALL")
        for expected in (6, 5, 4):
            assert limiter.limit("ten_per_minute", "lost").value == expected
        assert last_statement_of(connection.connection.info.backend_pid).startswith(f"PREPARE {ADMIT_STATEMENT_MARK} ")
    assert RateLimit.objects.get(name="ten_per_minute").value == 4 * MICRO


def test_text_the_protocol_cannot_carry_is_left_to_the_cursor(backend):
    """A text parameter is a C string to libpq, which a NUL would cut short, reading
    another key: the binder leaves such a value to the cursor (no limit name, digest or
    label holds one), which refuses it."""
    import psycopg

    limiter.check("ten_per_minute", "nul")  # the session and its read statement
    limiter.check("ten_per_minute", "nul")
    session = getattr(connection, SESSION_ATTRIBUTE)
    values = {"pinned": None, "name": "ten_per_minute", "key": "a\x00b"}
    assert session.bind(_Read, values) is UNSENT
    with pytest.raises(psycopg.DataError, match="NUL"):
        session.cursor.execute(_Read.execute, values)


def test_a_denied_fresh_key_creates_no_row(backend):
    with frozen_clock(T0):
        both = [LimitRequest("ten_per_minute", "new", count=6), LimitRequest("ten_per_minute", "new", count=5)]
        assert not limiter.limit_many(both).ok
        assert limiter.check("ten_per_minute", "new").ok
    assert not RateLimit.objects.exists()


def test_inside_the_callers_transaction_the_portable_path_joins_it(backend):
    with frozen_clock(T0):
        with CaptureQueriesContext(connection) as queries, transaction.atomic():
            assert limiter.limit("ten_per_minute", "tx", count=4).value == 6
            transaction.set_rollback(True)
        assert not any(on_fast_path(q["sql"]) for q in queries)
        # Rolled back with the caller's transaction: the tokens are unspent.
        assert limiter.get_value("ten_per_minute", "tx") == 10


def test_the_portable_path_when_the_fast_path_is_off():
    with backend_with(FAST_PATH=False):
        with frozen_clock(T0), CaptureQueriesContext(connection) as queries:
            assert limiter.limit("ten_per_minute", "off").value == 9
        assert not any(on_fast_path(q["sql"]) for q in queries)
        assert any("FOR UPDATE" in q["sql"] for q in queries)


def test_the_app_clock_keeps_the_portable_path(backend):
    # The fast path reads the time after the rows; a host's clock would be read before.
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "CLOCK": "app"}):
        with CaptureQueriesContext(connection) as queries:
            assert limiter.limit("ten_per_minute", "app").ok
    assert not any(on_fast_path(q["sql"]) for q in queries)


def test_the_database_clock_decides(backend):
    with connection.cursor() as cursor:
        cursor.execute("SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::bigint")
        before = cursor.fetchone()[0]
    status = limiter.limit("ten_per_minute", "clock")
    with connection.cursor() as cursor:
        cursor.execute("SELECT (EXTRACT(EPOCH FROM clock_timestamp()) * 1000000)::bigint")
        after = cursor.fetchone()[0]
    assert before <= status.timestamp * MICRO <= after + 1
    assert before <= row_version("ten_per_minute")[2] <= after


def test_a_missing_function_falls_back_once_with_a_warning(backend, caplog):
    with connection.cursor() as cursor:
        cursor.execute(drop_sql())
    try:
        with frozen_clock(T0), caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
            for expected in (9, 8, 7):
                assert limiter.limit("ten_per_minute", "gone").value == expected
        warnings = [r for r in caplog.records if FUNCTION_NAME in r.getMessage()]
        assert len(warnings) == 1
        assert "migrate" in warnings[0].getMessage()
    finally:
        with connection.cursor() as cursor:
            cursor.execute(FUNCTIONS_SQL)


def wal_flushes() -> int:
    """Return how many times the server has flushed the WAL to disk so far."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute("SELECT wal_sync FROM pg_stat_wal")
        return int(cursor.fetchone()[0])


def table_statistic(sql: str) -> int:
    """Return the server's statistics ``sql`` reads, up to date with this session's work."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_force_next_flush()")
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(sql)
        return int(cursor.fetchone()[0])


def index_entries_read() -> int:
    """Return how many index entries of the rate-limit table the server has read so far."""
    return table_statistic(
        "SELECT sum(idx_tup_read) FROM pg_stat_user_indexes WHERE relname = 'django_tokenbucket_ratelimit'"
    )


def test_a_connection_planned_on_an_empty_table_still_finds_rows_by_key(backend):
    """PL/pgSQL keeps its plans for the life of a connection. Planned generically while the
    table was empty, the lookup of (name, key) tied with the admin's (name, ts) index, and
    a connection kept open (CONN_MAX_AGE) then read every row of the limit on each
    decision as the table grew: O(rows), 14 ms a decision at 10^5 rows."""
    with frozen_clock(T0):
        for i in range(10):  # past PL/pgSQL's five custom plans, on the empty table
            limiter.limit("ten_per_minute", f"early{i}")
        with connection.cursor() as cursor:  # the same connection: the same cached plans
            cursor.execute(
                "INSERT INTO django_tokenbucket_ratelimit (name, key, label, value, ts) "
                "SELECT 'ten_per_minute', md5(g::text), '', 0, 0 FROM generate_series(1, 20000) g"
            )
        before = index_entries_read()
        for i in range(3):
            assert limiter.limit("ten_per_minute", f"late{i}").ok
        assert index_entries_read() - before < 50


def test_the_read_first_statement_planned_on_an_empty_table_still_finds_rows_by_key(backend):
    """The same for the prepared read (checks, and keys recently denied): a generic plan
    made on the empty table must still go through the unique (name, key) index."""
    with frozen_clock(T0):
        for i in range(10):  # past the prepared statement's five custom plans
            limiter.check("ten_per_minute", f"early{i}")
        with connection.cursor() as cursor:
            cursor.execute(
                "INSERT INTO django_tokenbucket_ratelimit (name, key, label, value, ts) "
                "SELECT 'ten_per_minute', md5(g::text), '', 0, 0 FROM generate_series(1, 20000) g"
            )
        before = index_entries_read()
        for i in range(3):
            assert limiter.check("ten_per_minute", f"late{i}").ok
        assert index_entries_read() - before < 50


def rows_read() -> int:
    """Return how many rows of the rate-limit table the server has read so far, through
    an index or by sequential scans."""
    return table_statistic(
        "SELECT idx_tup_fetch + seq_tup_read FROM pg_stat_user_tables WHERE relname = 'django_tokenbucket_ratelimit'"
    )


def test_plans_made_while_the_table_was_analyzed_small_are_made_again(backend):
    """Analyzed at a few rows, the table's cheapest lookup by key is a sequential scan and
    a sort, and the session keeps that plan (the prepared statements' and the functions')
    until the table is analyzed again: every decision then reads the whole table as it
    grows. Each connection drops its plans every REPLAN_EVERY seconds."""
    with frozen_clock(T0):
        for i in range(10):
            limiter.limit("ten_per_minute", f"early{i}")
        with connection.cursor() as cursor:
            cursor.execute("ANALYZE django_tokenbucket_ratelimit")
        for i in range(10):  # past the five custom plans: generic plans, from ten rows
            limiter.limit("ten_per_minute", f"early{i}")  # the admission statement
            limiter.check("ten_per_minute", f"early{i}")  # the read
            limiter.limit("ten_per_minute", f"early{i}", count=10)  # denied: the function
        with connection.cursor() as cursor:  # the same connection: the same cached plans
            cursor.execute(
                "INSERT INTO django_tokenbucket_ratelimit (name, key, label, value, ts) "
                "SELECT 'ten_per_minute', md5(g::text), '', 0, 0 FROM generate_series(1, 20000) g"
            )

        def rows_read_by_decisions() -> int:
            before = rows_read()
            limiter.limit("ten_per_minute", "late")
            limiter.check("ten_per_minute", "late")
            limiter.limit("ten_per_minute", "late", count=10)
            return rows_read() - before

        assert rows_read_by_decisions() > 20000  # the cliff, while the plans are kept
        getattr(connection, SESSION_ATTRIBUTE).replan_at = 0.0  # REPLAN_EVERY has passed
        assert rows_read_by_decisions() < 50
        assert getattr(connection, SESSION_ATTRIBUTE).replan_at > time.monotonic() + REPLAN_EVERY - 5


@pytest.mark.parametrize("options, most", [({}, None), ({"ASYNC_COMMIT": True}, 25)], ids=["durable", "async"])
def test_async_commit_skips_the_wal_flush(options, most):
    """Each durable commit waits for its own flush; ASYNC_COMMIT leaves them to the WAL
    writer. (The server is shared with other clients, whose flushes count too: hence
    the margin.)"""
    decisions = 100
    with backend_with(**options):
        before = wal_flushes()
        for number in range(decisions):
            assert limiter.limit("ten_per_minute", f"wal-{number}").ok
        flushes = wal_flushes() - before
    if most is None:
        assert flushes >= decisions
    else:
        assert flushes <= most


@pytest.mark.parametrize("async_commit, most", [(False, None), (True, 25)], ids=["durable", "async"])
def test_async_commit_skips_the_wal_flush_on_the_read_first_path(async_commit, most):
    """The read-first path's compare-and-set writes honour ASYNC_COMMIT too. (The server
    is shared with other clients, whose flushes count too: hence the margin.)"""
    decisions = 100
    config = parity._config(name="wal", rate=10 * MICRO, period=60 * MICRO, capacity=10 * MICRO)
    before = wal_flushes()
    for number in range(decisions):
        request = Request(config, encode_key(f"wal-{number}"), MICRO)
        outcome = decide_one(
            connection, request, apply=True, pinned_now=parity.T0_US, async_commit=async_commit, read_first=True
        )
        assert outcome is not None and outcome.decisions[0].allowed
    flushes = wal_flushes() - before
    assert RateLimit.objects.filter(name="wal", value=9 * MICRO).count() == decisions
    if most is None:
        assert flushes >= decisions
    else:
        assert flushes <= most


def path_of(sql: str) -> str:
    marks = (
        (SINGLE_STATEMENT_MARK, "single"),
        (ADMIT_STATEMENT_MARK, "admit"),
        (READ_STATEMENT_MARK, "read"),
        (FUNCTION_NAME, "general"),
    )
    for mark, path in marks:
        if mark in sql:
            return path
    return sql.split(" ", 1)[0]


def test_a_key_seen_denied_is_read_first_until_it_admits_with_room(backend, without_deny_cache):
    """The path follows what this process saw: the admission statement while a key
    admits (the function first, until the connection is known to reach PostgreSQL and
    prepare), a read once it is short of a call, until an admission leaves room for the
    next."""
    with frozen_clock(T0), CaptureQueriesContext(connection) as queries:
        allowed = [limiter.limit("ten_per_minute", "seen").ok for _ in range(12)]
        limiter.reset("ten_per_minute", "seen")
        allowed += [limiter.limit("ten_per_minute", "seen").ok for _ in range(2)]
    assert allowed == [True] * 10 + [False, False, True, True]
    paths = [path_of(sql) for sql in decisions_sent(queries)]
    paths = [path for path in paths if path not in ("BEGIN", "COMMIT")]  # around reset's DELETE
    assert paths == ["single"] + ["admit"] * 9 + ["read", "read", "DELETE", "read", "INSERT", "admit"]


def while_another_takes_the_last_token(decide: Callable[[], object]) -> object:
    """Return what ``decide`` returns, run on a connection of its own while another holds
    an uncommitted decision taking the last token of ``ten_per_minute``, committed once
    ``decide`` waits for that row's lock."""
    other = connections.create_connection("default")
    other.set_autocommit(False)

    def commit_once_it_waits() -> None:
        deadline = time.monotonic() + 10
        while not waiting_for_a_lock() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert waiting_for_a_lock()
        other.commit()

    try:
        with other.cursor() as cursor:
            cursor.execute(
                "UPDATE django_tokenbucket_ratelimit SET value = value - %s WHERE name = 'ten_per_minute'", [MICRO]
            )
        return in_another_thread(decide, meanwhile=commit_once_it_waits)
    finally:
        other.close()


def one_token_left() -> Request:
    with frozen_clock(T0):
        for _ in range(9):
            assert limiter.limit("ten_per_minute", "race").ok
    return Request(limiter.resolve("ten_per_minute"), encode_key("race"), MICRO)


def test_a_compare_and_set_that_loses_a_race_hands_over_and_stays_exact(backend):
    """Another decision commits between this one's read and its write: the write matches
    nothing, and the general function decides again under the row lock."""
    request = one_token_left()

    def decide() -> tuple[object, object, list[str]]:
        with CaptureQueriesContext(connections["default"]) as queries:
            # The read sees one token and admits; its write waits for the other's row lock.
            first = decide_one(
                connections["default"],
                request,
                apply=True,
                pinned_now=parity.T0_US,
                async_commit=False,
                read_first=True,
            )
            with connections["default"].cursor() as cursor:
                then = decide_in_server(cursor, [request], apply=True, pinned_now=parity.T0_US, async_commit=False)
        return first, then, [path_of(q["sql"]) for q in queries]

    first, then, paths = while_another_takes_the_last_token(decide)  # type: ignore[misc]
    assert first is None
    assert paths == ["read", "UPDATE", "general"]
    assert not then.decisions[0].allowed and then.decisions[0].value == 0
    assert RateLimit.objects.get(name="ten_per_minute").value == 0


def test_an_admission_that_loses_the_row_lock_to_another_hands_over_and_stays_exact(backend):
    """The admission statement reads one token left; another decision takes it and commits
    while this one waits for the row lock: the conflict's update decides again on the
    latest row, writes nothing, and the function denies."""
    request = one_token_left()

    def decide() -> tuple[object, list[str]]:
        with frozen_clock(T0):  # learn that this connection prepares
            limiter.check("ten_per_minute", "another key")
        with CaptureQueriesContext(connections["default"]) as queries:
            outcome = decide_one(
                connections["default"], request, apply=True, pinned_now=parity.T0_US, async_commit=False
            )
        return outcome, [path_of(sql) for sql in decisions_sent(queries)]

    outcome, paths = while_another_takes_the_last_token(decide)  # type: ignore[misc]
    assert paths == ["admit", "single"]
    assert not outcome.decisions[0].allowed and outcome.decisions[0].value == 0
    assert RateLimit.objects.get(name="ten_per_minute").value == 0


def waiting_for_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_stat_clear_snapshot()")
        cursor.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() AND wait_event_type = 'Lock'"
        )
        return bool(cursor.fetchone()[0])


# ---------------------------------------------------------------------------------------
# Faults on the fast path (the portable path's are in test_database_faults.py)
# ---------------------------------------------------------------------------------------

SIDE = "serializable"  # a second connection to the test database


@pytest.fixture
def retrying() -> Iterator[DatabaseBackend]:
    options = {"RETRY_ATTEMPTS": 3, "RETRY_BASE_DELAY": 0.0001, "RETRY_MAX_DELAY": 0.001}
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **options}):
        backend = get_backend()
        assert isinstance(backend, DatabaseBackend)
        yield backend


@pytest.fixture
def failing_writes() -> Iterator[Callable[[int], None]]:
    """``fail(n)``: the next n writes to the table raise 40001 in the server, after the write.

    A trigger raises it, numbering the writes with a sequence (which a rollback does not undo).
    """
    with connection.cursor() as cursor:
        cursor.execute(
            """
            CREATE SEQUENCE test_tokenbucket_writes;
            CREATE FUNCTION test_tokenbucket_fail_write() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN
                IF nextval('test_tokenbucket_writes') <= current_setting('test_tokenbucket.fail_writes')::bigint THEN
                    RAISE EXCEPTION 'injected serialization failure' USING ERRCODE = '40001';
                END IF;
                RETURN NEW;
            END $$;
            CREATE TRIGGER test_tokenbucket_fail_write AFTER INSERT OR UPDATE ON django_tokenbucket_ratelimit
                FOR EACH ROW EXECUTE FUNCTION test_tokenbucket_fail_write();
            SET test_tokenbucket.fail_writes = 0;
            """
        )

    def fail(writes: int) -> None:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT setval('test_tokenbucket_writes', 1, false), set_config(%s, %s, false)",
                ["test_tokenbucket.fail_writes", str(writes)],
            )

    try:
        yield fail
    finally:
        with connection.cursor() as cursor:
            cursor.execute(
                "DROP TRIGGER test_tokenbucket_fail_write ON django_tokenbucket_ratelimit; "
                "DROP FUNCTION test_tokenbucket_fail_write(); DROP SEQUENCE test_tokenbucket_writes;"
            )


def test_injected_serialization_failures_consume_one_token_per_admission(retrying, failing_writes):
    config = {"rate": 100, "period": 3600}
    retried = retrying.retried["40001"]
    with frozen_clock(T0):
        admitted = 0
        for _ in range(20):
            failing_writes(2)  # the first two attempts of every decision fail after their write
            admitted += limiter.limit("f10", "k", config=config).ok
        assert retrying.retried["40001"] - retried == 40
        assert admitted == 20
        assert limiter.get_value("f10", "k", config=config) == 100 - admitted


@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_exhausted_retries_apply_the_fail_mode_and_write_nothing(retrying, failing_writes, fail_open):
    config = {"rate": 100, "period": 3600}
    with frozen_clock(T0), override_settings(TOKENBUCKET={**django_settings.TOKENBUCKET, "FAIL_OPEN": fail_open}):
        limiter.limit("f10", "k", config=config)
        before = row_version("f10")
        failing_writes(3)
        if fail_open:
            assert limiter.limit("f10", "k", config=config).failed_open
        else:
            with pytest.raises(BackendUnavailable, match="'f10'"):
                limiter.limit("f10", "k", config=config)
        assert row_version("f10") == before


@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_a_connection_killed_mid_statement_fails_by_the_mode_and_writes_nothing(backend, caplog, fail_open):
    """The server ends the session while the function waits for a row lock: nothing is written."""
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "FAIL_OPEN": fail_open}), frozen_clock(T0):
        limiter.limit("f1", "k", count=4, config={"rate": 10, "period": 60})
        before = row_version("f1")
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid = cursor.fetchone()[0]
        killed = threading.Event()

        def kill_once_waiting() -> None:
            try:
                with connections[SIDE].cursor() as cursor:
                    deadline = time.monotonic() + 10
                    while time.monotonic() < deadline:  # polled until the statement waits for the lock
                        cursor.execute("SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s", [pid])
                        if cursor.fetchone()[0] == "Lock":
                            cursor.execute("SELECT pg_terminate_backend(%s)", [pid])
                            killed.set()
                            return
                        time.sleep(0.005)
            finally:
                connections[SIDE].close()

        with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
            with transaction.atomic(using=SIDE):
                list(RateLimit.objects.using(SIDE).select_for_update().filter(name="f1"))
                killer = threading.Thread(target=kill_once_waiting)
                killer.start()
                if fail_open:
                    status = limiter.limit("f1", "k", config={"rate": 10, "period": 60})
                    assert status.ok and status.failed_open
                else:
                    with pytest.raises(BackendUnavailable, match="'f1'"):
                        limiter.limit("f1", "k", config={"rate": 10, "period": 60})
                killer.join()
        assert killed.is_set()
        assert row_version("f1") == before
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "'f1'" in r.getMessage()]
        assert len(warnings) == 1 and "'default'" in warnings[0].getMessage()
        # The next call opens a new connection and decides on the fast path again.
        with CaptureQueriesContext(connection) as queries:
            assert limiter.limit("f1", "k", config={"rate": 10, "period": 60}).value == 5
        assert any(on_fast_path(q["sql"]) for q in queries)


def installed_versions() -> list[str]:
    with connection.cursor() as cursor:
        cursor.execute("SELECT proname FROM pg_proc WHERE proname LIKE 'django\\_tokenbucket\\_%%' ORDER BY proname")
        return [name for (name,) in cursor.fetchall()]


def test_migrations_install_each_version_and_remove_it():
    current = ["django_tokenbucket_decide_v3", "django_tokenbucket_single_v3", "django_tokenbucket_step_v3"]
    assert installed_versions() == current
    assert FUNCTION_NAME == "django_tokenbucket_decide_v3"
    try:
        call_command("migrate", "django_tokenbucket", "0003", verbosity=0)
        assert installed_versions() == []
    finally:
        call_command("migrate", "django_tokenbucket", verbosity=0)
    assert installed_versions() == current


def test_code_meeting_an_older_schema_takes_the_portable_path(backend, caplog):
    """Deployed before `migrate` has installed this code's version (here, none at all; a
    schema a version behind looks the same to it): decisions stay right, on the portable
    path, and a prepared statement of an earlier call does not outlive its function."""
    with frozen_clock(T0):
        assert limiter.limit("ten_per_minute", "before").ok  # the function, sent
        assert limiter.limit("ten_per_minute", "before").ok  # the admission statement, prepared
        # The admission statement finds it denied: the function decides, prepared.
        assert not limiter.limit("ten_per_minute", "before", count=10).ok
    call_command("migrate", "django_tokenbucket", "0003", verbosity=0)
    try:
        with frozen_clock(T0), caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
            with CaptureQueriesContext(connection) as queries:
                # The admission statement needs the table only; the denial, the function.
                assert limiter.limit("ten_per_minute", "older").value == 9
                assert not limiter.limit("ten_per_minute", "older", count=10).ok
                for expected in (8, 7):
                    assert limiter.limit("ten_per_minute", "older").value == expected
        assert "FOR UPDATE" in " ".join(q["sql"] for q in queries)
        assert len([r for r in caplog.records if FUNCTION_NAME in r.getMessage()]) == 1
    finally:
        call_command("migrate", "django_tokenbucket", verbosity=0)


def test_without_observers_the_fast_path_skips_djangos_cursor_and_with_them_they_see_it(backend, monkeypatch):
    """Django's cursor wrapper costs a decision as much as the server's work beyond SELECT 1,
    so the fast path runs its statements on a driver cursor of its own, unless something
    observes the connection's queries: an execute_wrapper (APM agents, debug toolbars)
    then sees every statement, a decision's outcome unchanged."""
    wrapped = connections["default"]
    created: list[object] = []
    original = wrapped.create_cursor
    monkeypatch.setattr(wrapped, "create_cursor", lambda name=None: created.append(name) or original(name))
    with frozen_clock(T0):
        assert limiter.limit("ten_per_minute", "quiet").value == 9  # connects, learns
        created.clear()
        assert [limiter.limit("ten_per_minute", "quiet").value for _ in range(3)] == [8, 7, 6]
        assert limiter.check("ten_per_minute", "quiet").value == 5  # what limit() would leave
        assert created == []
        seen: list[str] = []

        def observe(execute, sql, params, many, context):
            seen.append(path_of(sql))
            return execute(sql, params, many, context)

        with connection.execute_wrapper(observe):
            assert [limiter.limit("ten_per_minute", "quiet").value for _ in range(2)] == [5, 4]
            assert limiter.check("ten_per_minute", "quiet").value == 3
    assert seen == ["admit", "admit", "read"]
    assert len(created) == 3
