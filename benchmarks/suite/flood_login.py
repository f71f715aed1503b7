"""The login phase of ``benchmarks/suite/flood.py`` (issue 48, item 4): what a login that
login protection refuses costs, next to the same login unprotected.

A counting PBKDF2 hasher (Django's default, with its default iterations) says how many
password hashes each login ran; the store's operations are counted on its server by the
coordinator around each measurement. Two paths: ``authenticate()`` called directly, and
a POST to DRF's ``obtain_auth_token`` through Django's WSGIHandler (with
``RateLimitMiddleware``, which answers a refused JSON login 429).
"""

from __future__ import annotations

import json
import statistics
import time
from typing import Any

from django.contrib.auth.hashers import PBKDF2PasswordHasher

#: Hashes this process has run: a password checked (``verify``), or one hashed for an
#: unknown username (``encode`` outside ``verify``).
HASHES = {"count": 0}
_inside_verify = {"depth": 0}

USERNAME, PASSWORD = "victim", "the-right-password"
PROTECTED = ["django_tokenbucket.auth.LoginBackend", "django.contrib.auth.backends.ModelBackend"]
UNPROTECTED = ["django.contrib.auth.backends.ModelBackend"]


class CountingPBKDF2PasswordHasher(PBKDF2PasswordHasher):
    """Django's default hasher, counting what it runs."""

    def verify(self, password: str, encoded: str) -> bool:
        HASHES["count"] += 1
        _inside_verify["depth"] += 1
        try:
            return super().verify(password, encoded)
        finally:
            _inside_verify["depth"] -= 1

    def encode(self, password: str, salt: str, iterations: int | None = None) -> str:
        if not _inside_verify["depth"]:
            HASHES["count"] += 1
        return super().encode(password, salt, iterations)


def prepare() -> dict[str, Any]:
    """Create the account and lock it out: wrong passwords until one is refused unchecked."""
    from django.contrib.auth import authenticate, get_user_model
    from django.test import RequestFactory

    user, _ = get_user_model().objects.get_or_create(username=USERNAME)
    user.set_password(PASSWORD)
    user.save()
    request = RequestFactory().post("/", REMOTE_ADDR="203.0.113.7")
    failures = 0
    while True:
        before = HASHES["count"]
        authenticate(request, username=USERNAME, password="wrong")
        if HASHES["count"] == before:
            break
        failures += 1
    return {"failures_checked": failures}


def measure(path: str, protected: bool, attempts: int) -> dict[str, Any]:
    """Time ``attempts`` wrong-password logins of the locked account, one path, with or without protection."""
    from django.contrib.auth import authenticate
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import RequestFactory, override_settings

    factory = RequestFactory()
    handler = WSGIHandler()
    body = json.dumps({"username": USERNAME, "password": "wrong"})
    statuses: set[int] = set()
    request = factory.post("/", REMOTE_ADDR="203.0.113.7")

    def direct() -> None:
        authenticate(request, username=USERNAME, password="wrong")

    def view() -> None:
        environ = factory.post(
            "/login/token/", body, content_type="application/json", HTTP_ACCEPT="application/json",
            REMOTE_ADDR="203.0.113.7",
        ).environ  # fmt: skip
        response = handler(environ, lambda status, headers, exc_info=None: None)
        try:
            statuses.add(response.status_code)
            b"".join(response)
        finally:
            response.close()

    call = direct if path == "direct" else view
    samples = []
    with override_settings(AUTHENTICATION_BACKENDS=PROTECTED if protected else UNPROTECTED):
        call()  # one first, outside the figures: imports, connections
        HASHES["count"] = 0
        for _ in range(attempts):
            began = time.perf_counter_ns()
            call()
            samples.append((time.perf_counter_ns() - began) / 1000)
    return {
        "attempts": attempts,
        "p50_us": round(statistics.median(samples), 1),
        "mean_us": round(statistics.fmean(samples), 1),
        "hashes_per_attempt": HASHES["count"] / attempts,
        "statuses": sorted(statuses),
    }
