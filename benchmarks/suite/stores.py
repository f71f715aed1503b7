"""The benchmarks' PostgreSQL database and Redis keys: made before a run, removed after it.

The database (``settings.PG_DATABASE``) is dropped if a crashed run left it, created,
migrated, and given the baselines' objects below; Redis keeps only keys under
``settings.REDIS_PREFIX``, which are deleted before and after.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

#: The floor of a durable write: one row per id, ``UPDATE ... SET n = n + 1`` in autocommit.
COUNTER_TABLE = """
CREATE TABLE bench_counter (id int PRIMARY KEY, n bigint NOT NULL DEFAULT 0);
INSERT INTO bench_counter (id) SELECT generate_series(0, 999);
"""

#: A token bucket as a blog post would write it in PL/pgSQL: one function that locks the
#: key's row, refills it by the database clock, takes a token if there is one, and saves.
#: Written for this benchmark; no part of django-tokenbucket.
PLAIN_FUNCTION = """
CREATE TABLE bench_bucket (
    key text PRIMARY KEY,
    tokens double precision NOT NULL,
    updated_at timestamptz NOT NULL
);

CREATE FUNCTION bench_take_token(p_key text, p_capacity double precision, p_per_second double precision)
RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    v_tokens double precision;
    v_updated_at timestamptz;
    v_now timestamptz;
    v_allowed boolean;
BEGIN
    SELECT tokens, updated_at INTO v_tokens, v_updated_at FROM bench_bucket WHERE key = p_key FOR UPDATE;
    IF NOT FOUND THEN
        -- A new key starts full, less this call's token.
        INSERT INTO bench_bucket (key, tokens, updated_at)
        VALUES (p_key, p_capacity - 1, clock_timestamp())
        ON CONFLICT (key) DO NOTHING;
        IF FOUND THEN
            RETURN true;
        END IF;
        -- Another session created it meanwhile: wait for its lock like everyone else.
        SELECT tokens, updated_at INTO v_tokens, v_updated_at FROM bench_bucket WHERE key = p_key FOR UPDATE;
    END IF;
    -- Read the clock once the row is locked, so that time never runs backwards for a key.
    v_now := clock_timestamp();
    v_tokens := least(p_capacity, v_tokens + extract(epoch FROM v_now - v_updated_at) * p_per_second);
    v_allowed := v_tokens >= 1;
    IF v_allowed THEN
        v_tokens := v_tokens - 1;
    END IF;
    UPDATE bench_bucket SET tokens = v_tokens, updated_at = v_now WHERE key = p_key;
    RETURN v_allowed;
END
$$;
"""


def admin_connection() -> Any:
    import psycopg
    from django.conf import settings

    return psycopg.connect(
        host=settings.PG_HOST, port=settings.PG_PORT, user=settings.PG_USER, dbname="postgres", autocommit=True
    )


def redis_client() -> Any:
    from django_redis import get_redis_connection

    return get_redis_connection("default")


def clear_redis() -> None:
    from django.conf import settings

    client = redis_client()
    for key in client.scan_iter(match=f"{settings.REDIS_PREFIX}*", count=1000):
        client.delete(key)


@contextmanager
def bench_stores() -> Iterator[None]:
    """Create and migrate the benchmark's database and clear its Redis keys; undo both afterwards."""
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connections

    with admin_connection() as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {settings.PG_DATABASE} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {settings.PG_DATABASE}")
    clear_redis()
    try:
        call_command("migrate", run_syncdb=True, verbosity=0)
        with connections["default"].cursor() as cursor:
            cursor.execute(COUNTER_TABLE)
            cursor.execute(PLAIN_FUNCTION)
        connections.close_all()
        yield
    finally:
        connections.close_all()
        clear_redis()
        with admin_connection() as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {settings.PG_DATABASE} WITH (FORCE)")


def _git(*args: str) -> str | None:
    import subprocess
    from pathlib import Path

    try:
        out = subprocess.run(
            ["git", *args], cwd=Path(__file__).resolve().parent, capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def _memory_gib() -> float | None:
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemTotal:"):
                    return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine() -> dict[str, Any]:
    """The run's date, machine, versions, server settings and git commit."""
    import os
    import platform
    from datetime import UTC, datetime
    from importlib.metadata import PackageNotFoundError, version

    import django
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        postgres = cursor.fetchone()[0]
        server = {}
        for name in ("synchronous_commit", "fsync", "shared_buffers", "wal_level"):
            cursor.execute(f"SHOW {name}")
            server[name] = cursor.fetchone()[0]
    info = redis_client().info("server")
    packages: dict[str, str | None] = {}
    for package in ("django-redis", "redis", "hiredis", "djangorestframework", "django-ratelimit", "limits", "psycopg"):
        try:
            packages[package] = version(package)
        except PackageNotFoundError:
            packages[package] = None
    try:
        from psycopg import pq

        packages["psycopg implementation"] = pq.__impl__
    except ImportError:
        pass
    commit = _git("rev-parse", "--short=12", "HEAD")
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "cpu": _cpu_model(),
        "memory_gib": _memory_gib(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "django": django.get_version(),
        "postgresql": postgres.split()[0],
        "postgresql_settings": server,
        "redis": info.get("redis_version"),
        "packages": packages,
        "commit": commit,
        # Uncommitted changes to tracked files: the figures are not the commit's alone.
        "dirty": bool(dirty),
    }
