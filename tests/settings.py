"""Settings for the test suite. ``TOKENBUCKET_TEST_DB`` picks the database:
``sqlite`` (default), ``postgres`` or ``mariadb``; the services' addresses can be
changed with ``PGHOST``/``PGPORT``/``PGUSER`` and ``MYSQL_HOST``/``MYSQL_PORT``/``MYSQL_USER``.
"""

import os
import socket
import tempfile
from pathlib import Path

SECRET_KEY = "tests-only"
USE_TZ = True
DEBUG = False
INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "django.contrib.messages",
    "rest_framework",
    # DRF's obtain_auth_token, one of the login paths of tests/test_login.py.
    "rest_framework.authtoken",
    "django_tokenbucket",
]
ROOT_URLCONF = "tests.urls"
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django_tokenbucket.middleware.RateLimitMiddleware",
]
# For the admin (tests/test_admin.py).
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ]
        },
    }
]
STATIC_URL = "/static/"
REST_FRAMEWORK = {
    "DEFAULT_THROTTLE_CLASSES": [
        "django_tokenbucket.throttling.AnonRateThrottle",
        "django_tokenbucket.throttling.UserRateThrottle",
    ],
    "DEFAULT_THROTTLE_RATES": {
        "anon": "3/m",
        "user": "5/m",
        "scarce": "1/m",
        "api_burst": "3/m",
        "api_sustained": "5/h",
        "tenant": "10/m",
    },
}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

DB = os.environ.get("TOKENBUCKET_TEST_DB", "sqlite")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


_SQLITE_DIR = Path(os.environ.get("TOKENBUCKET_TEST_TMP", tempfile.gettempdir()))

if DB == "postgres":
    from psycopg import IsolationLevel

    _pg = {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": os.environ.get("PGDATABASE", "test"),
        "USER": os.environ.get("PGUSER", "postgres"),
        "HOST": os.environ.get("PGHOST", "127.0.0.1"),
        "PORT": os.environ.get("PGPORT", "5432"),
    }
    DATABASES = {
        "default": _pg,
        # The same test database under SERIALIZABLE: PostgreSQL's stand-in for
        # distributed SQL, which raises 40001 the same way CockroachDB does.
        "serializable": {
            **_pg,
            # isolation_level applies to the transactions psycopg opens; a statement in
            # autocommit (the PostgreSQL fast path) takes the session's default.
            "OPTIONS": {
                "isolation_level": IsolationLevel.SERIALIZABLE,
                "options": "-c default_transaction_isolation=serializable",
            },
            "TEST": {"MIRROR": "default"},
        },
        # The same test database through a PgBouncer in transaction pooling mode, which
        # tests/test_pgbouncer.py starts on this port (one free when the settings load).
        "pgbouncer": {
            **_pg,
            "HOST": "127.0.0.1",
            "PORT": os.environ.get("TOKENBUCKET_PGBOUNCER_PORT") or str(_free_port()),
            "TEST": {"MIRROR": "default"},
        },
    }
elif DB == "mariadb":
    _maria = {
        "ENGINE": "django.db.backends.mysql",
        "NAME": os.environ.get("MYSQL_DATABASE", "test"),
        "USER": os.environ.get("MYSQL_USER", "root"),
        "PASSWORD": os.environ.get("MYSQL_PASSWORD", ""),
        "HOST": os.environ.get("MYSQL_HOST", "127.0.0.1"),
        "PORT": os.environ.get("MYSQL_PORT", "3306"),
        "OPTIONS": {"charset": "utf8mb4"},
        "TEST": {"CHARSET": "utf8mb4"},
    }
    DATABASES = {
        # Django runs MySQL/MariaDB at READ COMMITTED unless told otherwise...
        "default": _maria,
        # ...and InnoDB's own default, REPEATABLE READ, is what many deployments keep.
        "repeatable_read": {
            **_maria,
            "OPTIONS": {**_maria["OPTIONS"], "isolation_level": "repeatable read"},
            "TEST": {"MIRROR": "default"},
        },
    }
