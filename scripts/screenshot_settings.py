"""Settings for scripts/admin_screenshot.py: the example project, logged in automatically.

Never use these anywhere else: every request is logged in as the superuser. Imported as
the top-level module ``screenshot_settings`` (admin_screenshot.py puts scripts/ on the path).
"""

import os
import time

from example_project.settings import *  # noqa: F403
from example_project.settings import MIDDLEWARE
from example_project.settings import TOKENBUCKET as EXAMPLE_TOKENBUCKET

DEBUG = True  # runserver serves the admin's static files
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": os.environ["SCREENSHOT_DB"],
        "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 5},
    }
}
MIDDLEWARE = [*MIDDLEWARE, "screenshot_settings.log_in_as_admin"]
TIME_ZONE = "Europe/Paris"
# The example's own limits (its views use them) and a few more kinds for the picture.
TOKENBUCKET = {
    **EXAMPLE_TOKENBUCKET,
    "LIMITS": {
        **EXAMPLE_TOKENBUCKET["LIMITS"],
        "login": {"kind": "token bucket", "rate": "5/m"},
        "send_message": {"kind": "token bucket", "rate": 10, "period": 60, "capacity": 20},
        "partner_api": {"kind": "fixed window", "rate": 100, "period": 60, "start": 0},
        "llm_tokens": {"kind": "token bucket", "rate": 40000, "period": 60, "max_reserved": 100000},
    },
}


def log_in_as_admin(get_response):  # type: ignore[no-untyped-def]
    def middleware(request):  # type: ignore[no-untyped-def]
        from django.contrib.auth import get_user_model, login

        if not request.user.is_authenticated:
            login(request, get_user_model().objects.get(username="admin"), "django.contrib.auth.backends.ModelBackend")
        return get_response(request)

    return middleware


def seed() -> None:
    """Keys in every state, written relative to the real clock (the page shows them live)."""
    from django.contrib.auth import get_user_model

    from django_tokenbucket.algorithms import MICRO
    from django_tokenbucket.keys import encode_key
    from django_tokenbucket.models import RateLimit

    get_user_model().objects.create_superuser("admin", "admin@example.com", "admin")
    now = time.time_ns() // 1000
    rows = [
        # name, key, tokens stored, seconds ago
        ("login", ("ip", "203.0.113.7"), 0, 2),
        ("login", "post:username=alice", 1, 30),
        ("login", ("ip", "2001:db8:85a3::/64"), 3, 5),
        ("login", "<script>alert(1)</script>", 2, 1),
        ("send_message", ("user", 42), 0.5, 1),
        ("send_message", ("user", 7), 12, 20),
        ("send_message", ("user", 1001), 20, 900),
        ("send_message", "tenant:acme-corporation/department:research-and-development/user:9", 6, 3),
        ("partner_api", ("tenant", "acme"), 37, 0),
        ("partner_api", ("tenant", "globex"), 100, 120),
        ("llm_tokens", ("tenant", "acme"), -25000, 1),
        ("llm_tokens", ("tenant", "initech"), 31000, 4),
        ("old_signup_limit", ("ip", "198.51.100.23"), 1, 3600),
    ]
    for name, key, tokens, ago in rows:
        encoded = encode_key(key)
        ts = now - ago * MICRO
        if name == "partner_api":
            ts -= ts % (60 * MICRO)  # fixed windows store the start of their window (start=0 here)
        RateLimit.objects.create(
            name=name, key=encoded.digest, label=encoded.label, value=round(tokens * MICRO), ts=ts
        )
