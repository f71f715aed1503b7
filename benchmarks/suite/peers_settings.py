"""Settings of ``benchmarks/suite/peers.py``: its own PostgreSQL database and its own Redis database.

The database ``tokenbucket_bench`` is created (dropped first if a crashed run left it)
and dropped by the benchmark; Redis database 14 holds only keys under the ``tbbench``
prefixes, which the benchmark deletes before and after. The test suite's databases
(``test``/``test_test`` on PostgreSQL, Redis database 15) are never touched.
"""

import os

SECRET_KEY = "benchmarks-only"
USE_TZ = True
DEBUG = False  # with DEBUG, Django would keep every query in memory
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    "django_tokenbucket",
    "benchmarks.suite.textbook",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

PG_HOST = os.environ.get("PGHOST", "127.0.0.1")
PG_PORT = os.environ.get("PGPORT", "5432")
PG_USER = os.environ.get("PGUSER", "postgres")
PG_DATABASE = "tokenbucket_bench"
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.postgresql",
        "NAME": PG_DATABASE,
        "USER": PG_USER,
        "HOST": PG_HOST,
        "PORT": PG_PORT,
        # Persistent connections, as a production site would have (CONN_MAX_AGE applies
        # to request cycles; the benchmark's processes keep theirs for the whole run).
        "CONN_MAX_AGE": None,
    }
}
REDIS_HOST = os.environ.get("REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("REDIS_PORT", "6379"))
REDIS_DB = int(os.environ.get("TOKENBUCKET_BENCH_REDIS_DB", "14"))
if REDIS_DB == 15:
    raise RuntimeError("Redis database 15 belongs to the test suite: pick another TOKENBUCKET_BENCH_REDIS_DB")
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/{REDIS_DB}"
#: Every key the benchmark writes starts with this (django-redis' KEY_PREFIX, and the
#: ``limits`` library's key prefix with ``-limits``), so cleaning up never touches others.
REDIS_PREFIX = "tbbench"
CACHES = {
    # The default cache: our Redis backend, django-ratelimit and DRF's throttles all use it.
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": REDIS_PREFIX,
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 10},
    },
}

#: The limits every adapter is given, by name: ``(count, period in seconds)``.
#: ``bench``: 100 per second, burst 100 (what the timed phases use);
#: ``sanity``: 5 per hour (5 sequential calls allowed, the 6th denied);
#: ``memory``: 100 per hour (keys that stay while Redis' memory is measured).
SPECS = {"bench": (100, 1), "sanity": (5, 3600), "memory": (100, 3600)}

#: Our configurations, each measured in a process of its own (``TOKENBUCKET`` is process-wide):
#: the worker's ``TOKENBUCKET_BENCH_CONFIG`` names its backend and options. The peers'
#: process and the coordinator get the default, which none of their adapters uses.
BENCH_CONFIGS = {
    "db": ("django_tokenbucket.backends.database.DatabaseBackend", {}),
    "db-portable": ("django_tokenbucket.backends.database.DatabaseBackend", {"FAST_PATH": False}),
    "db-async-commit": ("django_tokenbucket.backends.database.DatabaseBackend", {"ASYNC_COMMIT": True}),
    "db-sharded": ("django_tokenbucket.backends.database.DatabaseBackend", {}),
    "db-sharded-portable": ("django_tokenbucket.backends.database.DatabaseBackend", {"FAST_PATH": False}),
    "redis": ("django_tokenbucket.backends.redis.RedisBackend", {"CACHE": "default"}),
}
BENCH_CONFIG = os.environ.get("TOKENBUCKET_BENCH_CONFIG", "peers")
_backend, _options = BENCH_CONFIGS.get(BENCH_CONFIG, BENCH_CONFIGS["db"])

TOKENBUCKET = {
    "BACKEND": _backend,
    "OPTIONS": _options,
    # What these runs compare is the store path, against peers that have no memory of
    # denials: with the deny cache, a hot key's denials would never reach the store.
    # make bench-flood measures the cache (benchmarks/suite/flood.py).
    "DENY_CACHE": False,
    "LIMITS": {
        name: {"kind": "token bucket", "rate": count, "period": period} for name, (count, period) in SPECS.items()
    },
}
# django-ratelimit: checks would otherwise warn about a cache it cannot tell is shared.
SILENCED_SYSTEM_CHECKS = ["django_ratelimit.E003", "django_ratelimit.W001"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    "loggers": {"django_tokenbucket": {"handlers": ["null"], "propagate": False}},
}
