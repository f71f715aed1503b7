"""The database backend's portable path when its server fails it: connections dropped,
timeouts, serialization failures, ambiguous commits, a lock holder killed, and the time
a decision reads after waiting for a lock (RELIABILITY-PLAN rows, docs/reliability.md).

- F1: the server drops the connection between the row lock and the write, or drops an
  idle persistent connection (``CONN_MAX_AGE``, with and without ``CONN_HEALTH_CHECKS``).
- F7/F8: statement and lock timeouts map to the fail mode, are not retried, and leave no
  partial write (MySQL's lock wait timeout rolls back only its statement).
- F10: serialization failures injected after the write: each admitted decision still
  consumes exactly one token.
- F11: an ambiguous commit (committed, but reported as failed) is never run again.
- F12: a worker SIGKILLed while it holds the row lock blocks nobody once it is gone.
- K4: a decision that waited for the row lock reads the store's time after the wait
  (negative control: the statement's start time, which is older than the state).

Faults are caused for real on PostgreSQL and MariaDB (``pg_terminate_backend()``,
``KILL``, a lock held by a second connection, errors raised by the server itself);
the test hook is a wrapper around one backend step. The clock is pinned (K4 reads the
store's own), so every assertion is exact; the few durations measured are printed as
figures, never asserted.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.db import close_old_connections, connections, transaction
from django.db.models.expressions import RawSQL
from django.test import override_settings

from django_tokenbucket import BackendUnavailable, LimitRequest, limiter, signals
from django_tokenbucket.algorithms import MICRO
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.database import DatabaseBackend, error_code
from django_tokenbucket.backends.database import backend as database_module
from django_tokenbucket.keys import encode_key
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock

from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

T0 = 1_700_000_000.0
CONFIG = {"rate": 10, "period": 60}  # C = 10, one token every 6 s
#: F1, F10, F11 and F12 break the portable path between its steps (the lock, the write,
#: the COMMIT); the PostgreSQL fast path has one step, and its faults are in
#: test_pg_fast_path.py.
PORTABLE = {"OPTIONS": {"FAST_PATH": False}}
#: A second connection to the same test database (a test mirror of "default").
SIDE = {"postgres": "serializable", "mariadb": "repeatable_read"}.get(settings.DB)


def stored(name: str, key: object) -> tuple[int, int] | None:
    row = RateLimit.objects.filter(name=name, key=encode_key(key).digest).values_list("value", "ts").first()
    return None if row is None else tuple(row)


def figure(line: str) -> None:
    print(f"\n{line}")


def warnings_of(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "django_tokenbucket" and r.levelno == logging.WARNING]


@contextmanager
def tokenbucket(**options):
    # New TOKENBUCKET settings also reset the throttled logger, so log counts start at 0.
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **options}):
        yield get_backend()


@contextmanager
def row_locked_elsewhere(name: str, key: object):
    """Hold the row of ``(name, key)`` locked from a second connection for the block."""
    with transaction.atomic(using=SIDE):
        rows = RateLimit.objects.using(SIDE).select_for_update().filter(name=name, key=encode_key(key).digest)
        assert len(list(rows)) == 1
        yield


@pytest.fixture
def side():
    yield connections[SIDE]
    connections[SIDE].close()


# ---------------------------------------------------------------------------------------
# F1: connection dropped between SELECT ... FOR UPDATE and the UPDATE
# ---------------------------------------------------------------------------------------


def kill_connection_of(alias: str) -> None:
    """Make the server end ``alias``'s session, from a second connection; wait until it is gone."""
    with connections[alias].cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()" if settings.DB == "postgres" else "SELECT CONNECTION_ID()")
        session = cursor.fetchone()[0]
    if settings.DB == "postgres":
        kill = "SELECT pg_terminate_backend(%s)"
        alive = "SELECT count(*) FROM pg_stat_activity WHERE pid = %s"
    else:
        kill = "KILL %s"
        alive = "SELECT count(*) FROM information_schema.PROCESSLIST WHERE ID = %s"
    with connections[SIDE].cursor() as cursor:
        cursor.execute(kill, [session])
        deadline = time.monotonic() + 10
        while True:  # a condition, polled: the session must be gone before we go on
            cursor.execute(alive, [session])
            if cursor.fetchone()[0] == 0:
                return
            assert time.monotonic() < deadline, "the killed session did not go away"
            time.sleep(0.005)


