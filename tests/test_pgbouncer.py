"""The PostgreSQL fast path behind a real PgBouncer in transaction pooling mode.

PgBouncer (Debian's 1.18 here) hands each transaction to whichever server connection is
free and keeps no protocol-level prepared statements for its clients: a statement one
client prepared is missing on the next server, or present under the same name for a
client that never prepared it. The fast path must find that out by itself (its
``PREPARE`` option defaults to "auto") and send its statement unprepared.

The tests start their own pgbouncer on the port of the ``pgbouncer`` database alias
(tests/settings.py), with one server connection, so that every client shares it and a
name prepared by one is seen by all. Without the pgbouncer binary they skip, saying how
to install it; with CI=true that is a failure.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from django_tokenbucket import BackendUnavailable, limiter
from django_tokenbucket.backends.database import postgresql
from django_tokenbucket.backends.database.postgresql import READ_STATEMENT_MARK, SINGLE_STATEMENT_MARK
from django_tokenbucket.testing import frozen_clock

from .concurrency import in_another_thread
from .conftest import pgbouncer_binary
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = [
    pytest.mark.only_on("postgres"),
    pytest.mark.pgbouncer,
    pytest.mark.django_db(transaction=True, databases=["default", "pgbouncer"]),
]

ALIAS = "pgbouncer"
CONFIG = {"rate": 10, "period": 3600}


@pytest.fixture(scope="module")
def pgbouncer() -> Iterator[None]:
    """Run pgbouncer in transaction mode on the alias's port, one server connection in its pool."""
    binary = pgbouncer_binary()
    assert binary is not None  # conftest skips (or fails, in CI) without it
    target = settings.DATABASES["default"]
    directory = Path(tempfile.mkdtemp(prefix="tokenbucket-pgbouncer-"))
    user = target.get("USER") or "postgres"
    (directory / "users.txt").write_text(f'"{user}" ""\n')
    (directory / "pgbouncer.ini").write_text(
        f"""[databases]
* = host={target["HOST"]} port={target["PORT"]}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {settings.DATABASES[ALIAS]["PORT"]}
unix_socket_dir =
auth_type = trust
auth_file = {directory / "users.txt"}
pool_mode = transaction
default_pool_size = 1
max_client_conn = 50
ignore_startup_parameters = extra_float_digits,options
logfile = {directory / "pgbouncer.log"}
"""
    )
    command = [binary, str(directory / "pgbouncer.ini")]
    if os.geteuid() == 0:  # pgbouncer refuses to run as root
        account = _unprivileged_user()
        for path in (directory, *directory.iterdir()):
            os.chown(path, account.pw_uid, account.pw_gid)
        command[1:1] = ["-u", account.pw_name]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        _wait_for_port(int(settings.DATABASES[ALIAS]["PORT"]), process, directory)
        yield
    finally:
        connections[ALIAS].close()
        process.terminate()
        process.communicate(timeout=10)
        shutil.rmtree(directory, ignore_errors=True)


def _unprivileged_user() -> pwd.struct_passwd:
    for name in ("postgres", "nobody"):
        try:
            return pwd.getpwnam(name)
        except KeyError:
            continue
    raise RuntimeError("pgbouncer will not run as root, and there is no postgres or nobody user to run it as")


def _wait_for_port(port: int, process: subprocess.Popen[bytes], directory: Path) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log = (directory / "pgbouncer.log").read_text() if (directory / "pgbouncer.log").exists() else ""
            output = process.stdout.read().decode() if process.stdout else ""
            raise RuntimeError(f"pgbouncer exited with {process.returncode}: {output}{log}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"pgbouncer did not listen on port {port} within 10 s")


@contextmanager
def through_pgbouncer(**options: object) -> Iterator[None]:
    """Decide through the pooler, at a pinned time (which the SQL takes as a parameter)."""
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "OPTIONS": {"DATABASE": ALIAS, **options}}):
        with frozen_clock(1_700_000_000.0):
            yield


def test_the_fast_path_finds_the_pooler_and_sends_its_statement_unprepared(pgbouncer):
    """Two clients take turns on one limit through the same server connection: every
    decision is the single statement, none prepared, and the counts are exact."""
    with through_pgbouncer():
        values = []
        with CaptureQueriesContext(connections[ALIAS]) as queries:
            for _ in range(6):
                values.append(limiter.limit("bounced", "k", config=CONFIG).value)
                values.append(in_another_thread(lambda: limiter.limit("bounced", "k", config=CONFIG).value))
            values.append(limiter.limit("bounced", "k", config=CONFIG).value)  # seen denied: read first
        assert values == [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 0, 0, 0]
        assert postgresql.prepares_on(connections[ALIAS]) is False
        sent = [q["sql"] for q in queries]
        assert not any(sql.startswith(("PREPARE", "EXECUTE")) for sql in sent)
        # The single statement while tokens last, a read for the key this process saw denied.
        marks = [
            "single" if SINGLE_STATEMENT_MARK in sql else "read" if READ_STATEMENT_MARK in sql else sql for sql in sent
        ]
        assert marks[:5] == ["single"] * 5 and marks[-1] == "read" and set(marks) == {"single", "read"}
        # The client was told of a process that is not the one serving it.
        with connections[ALIAS].cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            assert cursor.fetchone()[0] != connections[ALIAS].connection.info.backend_pid


def test_prepared_statements_forced_through_the_pooler_collide(pgbouncer):
    """The negative control: with ``PREPARE`` True, the second client's PREPARE finds the
    first client's statement on the shared server connection. (Had the pool two server
    connections, an EXECUTE could instead find none, or another client's.)"""
    with through_pgbouncer(PREPARE=True):
        for _ in range(2):  # sent, then prepared on the server connection
            assert limiter.limit("forced", "k", config=CONFIG).ok

        def second_client() -> None:
            for _ in range(2):
                limiter.limit("forced", "k", config=CONFIG)

        with pytest.raises(BackendUnavailable, match="already exists"):
            in_another_thread(second_client)
    # Leave the shared server connection as the other tests expect it.
    with connections[ALIAS].cursor() as cursor:
        cursor.execute("DEALLOCATE ALL")


def test_the_general_function_decides_through_the_pooler_too(pgbouncer):
    from django_tokenbucket import LimitRequest

    with through_pgbouncer():
        both = [LimitRequest("bounced_a", "k", config=CONFIG), LimitRequest("bounced_b", "k", config=CONFIG, count=3)]
        assert [status.value for status in limiter.limit_many(both)] == [9, 7]
        assert [status.value for status in in_another_thread(lambda: limiter.limit_many(both))] == [8, 4]
