"""Django with tests/settings.py on a throwaway database, for cleanup.py and admin_changelist.py.

``TOKENBUCKET_TEST_DB`` picks the database (sqlite, postgres, mariadb) as for the test
suite. The probe gets its own test database (``tokenbucket_bench``), created and
destroyed around the run, so it never touches real data or a concurrent test run. They
time what they measure with timing.py, as every probe does.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ.setdefault("TOKENBUCKET_TEST_TMP", tempfile.gettempdir())

import django  # noqa: E402

django.setup()

from django.conf import settings  # noqa: E402
from django.db import connections  # noqa: E402
from django.test.utils import setup_databases, setup_test_environment, teardown_databases  # noqa: E402

from django_tokenbucket.algorithms import MICRO  # noqa: E402
from django_tokenbucket.keys import encode_key  # noqa: E402
from django_tokenbucket.limits import FIXED_WINDOW  # noqa: E402
from django_tokenbucket.live import cleanup_span  # noqa: E402
from django_tokenbucket.models import RateLimit  # noqa: E402
from django_tokenbucket.registry import known_limits  # noqa: E402

__all__ = ["DB", "bench_database", "load_rows", "table_size"]

DB = settings.DB


@contextmanager
def bench_database() -> Iterator[None]:
    """Create a fresh, migrated database for the run; destroy it afterwards."""
    default = settings.DATABASES["default"]
    if DB == "sqlite":
        path = Path(tempfile.gettempdir()) / f"tokenbucket-bench-{os.getpid()}.sqlite3"
        default.setdefault("TEST", {})["NAME"] = str(path)
    else:
        default.setdefault("TEST", {})["NAME"] = "tokenbucket_bench"
    setup_test_environment()
    old = setup_databases(verbosity=0, interactive=False, aliases={"default"}, serialized_aliases=set())
    try:
        yield
    finally:
        connections.close_all()
        teardown_databases(old, verbosity=0)


def load_rows(
    count: int, *, now: int, first: int = 0, idle_share: float = 0.5, seed: int = 1, unknown_share: float = 0.01
) -> None:
    """Insert ``count`` rows (keys ``("user", first..)``) across the configured limits, ``idle_share`` full now."""
    rng = random.Random(seed + first)
    limits = [known.config for known in known_limits().values() if known.source == "settings"]
    batch: list[RateLimit] = []
    for i in range(first, first + count):
        limit = None
        if rng.random() < unknown_share:
            name, span, capacity = "retired_limit", 60 * MICRO, 10 * MICRO
        else:
            limit = limits[i % len(limits)]
            name, span, capacity = limit.name, cleanup_span(limit), limit.capacity
        encoded = encode_key(("user", i))
        if rng.random() < idle_share:
            value, ts = capacity, now - span - rng.randrange(10 * span)
        else:
            value, ts = rng.randrange(capacity), now - rng.randrange(span)
        if limit is not None and limit.kind == FIXED_WINDOW:
            # Fixed windows store the start of a window, on the key's phase.
            ts -= (ts - limit.window_offset(encoded.digest)) % limit.period
        batch.append(RateLimit(name=name, key=encoded.digest, label=encoded.label, value=value, ts=ts))
        if len(batch) == 5000:
            RateLimit.objects.bulk_create(batch)
            batch = []
    if batch:
        RateLimit.objects.bulk_create(batch)
    if DB == "postgres":
        with connections["default"].cursor() as cursor:
            cursor.execute("ANALYZE django_tokenbucket_ratelimit")
    elif DB == "mariadb":
        with connections["default"].cursor() as cursor:
            cursor.execute("ANALYZE TABLE django_tokenbucket_ratelimit")
            cursor.fetchall()


def table_size() -> float | None:
    """Return the table's size with its indexes, in MB."""
    with connections["default"].cursor() as cursor:
        if DB == "postgres":
            cursor.execute("SELECT pg_total_relation_size('django_tokenbucket_ratelimit')")
            return round(cursor.fetchone()[0] / 2**20, 1)
        if DB == "mariadb":
            cursor.execute(
                "SELECT data_length + index_length FROM information_schema.tables "
                "WHERE table_schema = DATABASE() AND table_name = 'django_tokenbucket_ratelimit'"
            )
            return round(cursor.fetchone()[0] / 2**20, 1)
        cursor.execute("SELECT SUM(pgsize) FROM dbstat WHERE name LIKE '%ratelimit%'")
        row = cursor.fetchone()
        return None if row is None or row[0] is None else round(row[0] / 2**20, 1)