@pytest.mark.only_on("postgres", "mariadb")
@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_f1_connection_killed_between_lock_and_write(side, monkeypatch, caplog, fail_open):
    with tokenbucket(FAIL_OPEN=fail_open, **PORTABLE), frozen_clock(T0):
        assert limiter.limit("f1", "k", count=4, config=CONFIG).value == 6
        before = stored("f1", "k")

        decide_all = database_module.decide_all
        kills = []

        def kill_then_decide(requests, states, now):
            # Every row is locked (SELECT ... FOR UPDATE ran); the UPDATE comes next.
            if not kills:
                kills.append(True)
                kill_connection_of("default")
            return decide_all(requests, states, now)

        monkeypatch.setattr(database_module, "decide_all", kill_then_decide)
        started = time.perf_counter()
        with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
            if fail_open:
                status = limiter.limit("f1", "k", config=CONFIG)
                assert status.ok and status.failed_open and status.value is None
            else:
                with pytest.raises(BackendUnavailable, match="'f1'") as failure:
                    limiter.limit("f1", "k", config=CONFIG)
                # Killed before its COMMIT: the server rolled back, nothing is ambiguous.
                assert failure.value.__cause__.ambiguous is False
        elapsed = time.perf_counter() - started
        monkeypatch.undo()

        assert kills == [True]
        assert stored("f1", "k") == before  # the transaction died with its session: nothing written
        [record] = warnings_of(caplog)
        message = record.getMessage()
        assert "'f1'" in message and encode_key("k").digest[:12] in message and "OperationalError" in message
        assert "database 'default'" in message
        # The same thread's next call opens a new connection and decides normally.
        recovered = time.perf_counter()
        assert limiter.limit("f1", "k", config=CONFIG).value == 5
        recovery = time.perf_counter() - recovered
    figure(
        f"F1 {settings.DB} {'fail-open' if fail_open else 'fail-closed'}: state delta 0, warnings 1, "
        f"decision in {elapsed * 1000:.0f} ms, next call (reconnect) {recovery * 1000:.0f} ms"
    )


@contextmanager
def persistent_connection(alias: str, *, health_checks: bool):
    """Keep ``alias``'s connection across requests (``CONN_MAX_AGE``), as a deployment would."""
    connection = connections[alias]
    saved = {name: connection.settings_dict[name] for name in ("CONN_MAX_AGE", "CONN_HEALTH_CHECKS")}
    connection.close()  # the next connection is opened under the new settings
    connection.settings_dict.update(CONN_MAX_AGE=600, CONN_HEALTH_CHECKS=health_checks)
    try:
        yield connection
    finally:
        connection.settings_dict.update(saved)
        connection.close()


@pytest.mark.only_on("postgres", "mariadb")
@pytest.mark.parametrize("health_checks", [True, False], ids=["health-checks", "no-health-checks"])
def test_f1_a_persistent_connection_dropped_between_requests(side, caplog, health_checks):
    """The server ends an idle persistent connection (a restart, a failover, an idle timeout).

    With ``CONN_HEALTH_CHECKS`` Django finds the dead connection at the next request and
    reconnects: nothing fails. Without, the first decision fails by the fail mode (one
    warning) and the limiter closes the connection, so the decision after it succeeds.
    """
    with persistent_connection("default", health_checks=health_checks) as connection:
        with tokenbucket(), frozen_clock(T0):
            assert limiter.limit("f1-idle", "k", config=CONFIG).value == 9
            kill_connection_of("default")
            # What Django's handler does between two requests (the test client skips it).
            close_old_connections()
            assert connection.connection is not None  # kept: CONN_MAX_AGE has not run out
            with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
                if health_checks:
                    assert limiter.limit("f1-idle", "k", config=CONFIG).value == 8
                    assert warnings_of(caplog) == []
                else:
                    with pytest.raises(BackendUnavailable, match="'f1-idle'"):
                        limiter.limit("f1-idle", "k", config=CONFIG)
                    [record] = warnings_of(caplog)
                    assert "database 'default'" in record.getMessage()
                    # No request boundary in between (a worker, a command): the limiter
                    # closed the dead connection itself. 8, not 7: the failure wrote nothing.
                    assert limiter.limit("f1-idle", "k", config=CONFIG).value == 8
    figure(
        f"F1-idle {settings.DB} CONN_MAX_AGE=600 CONN_HEALTH_CHECKS={health_checks}: "
        f"decisions failed after the server dropped the idle connection: {0 if health_checks else 1}, then 0"
    )


