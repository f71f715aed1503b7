"""Fixtures shared by the suite, and the rule for services that are not running.

On a developer's machine a missing database server skips the tests that need it,
with a message saying how to run them. In CI (``CI=true``) it is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
from typing import Any

import pytest
from django.conf import settings

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")

_SERVICES = {
    "postgres": ("PostgreSQL", os.environ.get("PGHOST", "127.0.0.1"), int(os.environ.get("PGPORT", "5432"))),
    "mariadb": ("MariaDB", os.environ.get("MYSQL_HOST", "127.0.0.1"), int(os.environ.get("MYSQL_PORT", "3306"))),
}


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "only_on(*databases): the test concerns these databases only (sqlite, postgres, "
        "mariadb); the tox envs of the others deselect it",
    )
    config.addinivalue_line(
        "markers", "pgbouncer: starts its own pgbouncer process (needs the pgbouncer binary: apt-get install pgbouncer)"
    )
    config.addinivalue_line("markers", "redis: uses the Redis server of tests/settings.py (REDIS_HOST/REDIS_PORT)")
    config.addinivalue_line(
        "markers", "redis_processes: starts its own redis-server processes (needs redis-server, redis-cli)"
    )
    config.addinivalue_line(
        "markers",
        "default_deadline: the Redis backend's calls keep their default deadline (0.2 s); elsewhere a test "
        "without a TIMEOUT of its own runs the same code with a deadline of 5 s (see _test_deadline)",
    )


#: Modules whose tests, those that cannot reach a database (no ``django_db`` mark, no
#: database fixture: pytest-django refuses them any query), depend on no database: the
#: pure algorithms, parsers and key encoding, and the Redis backend's own suites. A
#: module that looks at which database runs (``settings.DB``, ``connection.vendor``,
#: its settings), such as test_checks.py, is not here.
DB_INDEPENDENT_MODULES = frozenset(
    {
        "test_algorithms",
        "test_breaker",
        "test_catalogue",
        "test_config",
        "test_fast_path",
        "test_ip",
        "test_keys",
        "test_lifecycle",
        "test_override_operations",
        "test_ports",
        "test_properties",
        "test_rates",
        "test_redis",
        "test_redis_asyncio",
        "test_redis_deadline",
        "test_shards",
        "test_test_map",
    }
)

#: Modules whose cases run on both stores (a ``backend``, ``store`` or ``async_backend``
#: parameter): their Redis cases depend on no database (in test_concurrency.py and
#: test_faults.py: processes on Redis, or Redis behind the fault proxy). What the
#: database does for them, the overrides' one-row version read (and, in
#: test_overrides*.py, the override rows written through ``limiter.override``), is the
#: same ORM code the database cases of the same test run on every database. Not here:
#: the modules of the admin, the commands and operations (test_admin.py,
#: test_overrides_admin.py, test_command.py, test_overrides_command.py,
#: test_operations.py: users, sessions, the admin's tables) and test_celery*.py (the
#: reservations are rows whatever the store), test_decorators.py (its Redis cases log a
#: user in). A case that logs in (``admin_client``...) is never marked, nor one marked
#: ``every_database``: a Redis case that still uses the database for what it checks.
REDIS_CASES_MODULES = frozenset(
    {
        "test_acquire",
        "test_analytics",
        "test_analytics_store",
        "test_attacks_keys",
        "test_attacks_login_and_leaks",
        "test_attacks_request_data",
        "test_compat_ratelimit",
        "test_concurrency",
        "test_conformance",
        "test_deny_cache",
        "test_faults",
        "test_metrics",
        "test_overrides",
        "test_overrides_integrations",
        "test_plans",
        "test_refund",
    }
)

_STORE_PARAMETERS = ("backend", "store", "async_backend", "ops_store")
_DATABASE_FIXTURES = frozenset({"db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback"})
_USER_FIXTURES = frozenset({"admin_client", "admin_user", "django_user_model", "django_username_field"})


def _db_independent(item: pytest.Item) -> bool:
    """Whether ``item``'s outcome does not depend on the database it runs on (see the
    ``db_independent`` marker): the rule is in DB_INDEPENDENT_MODULES and
    REDIS_CASES_MODULES."""
    module = getattr(getattr(item, "module", None), "__name__", "").rpartition(".")[2]
    fixtures = set(getattr(item, "fixturenames", ()))
    if fixtures & _USER_FIXTURES or item.get_closest_marker("every_database") is not None:
        return False
    if module in DB_INDEPENDENT_MODULES:
        return item.get_closest_marker("django_db") is None and not fixtures & _DATABASE_FIXTURES
    if module in REDIS_CASES_MODULES:
        params = getattr(getattr(item, "callspec", None), "params", {})
        return any(str(params.get(name, "")).startswith("redis") for name in _STORE_PARAMETERS)
    return False


# tryfirst: the marks must be on the items before ``-m`` selects them.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _db_independent(item):
            item.add_marker(pytest.mark.db_independent)
    db = settings.DB
    # Tests about one database's behaviour run in that database's env, and are not
    # collected (rather than skipped) elsewhere: every collected test runs.
    kept, deselected = [], []
    for item in items:
        # Every only_on applies (a parameter's narrows its test's).
        allowed = all(db in marker.args for marker in item.iter_markers("only_on"))
        (kept if allowed else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = kept
    _require_redis(config, items)
    _require_pgbouncer(items)
    if db not in _SERVICES:
        return
    label, host, port = _SERVICES[db]
    if _reachable(host, port):
        return
    message = (
        f"{label} is not reachable at {host}:{port}; start it (see README, 'Running the tests') "
        f"or run the SQLite envs only: tox -m sqlite"
    )
    if IN_CI:
        raise pytest.UsageError(f"CI=true and {message}")
    for item in items:
        item.add_marker(pytest.mark.skip(reason=message))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    from .concurrency import FIGURES

    if FIGURES:
        terminalreporter.section("concurrency figures")
        for figures in FIGURES:
            terminalreporter.line(json.dumps(figures, sort_keys=True))


def pgbouncer_binary() -> str | None:
    """Return the pgbouncer executable (Debian installs it in /usr/sbin), or None."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")


