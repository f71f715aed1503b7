"""Operators and login lockouts: ``manage.py tokenbucket unlock``, and a lockout as the
command's ``overrides`` and ``top`` show it (issue 48, items 2 and 3)."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.auth import authenticate, get_user_model
from django.core.management import CommandError, call_command
from django.test import RequestFactory, override_settings

from django_tokenbucket import analytics, overrides
from django_tokenbucket.auth import unlock
from django_tokenbucket.testing import frozen_clock

from . import login_support
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True)

LIMITS = {**BASE_SETTINGS["LIMITS"], "login_failures": {"rate": 3, "period": 3600}}
LOGIN = {"LIMIT": "login_failures", "KEYS": ["username", "ip"], "COOLOFF": 600}
rf = RequestFactory()


@pytest.fixture
def protected(request):
    store = {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend"}
    overrides.invalidate()
    with override_settings(
        TOKENBUCKET={**BASE_SETTINGS, **store, "LIMITS": LIMITS, "LOGIN": LOGIN, "ANALYTICS": {"FLUSH": 10}},
        AUTHENTICATION_BACKENDS=["django_tokenbucket.auth.LoginBackend", "django.contrib.auth.backends.ModelBackend"],
        PASSWORD_HASHERS=login_support.HASHERS,
    ):
        with frozen_clock(1_700_000_000):
            get_user_model().objects.create_user("victim", password="right")
            yield
    overrides.invalidate()


def run(*args: str) -> str:
    out = StringIO()
    call_command("tokenbucket", *args, stdout=out, stderr=out)
    return out.getvalue()


def login(password="right", address="203.0.113.7"):
    return authenticate(rf.post("/", REMOTE_ADDR=address), username="victim", password=password)


def lock_out_victim():
    for n in range(3):
        login("wrong", f"198.51.100.{n}")
    assert login() is None


def test_unlock_by_username_ends_the_lockout(protected):
    lock_out_victim()
    output = run("unlock", "--username", " VICTIM ")
    assert (
        output.splitlines()[0] == "Unlocked login_failures key username=victim: removed its block, filled its bucket."
    )
    assert "Not reached: the KEYS entry ip needs --ip too." in output
    assert login() is not None


def test_unlock_by_address(protected):
    for name in ("a", "b", "c"):
        authenticate(rf.post("/", REMOTE_ADDR="203.0.113.9"), username=name, password="x")
    assert login(address="203.0.113.9") is None
    output = run("unlock", "--ip", "203.0.113.9")
    assert "Unlocked login_failures key ip=203.0.113.9: removed its block" in output
    assert login(address="203.0.113.9") is not None


def test_unlock_says_what_is_wrong(protected):
    with pytest.raises(CommandError, match="give --username, --ip, or both"):
        run("unlock")
    with pytest.raises(CommandError, match=r"'999\.1\.1\.1' is not an IP address"):
        run("unlock", "--ip", "999.1.1.1")
    with pytest.raises(CommandError, match="an empty username"):
        run("unlock", "--username", "  ")


def test_a_lockout_shows_in_overrides_and_top(protected):
    lock_out_victim()
    for _ in range(4):
        login()
    analytics.flush()
    listed = run("overrides", "login_failures")
    assert "username=… (value not stored)" in listed and "block" in listed and "login protection" in listed
    top = run("top", "login_failures")
    assert "username=… (value not stored)" in top
    assert "victim" not in listed + top


def test_the_admin_ends_a_lockout_with_expire_now(protected, admin_client):
    lock_out_victim()
    from django_tokenbucket.models import LimitOverride

    (row,) = LimitOverride.objects.filter(action="block", created_by="login protection")
    response = admin_client.post(
        "/admin/django_tokenbucket/limitoverride/", {"action": "expire_now", "_selected_action": [row.pk]}
    )
    assert response.status_code == 302
    assert login() is not None  # the bucket was filled for the lockout's end


def test_a_lockout_shows_in_the_admin(protected, admin_client):
    """With COOLOFF, in the overrides list; without, as the key's limited bucket."""
    lock_out_victim()
    blocks = admin_client.get("/admin/django_tokenbucket/limitoverride/").content.decode()
    assert "username=… (value not stored)" in blocks and "Locked out by login protection" in blocks
    unlock(username="victim")
    with override_settings(
        TOKENBUCKET={**BASE_SETTINGS, "LIMITS": LIMITS, "LOGIN": {**LOGIN, "COOLOFF": None}},
    ):
        lock_out_victim()
        page = admin_client.get("/admin/django_tokenbucket/ratelimit/?name=login_failures&state=limited")
    text = page.content.decode()
    assert "username=… (value not stored)" in text and "victim" not in text