# ---------------------------------------------------------------------------------------
# F7 / F8: statement and lock timeouts
# ---------------------------------------------------------------------------------------

TIMEOUTS = {
    # (setting SQL, reset SQL, expected error code)
    ("postgres", "statement"): ("SET statement_timeout = '100ms'", "RESET statement_timeout", "57014"),
    ("postgres", "lock"): ("SET lock_timeout = '50ms'", "RESET lock_timeout", "55P03"),
    # Unlike innodb_lock_wait_timeout, max_statement_time takes fractions of a second and
    # also interrupts a statement waiting for a row lock.
    ("mariadb", "statement"): (
        "SET SESSION max_statement_time = 0.1",
        "SET SESSION max_statement_time = DEFAULT",
        "1969",
    ),
    ("mariadb", "lock"): (
        "SET SESSION innodb_lock_wait_timeout = 1",
        "SET SESSION innodb_lock_wait_timeout = DEFAULT",
        "1205",
    ),
}


@contextmanager
def session_setting(sql: str, reset: str):
    with connections["default"].cursor() as cursor:
        cursor.execute(sql)
    try:
        yield
    finally:
        with connections["default"].cursor() as cursor:
            cursor.execute(reset)


@pytest.mark.only_on("postgres", "mariadb")
@pytest.mark.parametrize("kind", [kind for db, kind in TIMEOUTS if db == settings.DB] or ["lock"])
def test_f7_f8_timeouts_fail_by_mode_without_retry_or_partial_write(side, kind):
    set_sql, reset_sql, code = TIMEOUTS[(settings.DB, kind)]
    with tokenbucket() as backend, frozen_clock(T0):
        limiter.limit("f8-b", "k", count=3, config=CONFIG)  # a row to hold locked
        before = stored("f8-b", "k")
        retried, gave_up = sum(backend.retried.values()), sum(backend.gave_up.values())
        # "f8-a" sorts first: its fresh row is INSERTed before the lock wait on "f8-b"
        # times out. MySQL's 1205 rolls back only that statement, so only the limiter
        # leaving atomic() by exception keeps the INSERT from being committed.
        requests = [LimitRequest("f8-a", "k", config=CONFIG), LimitRequest("f8-b", "k", config=CONFIG)]
        with row_locked_elsewhere("f8-b", "k"), session_setting(set_sql, reset_sql):
            started = time.perf_counter()
            with pytest.raises(BackendUnavailable) as excinfo:
                limiter.limit_many(requests)
            elapsed = time.perf_counter() - started
        assert error_code(excinfo.value.__cause__.__cause__) == code
        assert (sum(backend.retried.values()), sum(backend.gave_up.values())) == (retried, gave_up)
        assert stored("f8-a", "k") is None  # no partial write
        assert stored("f8-b", "k") == before
        # Once the lock is released, the same call goes through.
        assert limiter.limit_many(requests).ok
        assert stored("f8-b", "k")[0] == before[0] - MICRO
    figure(
        f"F7/F8 {settings.DB} {kind} timeout: SQLSTATE/errno {code}, retries 0, partial writes 0, failed after {elapsed * 1000:.0f} ms"
    )