def _require_pgbouncer(items: list[pytest.Item]) -> None:
    """Skip (or, in CI, refuse to run) the PgBouncer tests when pgbouncer is not installed."""
    if pgbouncer_binary() is not None:
        return
    problem = "pgbouncer not found: install it (apt-get install pgbouncer) to run the tests through PgBouncer"
    for item in items:
        if item.get_closest_marker("pgbouncer") is None:
            continue
        if IN_CI:
            raise pytest.UsageError(f"CI=true and {problem}")
        item.add_marker(pytest.mark.skip(reason=problem))


def _redis_problem(item: pytest.Item, unreachable: str | None, missing: str | None) -> str | None:
    callspec = getattr(item, "callspec", None)
    uses_server = item.get_closest_marker("redis") is not None or (
        callspec is not None and str(callspec.params.get("backend", "")).startswith("redis")
    )
    if uses_server and unreachable:
        return unreachable
    if item.get_closest_marker("redis_processes") is not None and missing:
        return missing
    return None


def _require_redis(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip (or, in CI, refuse to run) the Redis tests whose server or binaries are missing."""
    unreachable = None
    if not _reachable(settings.REDIS_HOST, settings.REDIS_PORT):
        unreachable = (
            f"Redis is not reachable at {settings.REDIS_HOST}:{settings.REDIS_PORT}; start it "
            f"(redis-server --port {settings.REDIS_PORT} --save '' --appendonly no) or set REDIS_HOST/REDIS_PORT"
        )
    absent = [binary for binary in ("redis-server", "redis-cli") if shutil.which(binary) is None]
    missing = f"{' and '.join(absent)} not found on PATH: install Redis 7 to run these tests" if absent else None
    for item in items:
        problem = _redis_problem(item, unreachable, missing)
        if problem is None:
            continue
        if IN_CI:
            raise pytest.UsageError(f"CI=true and {problem}")
        item.add_marker(pytest.mark.skip(reason=problem))


@pytest.fixture(autouse=True)
def _forget_denials():
    """Start each test with an empty deny cache: a test's stores are wiped behind the
    limiter's back (a rolled-back transaction, deleted Redis keys), and a pinned clock
    makes a denial of the previous test look fresh."""
    from django_tokenbucket import deny_cache  # after Django is set up: it imports settings

    deny_cache.clear()
    yield


@pytest.fixture(autouse=True)
def _discard_analytics():
    """Start each test with no unflushed analytics counts: they would be written to the
    store of a test that has ended (its Redis keys deleted, its transaction rolled back)."""
    from django_tokenbucket import analytics  # after Django is set up: it imports settings

    analytics.discard()
    yield
    analytics.discard()


@pytest.fixture(autouse=True)
def _test_deadline(request, monkeypatch):
    """The Redis backend's default deadline at 5 s, unless the test is marked ``default_deadline``.

    Every Redis call is bounded by default (0.2 s: backends/redis/bounded.py). On this
    suite's loaded 2-core machines a healthy call, such as the async twins' first on a
    fresh event loop and connection under ``async_to_sync``, can now and then be kept
    from running that long, and would fail as a store failure. The tests whose subject
    is something else keep the same code path (the deadline, the breaker, the backend's
    own client) at a value no case comes near; those about the default deadline and what
    it bounds (tests/test_redis_deadline.py, tests/test_redis_crash.py) keep its value.
    """
    if request.node.get_closest_marker("default_deadline") is None:
        try:
            from django_tokenbucket.backends.redis import bounded
        except ImportError:  # no django-redis: no Redis backend either
            pass
        else:
            monkeypatch.setattr(bounded, "DEFAULT_TIMEOUT", 5.0)
    yield


@pytest.fixture
def without_deny_cache(monkeypatch):
    """Every call goes to the store, as in a process that has not seen the key denied
    (``DENY_CACHE`` off): for the cases of what a store does with a key denied lately.
    Switched off here rather than with ``override_settings``, which would build the
    test's backend again."""
    from django_tokenbucket import deny_cache  # after Django is set up: it imports settings

    monkeypatch.setattr(deny_cache, "active", lambda: None)


@pytest.fixture
def redis_store():
    """TOKENBUCKET overrides for the Redis backend on the ``redis`` cache; deletes this run's keys around the test."""
    from .redis_servers import delete_keys

    delete_keys()
    yield {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis"}}
    delete_keys()


#: Beside the test settings' limits, for the admin's and the command's cases on every
#: backend: a sharded limit, and one whose name the Redis backend hashes (it is not made
#: of [A-Za-z0-9_.-]).
OPS_LIMITS = {"hot": {"rate": "40/m", "shards": 4}, "odd name/ü": "5/m"}


@pytest.fixture(params=["database", "redis"])
def ops_store(request):
    """The default backend for the admin's and the command's shared cases: the database or
    Redis (test_redis_cluster.py overrides it with a cluster)."""
    from django.test import override_settings

    from .settings import TOKENBUCKET as BASE_SETTINGS

    overrides = {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend"}
    if request.param == "redis":
        overrides = request.getfixturevalue("redis_store")
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **overrides}):
        yield request.param


@pytest.fixture
def ops(ops_store):
    """OPS_LIMITS added to the store's settings, at a pinned time."""
    from django.test import override_settings

    from django_tokenbucket.testing import frozen_clock

    current = settings.TOKENBUCKET
    with override_settings(TOKENBUCKET={**current, "LIMITS": {**current["LIMITS"], **OPS_LIMITS}}):
        with frozen_clock(1_700_000_000.0) as clock:
            yield clock
