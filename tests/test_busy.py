"""A busy store is not a down one (issue 35, item 7).

Under a flood, a database that is up gives up on a lock (PostgreSQL's ``lock_timeout``,
MariaDB's ``lock_wait_timeout``, SQLite's busy timeout) or misses TIMEOUT while it keeps
answering. ``FAIL_OPEN`` lets a store that is down through; a busy one it refuses, or the
flood's own timeouts would let it past the limit. The locks here are real: a second
connection holds the table while the limiter decides. (Missing TIMEOUT after a recent
answer is in tests/test_faults.py and tests/test_redis_deadline.py.)
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from django.db import connection, connections
from django.test import override_settings

from django_tokenbucket import BackendUnavailable, limiter, signals
from django_tokenbucket.models import RateLimit

from .settings import TOKENBUCKET as BASE_SETTINGS

CONFIG = {"rate": 10, "period": 60}
TABLE = RateLimit._meta.db_table


@contextmanager
def table_locked_elsewhere() -> Iterator[None]:
    """Hold the limiter's table in a second connection, and make this connection's lock
    waits short, as a site's database settings would (restored on the way out)."""
    vendor = connection.vendor
    if vendor == "sqlite":
        other: Any = sqlite3.connect(connection.settings_dict["NAME"], isolation_level=None)
        other.execute("BEGIN EXCLUSIVE")
        with connection.cursor() as cursor:
            cursor.execute("PRAGMA busy_timeout")
            (saved,) = cursor.fetchone()
            cursor.execute("PRAGMA busy_timeout = 100")
        try:
            yield
        finally:
            other.rollback()
            other.close()
            with connection.cursor() as cursor:
                cursor.execute(f"PRAGMA busy_timeout = {int(saved)}")
        return
    other = connections.create_connection("default")
    try:
        if vendor == "postgresql":
            other.set_autocommit(False)
            other.cursor().execute(f"LOCK TABLE {TABLE} IN ACCESS EXCLUSIVE MODE")
            wait, restore = "SET lock_timeout = '100ms'", "RESET lock_timeout"
        else:
            other.cursor().execute(f"LOCK TABLES {TABLE} WRITE")
            wait, restore = "SET SESSION lock_wait_timeout = 1", "SET SESSION lock_wait_timeout = DEFAULT"
        with connection.cursor() as cursor:
            cursor.execute(wait)
        try:
            yield
        finally:
            with connection.cursor() as cursor:
                cursor.execute(restore)
    finally:
        if vendor == "postgresql":
            other.rollback()
        else:
            other.cursor().execute("UNLOCK TABLES")
        other.close()


@pytest.mark.django_db(transaction=True)
def test_a_lock_the_database_gave_up_on_is_refused_even_under_fail_open():
    signalled: list[dict[str, Any]] = []

    def record(sender: Any, **kwargs: Any) -> None:
        signalled.append(kwargs)

    signals.rate_limit_backend_error.connect(record)
    try:
        with override_settings(TOKENBUCKET={**BASE_SETTINGS, "FAIL_OPEN": True, "DENY_CACHE": False}):
            with table_locked_elsewhere():
                with pytest.raises(BackendUnavailable, match=r"rate limit 'busy': the store is busy"):
                    limiter.limit("busy", "k", config=CONFIG)
            # The lock is gone: the same call decides, and nothing was spent before.
            assert limiter.limit("busy", "k", config=CONFIG).value == 9
    finally:
        signals.rate_limit_backend_error.disconnect(record)
    assert [(s["names"], s["fail_open"], s["exception"].busy) for s in signalled] == [(["busy"], False, True)]


@pytest.mark.django_db(transaction=True)
def test_a_database_that_fails_otherwise_is_still_let_through_under_fail_open():
    """The negative control: an error that says nothing of contention (a missing table
    here, as a database restored without the migration would say) still fails open."""
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "FAIL_OPEN": True, "DENY_CACHE": False}):
        with connection.cursor() as cursor:
            cursor.execute(f"ALTER TABLE {TABLE} RENAME TO {TABLE}_away")
        try:
            status = limiter.limit("busy", "k", config=CONFIG)
        finally:
            with connection.cursor() as cursor:
                cursor.execute(f"ALTER TABLE {TABLE}_away RENAME TO {TABLE}")
    assert status.ok and status.failed_open