@pytest.mark.only_on("postgres", "mariadb")
def test_f8_lock_timeout_inside_the_callers_transaction_leaves_it_usable(side):
    """A lock timeout inside ATOMIC_REQUESTS-style code: the savepoint is rolled back, the caller goes on.

    The database gave up on a lock: it is busy, not down, so even FAIL_OPEN refuses the
    call (issue 35, item 7: a flood's lock waits must not let it past the limit).
    """
    set_sql, reset_sql, _ = TIMEOUTS[(settings.DB, "lock")]
    with tokenbucket(FAIL_OPEN=True), frozen_clock(T0):
        limiter.limit("f8-b", "k", count=3, config=CONFIG)
        before = stored("f8-b", "k")
        with row_locked_elsewhere("f8-b", "k"), session_setting(set_sql, reset_sql):
            with transaction.atomic():
                # The caller's own write goes to another table: an insert into the rate-limit
                # table could wait on the gap lock (MariaDB, REPEATABLE READ) that the other
                # session's FOR UPDATE holds next to the locked row.
                get_user_model().objects.create(username="f8-caller")
                with pytest.raises(BackendUnavailable, match="the store is busy"):
                    limiter.limit("f8-b", "k", config=CONFIG)
                # The caller's own transaction still works and commits its writes.
                assert get_user_model().objects.filter(username="f8-caller").count() == 1
        assert get_user_model().objects.filter(username="f8-caller").count() == 1
        assert stored("f8-b", "k") == before


# ---------------------------------------------------------------------------------------
# F10: deterministic retries — the server raises 40001 / 1213 after the write
# ---------------------------------------------------------------------------------------

INJECT_SQL = {
    "postgres": "DO $$ BEGIN RAISE EXCEPTION 'injected serialization failure' USING ERRCODE = '40001'; END $$",
    "mariadb": "SIGNAL SQLSTATE '40001' SET MYSQL_ERRNO = 1213, MESSAGE_TEXT = 'injected deadlock'",
}
INJECTED_CODE = {"postgres": "40001", "mariadb": "1213"}


@pytest.fixture
def inject(monkeypatch):
    """``inject["left"] = n``: the next n decisions fail after their UPDATE, raised by the server."""
    state = {"left": 0, "raised": 0}
    consume = DatabaseBackend._consume

    def failing_after_the_write(self, alias, requests):
        outcome = consume(self, alias, requests)
        if state["left"] > 0:
            state["left"] -= 1
            state["raised"] += 1
            with connections[alias].cursor() as cursor:
                cursor.execute(INJECT_SQL[settings.DB])
        return outcome

    monkeypatch.setattr(DatabaseBackend, "_consume", failing_after_the_write)
    return state


@pytest.mark.only_on("postgres", "mariadb")
def test_f10_injected_retries_consume_exactly_one_token_per_admission(inject):
    code = INJECTED_CODE[settings.DB]
    config = {"rate": 100, "period": 3600}
    with tokenbucket(RETRY_BASE_DELAY=0.0001, RETRY_MAX_DELAY=0.001, **PORTABLE) as backend, frozen_clock(T0):
        retried_before = backend.retried[code]
        admitted = 0
        for _ in range(20):
            inject["left"] = 2  # the first two attempts of every decision fail
            status = limiter.limit("f10", "k", config=config)
            admitted += status.ok
        assert inject["raised"] == 40
        assert backend.retried[code] - retried_before == 40
        assert admitted == 20
        assert limiter.get_value("f10", "k", config=config) == 100 - admitted  # tokens consumed == admitted
    figure(
        f"F10 {settings.DB}: 40 injected {code} over 20 decisions, 3 attempts each, tokens consumed 20 == admitted 20"
    )


@pytest.mark.only_on("postgres", "mariadb")
def test_f10_retries_exhausted_apply_the_fail_mode_and_write_nothing(inject):
    code = INJECTED_CODE[settings.DB]
    config = {"rate": 100, "period": 3600}
    with tokenbucket(RETRY_ATTEMPTS=3, RETRY_BASE_DELAY=0.0001, RETRY_MAX_DELAY=0.001, **PORTABLE) as backend, frozen_clock(T0):
        limiter.limit("f10", "k", config=config)
        before = stored("f10", "k")
        gave_up = backend.gave_up[code]
        inject["left"] = 3
        with pytest.raises(BackendUnavailable) as failure:
            limiter.limit("f10", "k", config=config)
        assert backend.gave_up[code] == gave_up + 1
        # The server reported the error and rolled back: nothing can have been applied.
        assert failure.value.__cause__.ambiguous is False
        assert stored("f10", "k") == before
        with override_settings(TOKENBUCKET={**settings.TOKENBUCKET, "FAIL_OPEN": True, **PORTABLE}):
            inject["left"] = 3
            assert limiter.limit("f10", "k", config=config).failed_open
        assert stored("f10", "k") == before


