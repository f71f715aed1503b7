"""Settings of ``benchmarks/suite/flood.py``: one configuration per process, named by
``TOKENBUCKET_FLOOD_CONFIG``.

``TOKENBUCKET`` is process-wide, so each configuration (a backend with the deny cache on
or off, and item 7's fail-open one) runs in processes of its own, which read their
configuration here. The PostgreSQL database ``tokenbucket_bench_flood`` holds the limiter's
rows and nothing else, so that ``pg_stat_database`` counts this run's limiter
transactions only; the table the ninth process reads lives in
``tokenbucket_bench_flood_probe`` for the same reason. Redis is a private redis-server
that flood.py starts (its port in ``TOKENBUCKET_FLOOD_REDIS_PORT``), so that its INFO
counts nobody else's commands; the keys are under ``tbflood`` all the same.
"""

import os

from benchmarks.suite import peers_settings as base

SECRET_KEY = "benchmarks-only"
USE_TZ = True
DEBUG = False  # with DEBUG, Django would keep every query in memory
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "rest_framework",
    # DRF's obtain_auth_token: the login view of the login phase (flood_login.py).
    "rest_framework.authtoken",
    "django_tokenbucket",
]
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

PG_HOST, PG_PORT, PG_USER = base.PG_HOST, base.PG_PORT, base.PG_USER
# Another name when two runs share a server (they drop and create their databases).
PG_DATABASE = os.environ.get("TOKENBUCKET_FLOOD_DATABASE", "tokenbucket_bench_flood")
PROBE_DATABASE = f"{PG_DATABASE}_probe"
DATABASES = {"default": {**base.DATABASES["default"], "NAME": PG_DATABASE}}

REDIS_PORT = int(os.environ.get("TOKENBUCKET_FLOOD_REDIS_PORT", "6379"))
REDIS_PREFIX = "tbflood"
CACHES = {
    "default": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": f"redis://127.0.0.1:{REDIS_PORT}/0",
        "KEY_PREFIX": REDIS_PREFIX,
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 10},
    },
}

ROOT_URLCONF = "benchmarks.suite.flood_views"
ALLOWED_HOSTS = ["testserver"]  # what RequestFactory's environ names
# The same small stack as http_settings', without django-ratelimit's middleware.
MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.common.CommonMiddleware",
]
REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": [],
    "DEFAULT_PERMISSION_CLASSES": [],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_THROTTLE_CLASSES": [],
    # The throttled DRF view: one request an hour per address, so that every later one is denied.
    "DEFAULT_THROTTLE_RATES": {"anon": "1/h"},
}

#: What issue 35 names: the deny cache's defaults, written out so the run says what it used.
DENY_CACHE = {"MAX_AGE": 1.0, "MAX_KEYS": 100_000}
DATABASE = "django_tokenbucket.backends.database.DatabaseBackend"
REDIS = "django_tokenbucket.backends.redis.RedisBackend"
#: configuration → (backend, OPTIONS, deny cache on, FAIL_OPEN)
CONFIGS = {
    "db-on": (DATABASE, {}, True, False),
    "db-off": (DATABASE, {}, False, False),
    "redis-on": (REDIS, {"CACHE": "default"}, True, False),
    "redis-off": (REDIS, {"CACHE": "default"}, False, False),
    # Item 7: a contended key under FAIL_OPEN and a 20 ms deadline on the database.
    "failopen-on": (DATABASE, {"TIMEOUT": 0.02}, True, True),
    "failopen-off": (DATABASE, {"TIMEOUT": 0.02}, False, True),
    # Issue 48: logins refused by login protection, next to unprotected ones (flood_login.py).
    "login-db": (DATABASE, {}, True, False),
    "login-redis": (REDIS, {"CACHE": "default"}, True, False),
}
CONFIG = os.environ.get("TOKENBUCKET_FLOOD_CONFIG", "db-on")
_backend, _options, _cached, _fail_open = CONFIGS[CONFIG]

#: The flood's limits: (a) one key of 100 + 10/s; (b) rotating keys of 1 per hour, which a
#: single admitted call exhausts and which stay exhausted for the whole run.
FLOOD_LIMIT = {"rate": 10, "period": 1, "capacity": 100}
TOKENBUCKET = {
    "BACKEND": _backend,
    "OPTIONS": _options,
    "FAIL_OPEN": _fail_open,
    "DENY_CACHE": dict(DENY_CACHE) if _cached else False,
    "LIMITS": {
        "flood": FLOOD_LIMIT,
        "rotating": {"rate": 1, "period": 3600, "capacity": 1},
        # Issue 48: the failed logins a key may have (five, then one every three minutes).
        "login_failures": "5/15m",
    },
    "LOGIN": {"LIMIT": "login_failures", "KEYS": ["username", "ip"]},
}

# Login protection, and Django's default password hasher counting its hashes. Only the
# login phase authenticates; its processes also answer a refused JSON login 429.
AUTHENTICATION_BACKENDS = ["django_tokenbucket.auth.LoginBackend", "django.contrib.auth.backends.ModelBackend"]
PASSWORD_HASHERS = ["benchmarks.suite.flood_login.CountingPBKDF2PasswordHasher"]
if CONFIG.startswith("login-"):
    MIDDLEWARE = [*MIDDLEWARE, "django_tokenbucket.middleware.RateLimitMiddleware"]

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "handlers": {"null": {"class": "logging.NullHandler"}},
    # Failing open logs a warning per call: millions of lines, and no figure.
    "loggers": {"django_tokenbucket": {"handlers": ["null"], "propagate": False}},
}
