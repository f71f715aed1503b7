"""Settings that ``manage.py check`` must refuse (or warn about), for tests/test_checks.py.

``TOKENBUCKET_BROKEN`` picks what is wrong:

- ``limit`` (default): one entry of ``LIMITS`` is broken.
- ``sqlite_deferred``: the limits live on SQLite without IMMEDIATE transactions.
"""

import os

from tests.settings import *  # noqa: F403
from tests.settings import TOKENBUCKET as _BASE

BROKEN_LIMIT_NAME = "broken_signup_limit"

VARIANT = os.environ.get("TOKENBUCKET_BROKEN", "limit")

if VARIANT == "limit":
    TOKENBUCKET = {
        **_BASE,
        "LIMITS": {**_BASE["LIMITS"], BROKEN_LIMIT_NAME: {"kind": "token bucket", "rate": "10/M"}},
    }
elif VARIANT == "sqlite_deferred":
    DATABASES = {
        "default": {
            "ENGINE": "django.db.backends.sqlite3",
            "NAME": ":memory:",
        }
    }
    TOKENBUCKET = _BASE
else:
    raise RuntimeError(f"TOKENBUCKET_BROKEN must be 'limit' or 'sqlite_deferred', not {VARIANT!r}")