# ---------------------------------------------------------------------------------------
# K4: the store's time is read once the row lock is granted
# ---------------------------------------------------------------------------------------

#: What the portable path reads (the control replaces it).
STORE_NOW_SQL = dict(database_module._NOW_SQL)
#: The negative control: the time the statement began (PostgreSQL's now() is even the
#: transaction's), read before the lock wait instead of after it.
STATEMENT_START_SQL = {
    "postgresql": "(EXTRACT(EPOCH FROM now()) * 1000000)::bigint",
    "mysql": "CAST(UNIX_TIMESTAMP(NOW(6)) * 1000000 AS SIGNED)",
}
LOCK_WAITERS_SQL = {
    "postgres": "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND datname = current_database()",
    "mariadb": "SELECT count(*) FROM information_schema.INNODB_TRX WHERE trx_state = 'LOCK WAIT'",
}


def wait_for_a_lock_waiter(waiter: threading.Thread, outcome: list[object]) -> None:
    """Poll, from a connection outside any transaction, until a session waits for a row lock."""
    deadline = time.monotonic() + 10
    with connections["default"].cursor() as cursor:
        while True:
            cursor.execute(LOCK_WAITERS_SQL[settings.DB])
            if cursor.fetchone()[0] > 0:
                return
            assert waiter.is_alive(), f"the decision ended without waiting for the row lock: {outcome}"
            assert time.monotonic() < deadline, "the decision never waited for the row lock"
            # InnoDB refreshes INNODB_TRX only when it was last read over 100 ms ago.
            time.sleep(0.15)


@pytest.mark.only_on("postgres", "mariadb")
@pytest.mark.parametrize("control", [False, True], ids=["after-the-lock", "statement-start-control"])
def test_k4_a_decision_that_waited_for_the_lock_reads_a_time_after_the_state(side, monkeypatch, control):
    """A second session holds the row, and commits a state stamped with the store's time
    while a decision waits for it. The decision's own time must not be older than that
    state; a time read when its statement began (the control) is."""
    if control:
        monkeypatch.setattr(database_module, "_NOW_SQL", STATEMENT_START_SQL)
    seen: list[tuple[int, int]] = []  # (decision time, stored ts) for each decision
    decide_all = database_module.decide_all

    def recording(requests, states, now):
        seen.extend((now, state.ts) for state in states.values() if state is not None)
        return decide_all(requests, states, now)

    monkeypatch.setattr(database_module, "decide_all", recording)
    outcome: list[object] = []

    def decide_in_another_thread():
        try:
            outcome.append(limiter.limit("k4", "k", config=CONFIG))
        except Exception as exc:  # reported by the assertion below, not lost in the thread
            outcome.append(exc)
        finally:
            connections.close_all()

    with tokenbucket(**PORTABLE):  # the store's clock, read by the locking statement
        limiter.limit("k4", "k", config=CONFIG)
        seen.clear()
        with transaction.atomic(using=SIDE):
            rows = RateLimit.objects.using(SIDE).select_for_update().filter(name="k4", key=encode_key("k").digest)
            assert len(list(rows)) == 1
            waiter = threading.Thread(target=decide_in_another_thread)
            waiter.start()
            wait_for_a_lock_waiter(waiter, outcome)
            time.sleep(0.02)  # the store's clock moves on while the decision waits
            # Another decision commits: its state is stamped with the store's time now.
            stamp = RawSQL(STORE_NOW_SQL[connections[SIDE].vendor], ())
            rows.update(ts=stamp)
        waiter.join(timeout=10)
    assert len(outcome) == 1 and not isinstance(outcome[0], Exception), outcome
    [(now, stored_ts)] = seen
    if control:
        assert now < stored_ts  # stale by the lock wait: what the shipped SQL avoids
    else:
        assert now >= stored_ts
    figure(f"K4 {settings.DB} {'statement start' if control else 'after the lock'}: decision time - stored ts = {(now - stored_ts) / 1000:.1f} ms")


