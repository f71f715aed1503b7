"""Login protection is exact across processes (issue 48, item 4): eight processes sending
wrong passwords for one account at once get no more passwords checked than the login
limit allows, on the env's database and on Redis. The negative control counts failures
once they are known, as django-axes does: its guesses in flight pass the check together.

Passwords are checked by ``tests.login_support.CountingHasher``, each check taking 20 ms
(a real hash takes longer, which only widens the window); each process reports the
checks it ran.
"""

from __future__ import annotations

import os
import time

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import aauthenticate, authenticate, get_user_model
from django.contrib.auth.signals import user_login_failed
from django.test import RequestFactory, override_settings

from django_tokenbucket import limiter, overrides
from django_tokenbucket.models import LimitOverride
from django_tokenbucket.testing import frozen_clock

from . import login_support
from .concurrency import FIGURES, run_processes, sized
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = [pytest.mark.concurrency, pytest.mark.django_db(transaction=True)]

PROCESSES = 8
ATTEMPTS = sized(6, 25)
CAPACITY = 5
LIMITS = {**BASE_SETTINGS["LIMITS"], "login_failures": {"rate": CAPACITY, "period": 3600}}
MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"


@pytest.fixture(params=["database", "redis"])
def store(request):
    if request.param == "redis":
        return request.getfixturevalue("redis_store")
    return {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend"}


@pytest.fixture(autouse=True)
def slow_hashes(monkeypatch):
    monkeypatch.setenv(login_support.DELAY_ENV, "0.02")


def guess(barrier, index: int, attempts: int, path: str, pace: float = 0.0) -> dict[str, int]:
    login_support.reset_counts()
    request = RequestFactory().post("/", REMOTE_ADDR=f"198.51.100.{index + 1}")
    check = authenticate if path == "sync" else async_to_sync(aauthenticate)
    barrier.wait()
    refused = 0
    for _ in range(attempts):
        refused += check(request, username="victim", password="wrong") is None
        time.sleep(pace)
    return {"checked": login_support.checked(), "pid": os.getpid(), "failed": refused}


def run(store, backends, login=True, path="sync", cooloff=None, deny_cache=True, pace=0.0):
    settings = {**BASE_SETTINGS, **store, "LIMITS": LIMITS}
    if not deny_cache:
        settings["DENY_CACHE"] = False
    if login:
        settings["LOGIN"] = {"LIMIT": "login_failures", "KEYS": ["username", "ip"], "COOLOFF": cooloff}
    with override_settings(
        TOKENBUCKET=settings, AUTHENTICATION_BACKENDS=backends, PASSWORD_HASHERS=login_support.HASHERS
    ):
        with frozen_clock(1_700_000_000):
            get_user_model().objects.create_user("victim", password="right")
            results = run_processes(guess, PROCESSES, ATTEMPTS, path, pace)
            left = limiter.get_value("login_failures", ("username", "victim"))
    assert len({r["pid"] for r in results}) == PROCESSES
    assert all(r["failed"] == ATTEMPTS for r in results)
    checked = sum(r["checked"] for r in results)
    FIGURES.append(
        {
            "case": "login",
            "path": path,
            "cooloff": cooloff,
            "backends": backends[0],
            "store": store["BACKEND"].rsplit(".", 1)[1],
            "checked": checked,
            "guesses": PROCESSES * ATTEMPTS,
            "limit": CAPACITY,
        }
    )
    return checked, left


@pytest.mark.parametrize("path", ["sync", "async"])
def test_eight_processes_never_get_more_passwords_checked_than_the_limit(store, path):
    checked, left = run(store, ["django_tokenbucket.auth.LoginBackend", MODEL_BACKEND], path=path)
    assert checked == CAPACITY  # of 8 x ATTEMPTS guesses
    assert left == 0


def test_with_a_cooloff_the_lockout_holds_in_every_process_at_once(store):
    """The lockout fills the bucket for its end as soon as its block is written: the
    processes that have not read the block find the bucket full, and must find the block
    before checking a password. Without the deny cache, which would hide the full bucket
    from a process that saw the key denied within the last second, and with 50 ms between
    a process' guesses, so that guesses keep coming once the lockout has begun."""
    overrides.invalidate()
    backends = ["django_tokenbucket.auth.LoginBackend", MODEL_BACKEND]
    checked, left = run(store, backends, cooloff=3600, deny_cache=False, pace=0.05)
    assert checked == CAPACITY
    assert left == CAPACITY  # full, for when the block ends
    assert LimitOverride.objects.filter(action="block").count() == 1


def test_control_without_protection_every_guess_is_checked(store):
    checked, _left = run(store, [MODEL_BACKEND], login=False)
    assert checked == PROCESSES * ATTEMPTS


def test_control_counting_failures_once_known_lets_guesses_in_flight_past_the_limit(store):
    user_login_failed.connect(login_support.count_failure)
    try:
        checked, left = run(store, ["tests.login_support.CheckThenCountBackend", MODEL_BACKEND], login=False)
    finally:
        user_login_failed.disconnect(login_support.count_failure)
    assert left == 0
    assert checked > CAPACITY  # every process' first guess passes the check before any failure is counted