elif DB == "sqlite":
    # A file, not :memory:, so that several OS processes share it.
    _path = str(_SQLITE_DIR / f"tokenbucket-test-{os.getpid()}.sqlite3")
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": _path,
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 20, "init_command": "PRAGMA journal_mode=WAL;"},
            "TEST": {"NAME": _path},
        }
    }
    # The same file with Django's default DEFERRED transactions: H9's negative control.
    DATABASES["deferred"] = {
        **DATABASES["default"],
        "OPTIONS": {**DATABASES["default"]["OPTIONS"], "transaction_mode": "DEFERRED"},
        "TEST": {"MIRROR": "default"},
    }
else:
    raise RuntimeError(f"TOKENBUCKET_TEST_DB must be sqlite, postgres or mariadb, not {DB!r}")

# A database server that refuses every connection (nothing listens on port 1): store
# failures caused for real, not mocked. A test mirror, so no test database is made for it.
DATABASES["unreachable"] = {
    "ENGINE": "django.db.backends.postgresql",
    "NAME": "unreachable",
    "HOST": "127.0.0.1",
    "PORT": "1",
    "OPTIONS": {"connect_timeout": 2},
    "TEST": {"MIRROR": "default"},
}

if DB in ("postgres", "mariadb"):
    # The same test database through tests/faultproxy.py, for faults of the network and of
    # a stalled server (test_faults.py): the test starts a proxy and points HOST and PORT
    # at it. Until then it is the test database itself, reachable. connect_timeout is what bounds a decision against a server that accepts and never
    # answers (PostgreSQL's minimum is 2 s).
    DATABASES["proxied"] = {
        **DATABASES["default"],
        "OPTIONS": {**DATABASES["default"].get("OPTIONS", {}), "connect_timeout": 2},
        "TEST": {"MIRROR": "default"},
    }
    if DB == "mariadb":
        # A connection already open whose server stops answering: only a client-side read
        # timeout ends the wait (psycopg has none; see docs/reliability.md, F2).
        DATABASES["proxied"]["OPTIONS"].update(read_timeout=2, write_timeout=2)

DATABASE_ROUTERS = ["tests.routers.OnlyDefaultIsMigrated"]

TOKENBUCKET = {
    "LIMITS": {
        "ten_per_minute": {"kind": "token bucket", "rate": 10, "period": 60},
        "burst": {"kind": "token bucket", "rate": "10/m", "capacity": 20},
        "window": {"kind": "fixed window", "rate": 5, "period": 60, "start": 0},
        "reservable": {"kind": "token bucket", "rate": 10, "period": 10, "max_reserved": 20},
        # tests/celery_tasks.py's RateLimitedTask (20 a second, one global budget).
        "celery_tasks": {"kind": "token bucket", "rate": 20, "period": 1, "capacity": 5, "max_reserved": 1000},
        "login": "5/m",
        "login_ip": "3/m",  # the per-address half of a login limit (test_attacks_login_and_leaks.py)
        "signin": "5/m",  # a named limit with one view of its own (test_overrides_admin.py)
    },
}

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "loggers": {"django_tokenbucket": {"handlers": ["null"], "propagate": True}},
}

# Redis for the Redis backend's tests (tests/test_redis*.py and the "redis" param of the
# conformance suite): a dedicated database, and a key prefix per test process so that
# concurrent runs (tox envs, two developers on one machine) never touch each other's keys.
REDIS_HOST = os.environ.get("REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("REDIS_PORT", "6379"))
REDIS_DB = int(os.environ.get("TOKENBUCKET_REDIS_DB", "15"))
REDIS_KEY_PREFIX = f"tbtest-{os.getpid()}"
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
    "redis": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}",
        "KEY_PREFIX": REDIS_KEY_PREFIX,
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 10},
    },
    # The same Redis and keys with django-redis' defaults, no socket timeouts: what a project
    # that configures nothing has (the Redis backend then decides on a client of its own).
    # The URL is spelled apart from "redis"'s: django-redis keeps one pool per URL, and
    # would hand this cache that one, with its timeouts.
    "redis-bare": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://{REDIS_HOST}:{REDIS_PORT}?db={REDIS_DB}",
        "KEY_PREFIX": REDIS_KEY_PREFIX,
    },
}