# ---------------------------------------------------------------------------------------
# F11: an ambiguous commit (the commit succeeded, the client was told it failed)
# ---------------------------------------------------------------------------------------


class AmbiguousCommit(Exception):
    """What a driver reports when it cannot know whether COMMIT took effect."""

    def __init__(self, sqlstate):
        super().__init__(f"commit outcome unknown (SQLSTATE {sqlstate})")
        self.sqlstate = sqlstate


@pytest.mark.parametrize("sqlstate", ["40003", "08006"], ids=["statement-completion-unknown", "connection-failure"])
@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_f11_an_ambiguous_commit_is_never_rerun(monkeypatch, sqlstate, fail_open):
    from django.db import OperationalError

    connection = connections["default"]
    errors = []

    def count(sender, exception, ambiguous, **kwargs):
        errors.append((exception, ambiguous))

    with tokenbucket(FAIL_OPEN=fail_open, **PORTABLE) as backend, frozen_clock(T0):
        limiter.limit("f11", "k", config=CONFIG)
        before = stored("f11", "k")
        commit = connection._commit
        ambiguous = []

        def commit_then_fail():
            commit()  # the tokens are spent for good...
            if not ambiguous:
                ambiguous.append(True)
                # ...but the client hears an error, as after a lost COMMIT reply.
                raise OperationalError("commit outcome unknown") from AmbiguousCommit(sqlstate)

        monkeypatch.setattr(connection, "_commit", commit_then_fail)
        retried = sum(backend.retried.values())
        signals.rate_limit_backend_error.connect(count)
        try:
            if fail_open:
                assert limiter.limit("f11", "k", config=CONFIG).failed_open
            else:
                with pytest.raises(BackendUnavailable):
                    limiter.limit("f11", "k", config=CONFIG)
        finally:
            signals.rate_limit_backend_error.disconnect(count)
            monkeypatch.undo()
        assert ambiguous == [True] and len(errors) == 1  # counted, through the signal
        assert errors[0][1] is True  # and marked as maybe applied
        assert sum(backend.retried.values()) == retried  # not re-run
        value, _ts = stored("f11", "k")
        assert value == before[0] - MICRO  # consumed once: over-consumption <= ambiguous events (1)
    figure(
        f"F11 {settings.DB} {sqlstate} {'fail-open' if fail_open else 'fail-closed'}: ambiguous commits 1, re-runs 0, tokens consumed 1, backend_error signals 1"
    )


# ---------------------------------------------------------------------------------------
# F12: a worker killed (SIGKILL) while it holds the row lock
# ---------------------------------------------------------------------------------------


def _hold_the_lock_then_hang(queue, config):
    """Child: lock the row inside a decision, say so, and hang until killed."""
    decide_all = database_module.decide_all

    def hang(requests, states, now):
        queue.put("locked")
        time.sleep(120)  # never returns: the parent kills this process
        return decide_all(requests, states, now)

    database_module.decide_all = hang
    limiter.limit("f12", "k", config=config)


def test_f12_a_worker_killed_holding_the_lock_blocks_nobody():
    import multiprocessing
    import os
    import signal
    import warnings

    with tokenbucket(**PORTABLE), frozen_clock(T0):
        limiter.limit("f12", "k", count=2, config=CONFIG)
        before = stored("f12", "k")
        connections.close_all()  # the child opens its own connection
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            child = context.Process(target=_hold_the_lock_then_hang, args=(queue, CONFIG), daemon=True)
            child.start()
        try:
            assert queue.get(timeout=60) == "locked"
        finally:
            os.kill(child.pid, signal.SIGKILL)
            child.join(timeout=30)
        assert child.exitcode == -signal.SIGKILL
        started = time.perf_counter()
        status = limiter.limit("f12", "k", config=CONFIG)
        waited = time.perf_counter() - started
        assert status.ok and status.value == 7  # the killed worker's decision never committed
        assert stored("f12", "k")[0] == before[0] - MICRO
    figure(
        f"F12 {settings.DB}: worker SIGKILLed holding the row lock; next decision waited {waited * 1000:.0f} ms, then succeeded"
    )
