"""Settings for the upstream suites (DRF's test_throttling.py, django-ratelimit's tests.py).

As close to each project's own test settings as our app allows: DRF's defaults for
REST_FRAMEWORK, django-ratelimit's cache aliases. The caches that must fail are
django-redis caches on a closed port (django-ratelimit uses a memcached host that does
not resolve; a Redis cache is one our Redis backend can decide on, and fail with).
"""

import os
import tempfile

SECRET_KEY = "upstream-tests-only"
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
INSTALLED_APPS = [
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "rest_framework",
    "django_tokenbucket",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
ROOT_URLCONF = "upstream_urls"
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.path.join(tempfile.gettempdir(), "tokenbucket-upstream.sqlite3"),
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 5},
        "TEST": {"NAME": os.path.join(tempfile.gettempdir(), "tokenbucket-upstream-test.sqlite3")},
    }
}
_CLOSED_PORT = "redis://127.0.0.1:1/0"
CACHES = {
    "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache", "LOCATION": "ratelimit-tests"},
    "connection-errors": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": _CLOSED_PORT,
        "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 1},
    },
    "connection-errors-redis": {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": _CLOSED_PORT,
        "OPTIONS": {"IGNORE_EXCEPTIONS": True, "SOCKET_CONNECT_TIMEOUT": 1, "SOCKET_TIMEOUT": 1},
    },
    "instant-expiration": {"BACKEND": "django.core.cache.backends.dummy.DummyCache", "LOCATION": "x"},
}
RATELIMIT_USE_CACHE = "default"
# No TOKENBUCKET setting: the suites run at the defaults, the deny cache on, as a
# project migrated by docs/migrating.md does. Their tests start afresh (TestCase's
# rollback, cache.clear()), which memory must never contradict (issue 46).
