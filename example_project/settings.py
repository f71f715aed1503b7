"""Settings of the example project: SQLite and a folder-based Celery broker, no server needed.

``DATABASE_URL`` (``postgres://user@host:port/name`` or ``mysql://user@host:port/name``)
puts the data on PostgreSQL or MariaDB instead; ``REDIS_URL`` (``redis://host:port/db``)
keeps the rate-limit state in Redis (through a django-redis cache) and uses Redis as
the Celery broker.
"""

import os
from pathlib import Path
from urllib.parse import urlparse

BASE_DIR = Path(__file__).resolve().parent
VAR_DIR = Path(os.environ.get("EXAMPLE_VAR_DIR", BASE_DIR / "var"))
VAR_DIR.mkdir(parents=True, exist_ok=True)

SECRET_KEY = os.environ.get("DJANGO_SECRET_KEY", "example-project-not-for-production")
DEBUG = os.environ.get("DJANGO_DEBUG", "1") == "1"
ALLOWED_HOSTS = ["127.0.0.1", "localhost"]

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "django_tokenbucket",
    "example_project.demo",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    # RateLimit headers on the DRF throttles' responses, no-store on every 429.
    "django_tokenbucket.middleware.RateLimitMiddleware",
]

ROOT_URLCONF = "example_project.urls"
TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [],
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
WSGI_APPLICATION = "example_project.wsgi.application"
LOGIN_URL = "login"


def _database_from_url(url: str) -> dict:
    parsed = urlparse(url)
    engine = {
        "postgres": "django.db.backends.postgresql",
        "postgresql": "django.db.backends.postgresql",
        "mysql": "django.db.backends.mysql",
    }[parsed.scheme]
    return {
        "ENGINE": engine,
        "NAME": parsed.path.lstrip("/"),
        "USER": parsed.username or "",
        "PASSWORD": parsed.password or "",
        "HOST": parsed.hostname or "",
        "PORT": str(parsed.port or ""),
    }


if os.environ.get("DATABASE_URL"):
    DATABASES = {"default": _database_from_url(os.environ["DATABASE_URL"])}
else:
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": VAR_DIR / "example.sqlite3",
            # IMMEDIATE: take SQLite's write lock when the transaction starts, so two
            # requests never read the same bucket and then collide on the write.
            "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 5},
        }
    }

DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"
USE_TZ = True
TIME_ZONE = "UTC"
STATIC_URL = "static/"

TOKENBUCKET = {
    "LIMITS": {
        # Failed logins (login protection, LOGIN below): 5 per username and 5 per
        # address, then one more every 12 s.
        "login_failures": {"rate": 5, "period": 60},
        # A partner API that bills per call (the async currency converter): 10 calls
        # per client per minute, in fixed windows.
        "partner_api": {"kind": "fixed window", "rate": 10, "period": 60},
        # The LLM budget of the summariser: 6,000 tokens a minute per user, and at most
        # 30,000 reserved ahead, so a flood of jobs is refused instead of queued for hours.
        "llm_tokens": {"rate": 6000, "period": 60, "max_reserved": 30000},
        # The playground's limits (one bucket per visitor address).
        "playground_bucket": {"rate": "1/s", "capacity": 5},
        "playground_slow": {"rate": 10, "period": 60, "capacity": 10},
        "playground_window": {"kind": "fixed window", "rate": 5, "period": 10},
        "playground_reserve": {"rate": "1/s", "capacity": 5, "max_reserved": 5},
    },
    "FAIL_OPEN": False,
    # The IETF RateLimit-Policy / RateLimit headers, to show them off.
    "HEADERS": True,
    # A friendly HTML page for browsers (JSON clients still get JSON).
    "RESPONSE": "example_project.demo.views.too_many_requests",
    # Who is being limited: the admin's limits pages chart allowed and denied calls per
    # minute and list the most denied keys. Each process writes its counts every 2 s
    # (10 s is the default; a demo wants to see its clicks at once).
    "ANALYTICS": {"FLUSH": 2},
    # Login protection (docs/login.md): every authenticate() (the demo's /login/, the
    # admin's login) takes a token per username and per address before the password is
    # checked, and gives it back if the password was right. A key whose 5 failures are
    # spent is locked out: 30 s, then 2 min, then 10 min for each further lockout within
    # the hour. scripts/demo exempts 127.0.0.1, so that trying it locks usernames, never
    # you out of the admin.
    "LOGIN": {
        "LIMIT": "login_failures",
        "KEYS": ["username", "ip"],
        "COOLOFF": "example_project.demo.views.lockout_seconds",
        "LOCKOUT_MEMORY": 3600,
        "RESPONSE": "example_project.demo.views.locked_out",
    },
}

AUTHENTICATION_BACKENDS = [
    "django_tokenbucket.auth.LoginBackend",
    "django.contrib.auth.backends.ModelBackend",
]

REST_FRAMEWORK = {
    # Decided together, all-or-nothing: a request denied by the burst scope spends no
    # token of the sustained one.
    "DEFAULT_THROTTLE_CLASSES": [
        "example_project.demo.throttles.BurstRateThrottle",
        "example_project.demo.throttles.SustainedRateThrottle",
    ],
    "DEFAULT_THROTTLE_RATES": {"burst": "5/10s", "sustained": "100/h"},
}

# Celery (example_project/celery.py reads every CELERY_* setting).
BROKER_DIR = VAR_DIR / "broker"
CELERY_TIMEZONE = "UTC"
CELERY_TASK_IGNORE_RESULT = True
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_BEAT_SCHEDULE = {
    # Publishes reservations whose message was lost or whose ETA was too far away for
    # the broker (docs/celery.md): the folder broker loses the messages a killed worker held.
    "tokenbucket-sweep": {"task": "django_tokenbucket.sweep_reservations", "schedule": 30.0},
    "tokenbucket-cleanup": {"task": "django_tokenbucket.cleanup", "schedule": 300.0},
}

if os.environ.get("REDIS_URL"):
    CACHES = {"default": {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": os.environ["REDIS_URL"]}}
    TOKENBUCKET["BACKEND"] = "django_tokenbucket.backends.redis.RedisBackend"
    CELERY_BROKER_URL = os.environ["REDIS_URL"]
else:
    # Messages are files in a folder: a broker that needs no server, for one machine.
    CELERY_BROKER_URL = "filesystem://"
    CELERY_BROKER_TRANSPORT_OPTIONS = {
        "data_folder_in": str(BROKER_DIR / "queue"),
        "data_folder_out": str(BROKER_DIR / "queue"),
        "control_folder": str(BROKER_DIR / "control"),
        "polling_interval": 0.2,
    }
    for folder in ("queue", "control"):
        (BROKER_DIR / folder).mkdir(parents=True, exist_ok=True)
