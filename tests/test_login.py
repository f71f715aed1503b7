"""Login protection on Django's own authentication (issue 48), on the database and on Redis.

Every login path is protected with no decorator on it: a direct ``authenticate()``
(with a request and without), ``aauthenticate()``, the admin's login, Django's
``LoginView``, DRF's ``obtain_auth_token`` and a project's own JSON login. Passwords
are checked by ``tests.login_support.CountingHasher``, which counts every hash it runs:
a refused login must run none.
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta

import pytest
from asgiref.sync import async_to_sync
from django.contrib.auth import BACKEND_SESSION_KEY, aauthenticate, authenticate, get_user_model
from django.contrib.auth.signals import user_login_failed
from django.test import Client, RequestFactory, override_settings

from django_tokenbucket import limiter, overrides
from django_tokenbucket.auth import is_locked, unlock
from django_tokenbucket.keys import Redacted
from django_tokenbucket.models import LimitOverride, RateLimit
from django_tokenbucket.overrides import snapshot as override_snapshot
from django_tokenbucket.signals import login_locked_out
from django_tokenbucket.testing import frozen_clock

from . import login_support
from .login_support import checked
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.urls("tests.login_support")

T0 = 1_700_000_000.0
BACKEND = "django_tokenbucket.auth.LoginBackend"
MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"
#: Three failures, then one more every 20 minutes.
LIMITS = {**BASE_SETTINGS["LIMITS"], "login_failures": {"rate": 3, "period": 3600}}
STORES = {
    "database": {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend"},
    "redis": None,
}
rf = RequestFactory()


def settings_for(store_settings, **login):
    return {
        **BASE_SETTINGS,
        **store_settings,
        "LIMITS": LIMITS,
        "LOGIN": {"LIMIT": "login_failures", "KEYS": ["username", "ip"], **login},
    }


@pytest.fixture(params=sorted(STORES))
def store(request, transactional_db):
    """The login limit's store: its TOKENBUCKET overrides."""
    if request.param == "redis":
        return request.getfixturevalue("redis_store")
    return STORES[request.param]


@pytest.fixture
def protected(store):
    """Login protection on ``store`` (3 failures an hour per username and per address), at a pinned time."""
    overrides.invalidate()
    with override_settings(
        TOKENBUCKET=settings_for(store),
        AUTHENTICATION_BACKENDS=[BACKEND, MODEL_BACKEND],
        PASSWORD_HASHERS=login_support.HASHERS,
    ):
        with frozen_clock(T0) as clock:
            user = get_user_model().objects.create_user("victim", password="right", is_staff=True)
            login_support.reset_counts()
            yield clock, user
    overrides.invalidate()


def configure(store, **login):
    return override_settings(TOKENBUCKET=settings_for(store, **login))


def post(address="203.0.113.7", **data):
    return rf.post("/", data, REMOTE_ADDR=address)


def tokens(key):
    return limiter.get_value("login_failures", key)


USERNAME = ("username", "victim")


# -- every path counts its failures, and a success spends nothing ------------------------


def test_a_direct_authenticate_counts_failures_and_checks_no_password_once_they_run_out(protected):
    results = [authenticate(post(), username="victim", password="wrong") for _ in range(3)]
    assert results == [None] * 3
    assert checked() == 3
    assert tokens(USERNAME) == 0
    # Locked out: refused before any hasher runs, the right password included.
    assert authenticate(post(), username="victim", password="wrong") is None
    assert authenticate(post(), username="victim", password="right") is None
    assert checked() == 3  # was 5: every login checked its password


def test_a_successful_login_spends_nothing(protected):
    for _ in range(10):
        assert authenticate(post(), username="victim", password="right") is not None
    assert tokens(USERNAME) == 3
    assert tokens(("ip", "203.0.113.7")) == 3
    assert authenticate(post(), username="victim", password="wrong") is None
    assert tokens(USERNAME) == 2


def test_without_a_request_only_the_username_counts(protected):
    for _ in range(3):
        assert authenticate(username="victim", password="wrong") is None
    assert authenticate(username="victim", password="right") is None
    assert checked() == 3
    assert not RateLimit.objects.filter(label__startswith="ip=").exists()
    assert authenticate(post(), username="victim", password="right") is None  # locked for every request too


def test_every_spelling_of_the_username_is_one_bucket(protected):
    for spelling in (" VICTIM", "Victim\t", "ｖｉｃｔｉｍ"):
        authenticate(post(), username=spelling, password="wrong")
    assert tokens(USERNAME) == 0
    assert authenticate(post(), username="victim", password="right") is None
    assert checked() == 3


def test_the_username_is_read_from_the_user_models_field_too(protected):
    """``authenticate(email=...)`` of a custom user model passes USERNAME_FIELD's name."""
    for _ in range(3):
        authenticate(post(), **{get_user_model().USERNAME_FIELD: "victim"}, password="wrong")
    assert tokens(USERNAME) == 0


def test_one_address_across_accounts_locks_the_address(protected):
    for name in ("alice", "bob", "carol"):
        assert authenticate(post(), username=name, password="guess") is None
    assert checked() == 3  # unknown usernames still run the hasher, as Django does
    assert authenticate(post(), username="victim", password="right") is None
    assert authenticate(post(address="198.51.100.1"), username="victim", password="right") is not None
    assert checked() == 4


def test_a_login_with_no_username_is_refused_without_a_hash(protected):
    for username in ("", "   ", None):
        assert authenticate(post(), username=username, password="x") is None
    assert checked() == 0  # Django would hash for an unknown (empty) username
    assert not RateLimit.objects.exists()


def test_calls_without_a_password_pass_through(protected):
    with override_settings(
        AUTHENTICATION_BACKENDS=[BACKEND, "django.contrib.auth.backends.RemoteUserBackend", MODEL_BACKEND]
    ):
        for _ in range(5):
            assert authenticate(post(), remote_user="victim") is not None
    assert not RateLimit.objects.exists()


def test_aauthenticate_counts_and_refunds_as_authenticate_does(protected):
    async def attempts():
        results = [await aauthenticate(post(), username="victim", password="right")]
        results += [await aauthenticate(post(), username="victim", password="wrong") for _ in range(4)]
        results.append(await aauthenticate(post(), username="victim", password="right"))
        return results

    results = async_to_sync(attempts)()
    assert results[0] is not None and results[0].get_username() == "victim"
    assert results[1:] == [None] * 5
    assert checked() == 4  # the right password once, then three failures; two refused unchecked
    assert tokens(USERNAME) == 0


def test_the_admin_login_is_protected_and_says_nothing_more(protected):
    client = Client(REMOTE_ADDR="203.0.113.7")
    wrong = [client.post("/admin/login/", {"username": "victim", "password": "wrong"}) for _ in range(3)]
    assert checked() == 3
    locked = client.post("/admin/login/", {"username": "victim", "password": "right"})
    assert checked() == 3
    assert {r.status_code for r in [*wrong, locked]} == {200}
    error = "Please enter the correct username and password for a staff account."
    assert all(error in r.content.decode() for r in [*wrong, locked])
    assert "_auth_user_id" not in client.session


def test_loginview_is_protected_and_logs_in_with_the_model_backend_in_the_session(protected):
    client = Client(REMOTE_ADDR="203.0.113.7")
    response = client.post("/accounts/login/", {"username": "victim", "password": "right"})
    assert response.status_code == 302
    # The session names the backend that checked the password, so it does not depend on LoginBackend.
    assert client.session[BACKEND_SESSION_KEY] == MODEL_BACKEND
    with override_settings(AUTHENTICATION_BACKENDS=[MODEL_BACKEND]):
        assert client.get("/admin/").status_code == 200
    client.logout()
    for _ in range(3):
        assert client.post("/accounts/login/", {"username": "victim", "password": "wrong"}).status_code == 200
    locked = client.post("/accounts/login/", {"username": "victim", "password": "right"})
    assert (locked.status_code, checked()) == (200, 4)
    assert "Please enter a correct username and password" in locked.content.decode()


def test_the_test_clients_login_and_force_login_keep_the_model_backend(protected):
    client = Client()
    assert client.login(username="victim", password="right")
    assert client.session[BACKEND_SESSION_KEY] == MODEL_BACKEND
    other = Client()
    other.force_login(protected[1])
    assert other.session[BACKEND_SESSION_KEY] == MODEL_BACKEND
    assert other.get("/admin/").status_code == 200
    assert tokens(USERNAME) == 3


def test_drf_obtain_auth_token_answers_429_with_retry_after_once_locked(protected):
    client = Client(REMOTE_ADDR="203.0.113.7")

    def token(password):
        return client.post(
            "/api/token/", json.dumps({"username": "victim", "password": password}), content_type="application/json"
        )

    assert token("right").status_code == 200
    assert [token("wrong").status_code for _ in range(3)] == [400] * 3
    locked = token("right")
    assert locked.status_code == 429
    assert locked["Retry-After"] == "1200"  # one failure more in 20 minutes
    assert locked["Cache-Control"] == "no-store"
    assert checked() == 4


def test_a_projects_json_login_gets_429_and_a_form_its_usual_answer(protected):
    client = Client(REMOTE_ADDR="203.0.113.7")

    def api(password):
        return client.post(
            "/api/login/",
            json.dumps({"username": "victim", "password": password}),
            content_type="application/json",
            HTTP_ACCEPT="application/json",
        )

    assert [api("wrong").status_code for _ in range(3)] == [401] * 3
    assert api("right").status_code == 429
    form = client.post("/accounts/login/", {"username": "victim", "password": "right"})
    assert form.status_code == 200 and not form.has_header("Retry-After")


def test_a_response_hook_answers_every_refused_login(protected, store):
    def lockout_page(request, status):
        from django.http import HttpResponse

        return HttpResponse(f"locked, retry in {status.retry_after_header} s", status=429)

    with configure(store, RESPONSE=lockout_page):
        client = Client(REMOTE_ADDR="203.0.113.7")
        for _ in range(3):
            client.post("/accounts/login/", {"username": "victim", "password": "wrong"})
        locked = client.post("/accounts/login/", {"username": "victim", "password": "right"})
    assert (locked.status_code, locked.content) == (429, b"locked, retry in 1200 s")
    assert (locked["Retry-After"], locked["Cache-Control"]) == ("1200", "no-store")


# -- lockouts ---------------------------------------------------------------------------


@pytest.fixture
def lockouts():
    seen = []

    def record(sender, **kwargs):
        seen.append(kwargs)

    login_locked_out.connect(record)
    yield seen
    login_locked_out.disconnect(record)


def test_a_lockout_is_one_signal_and_one_log_line_without_the_username(protected, lockouts, caplog):
    caplog.set_level(logging.INFO, logger="django_tokenbucket")
    for _ in range(8):
        authenticate(username="victim", password="wrong")
    assert len(lockouts) == 1
    (event,) = lockouts
    assert event["key"] == USERNAME and isinstance(event["key"][1], Redacted)
    assert event["label"] == "username=… (value not stored)"
    assert (event["until"], event["retry_after"], event["lockouts"]) == (None, 1200, None)
    lines = [r.getMessage() for r in caplog.records if "locked out" in r.getMessage()]
    assert len(lines) == 1
    assert "victim" not in caplog.text
    assert not RateLimit.objects.filter(label__contains="victim").exists()


def test_without_cooloff_the_bucket_refills_at_its_rate(protected):
    clock, _user = protected
    for _ in range(3):
        authenticate(username="victim", password="wrong")
    clock.advance(1199)
    assert authenticate(username="victim", password="right") is None
    clock.advance(1)
    assert authenticate(username="victim", password="right") is not None
    assert checked() == 4


def test_a_cooloff_blocks_the_key_then_it_starts_afresh(protected, store, lockouts):
    clock, _user = protected
    with configure(store, COOLOFF=timedelta(minutes=5)):
        for n in range(3):
            authenticate(post(f"203.0.113.{n}"), username="victim", password="wrong")
        (row,) = LimitOverride.objects.filter(action="block")
        assert row.label == "username=… (value not stored)"
        assert row.expires_at.timestamp() == T0 + 300
        assert tokens(USERNAME) == 3  # filled for when the lockout ends
        status = limiter.limit("login_failures", USERNAME)
        assert (status.ok, status.override, status.retry_after) == (False, "block", 300)
        assert authenticate(post(), username="victim", password="right") is None
        assert checked() == 3
        clock.advance(300)
        assert authenticate(post("198.51.100.1"), username="victim", password="right") is not None
        assert [authenticate(post("198.51.100.1"), username="victim", password="w") for _ in range(3)] == [None] * 3
        assert checked() == 7  # three fresh failures after the lockout: it started full
    assert [(event["key"][0], event["until"].timestamp()) for event in lockouts] == [
        ("username", T0 + 300),
        ("username", T0 + 600),
        ("ip", T0 + 600),  # the other address failed three times too
    ]


def test_a_cooloff_callable_escalates_and_remembers_lockouts(protected, store, lockouts):
    clock, _user = protected
    steps = [60, 600, 3600]
    with configure(store, COOLOFF=lambda n: steps[min(n, 3) - 1], KEYS=["username"]):
        for _round in range(4):
            for _ in range(3):
                authenticate(username="victim", password="wrong")
            clock.advance(lockouts[-1]["retry_after"])
        assert [(event["lockouts"], event["retry_after"]) for event in lockouts] == [
            (1, 60),
            (2, 600),
            (3, 3600),
            (4, 3600),
        ]
        # Each day without a lockout forgets one.
        clock.advance(24 * 3600 * 3 + 1)
        for _ in range(3):
            authenticate(username="victim", password="wrong")
    assert (lockouts[-1]["lockouts"], lockouts[-1]["retry_after"]) == (2, 600)


def test_a_process_that_has_not_read_the_block_refuses_before_checking(protected, store):
    """Another process decides with an older snapshot of the overrides: the bucket is full
    again (filled for the lockout's end), but the block in the database is found."""
    with configure(store, COOLOFF=300):
        for _ in range(3):
            authenticate(username="victim", password="wrong")
        stale = override_snapshot._snapshot
        # This process forgets the block, as one that has not read it yet.
        override_snapshot._snapshot = override_snapshot._Snapshot()
        override_snapshot._due = float("inf")
        try:
            assert authenticate(username="victim", password="right") is None
        finally:
            override_snapshot._snapshot = stale
            overrides.invalidate()
        assert checked() == 3
        assert tokens(USERNAME) == 3  # its token given back


def test_reset_on_success_refills_the_usernames_bucket(protected, store):
    with configure(store, RESET_ON_SUCCESS=True):
        for _ in range(2):
            authenticate(post(), username="victim", password="wrong")
        assert authenticate(post(), username="victim", password="right") is not None
    assert tokens(USERNAME) == 3
    assert tokens(("ip", "203.0.113.7")) == 1  # the address's failures stay


# -- operators ---------------------------------------------------------------------------


def test_unlock_ends_a_lockout_of_a_username_and_of_an_address(protected, store):
    with configure(store, COOLOFF=3600):
        for name in ("victim", "x", "y"):
            authenticate(post(), username=name, password="wrong")
        for _ in range(2):
            authenticate(post("198.51.100.1"), username="victim", password="wrong")
        assert authenticate(post("198.51.100.2"), username="victim", password="right") is None
        assert is_locked(username="VICTIM") and is_locked(ip="203.0.113.7")
        assert not is_locked(username="someone") and not is_locked(ip="198.51.100.2")
        done = unlock(username=" Victim ")
        assert not is_locked(username="victim")
        assert [(u.typed, u.unblocked) for u in done] == [("username=victim", True)]
        assert authenticate(post("198.51.100.2"), username="victim", password="right") is not None
        assert authenticate(post(), username="victim", password="right") is None  # the address is still locked
        done = unlock(ip="203.0.113.7")
        assert [(u.typed, u.unblocked) for u in done] == [("ip=203.0.113.7", True)]
        assert authenticate(post(), username="victim", password="right") is not None
    with pytest.raises(ValueError, match="not an IP address"):
        unlock(ip="nope")


def test_an_exempt_address_never_locks_and_a_blocked_account_is_refused_unchecked(protected):
    limiter.exempt("login_failures", ("ip", "203.0.113.7"), reason="office")
    for name in ("a", "b", "c", "d", "e"):
        authenticate(post(), username=name, password="wrong")
    assert checked() == 5
    assert authenticate(post(), username="victim", password="right") is not None
    limiter.block("login_failures", ("username", "Victim"), reason="locked by hand")
    assert authenticate(post("198.51.100.1"), username="victim", password="right") is None
    assert checked() == 6


def test_a_projects_own_failure_signal_is_counted_and_django_s_is_not_counted_twice(protected):
    request = post()
    user_login_failed.send(sender=__name__, credentials={"username": "victim", "password": "****"}, request=request)
    assert tokens(USERNAME) == 2
    authenticate(request, username="victim", password="wrong")  # Django sends the signal too
    assert tokens(USERNAME) == 1


# -- the store fails ----------------------------------------------------------------------


@pytest.mark.django_db(transaction=True, databases=["default", "unreachable"])
@pytest.mark.parametrize("store", ["database"], indirect=True)
def test_a_failed_store_refuses_logins_unchecked_and_json_gets_503(protected):
    unreachable = {
        "BACKEND": "django_tokenbucket.backends.database.DatabaseBackend",
        "OPTIONS": {"DATABASE": "unreachable"},
    }
    with configure(unreachable):
        client = Client(REMOTE_ADDR="203.0.113.7")
        response = client.post(
            "/api/token/", json.dumps({"username": "victim", "password": "right"}), content_type="application/json"
        )
        assert authenticate(username="victim", password="right") is None
    assert response.status_code == 503 and response["Cache-Control"] == "no-store"
    assert checked() == 0


# -- transactions ---------------------------------------------------------------------------

_SECOND_ALIAS = {"postgres": "serializable", "mariadb": "repeatable_read"}


def _drf_failures(monkeypatch, count):
    from django.db import connections

    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
    client = Client(REMOTE_ADDR="203.0.113.7")
    body = json.dumps({"username": "victim", "password": "wrong"})
    return [client.post("/api/token/", body, content_type="application/json").status_code for _ in range(count)]


@pytest.mark.parametrize("store", ["database"], indirect=True)
def test_w062_under_atomic_requests_drf_rolls_its_failures_back_with_the_request(protected, monkeypatch):
    """The weakness check W062 warns of: DRF rolls back every request it answers with an
    error, and the failure's token with it, when the limit is in that transaction."""
    assert _drf_failures(monkeypatch, 4) == [400] * 4
    assert tokens(USERNAME) == 3
    assert checked() == 4
    from django.db import connections

    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", False)
    Client(REMOTE_ADDR="203.0.113.7").post(
        "/api/token/", json.dumps({"username": "victim", "password": "wrong"}), content_type="application/json"
    )
    assert tokens(USERNAME) == 2  # outside a transaction, the failure stays spent


@pytest.mark.parametrize("store", ["redis"], indirect=True)
def test_under_atomic_requests_a_limit_on_redis_keeps_the_failures(protected, monkeypatch):
    """What W062 advises: the login limit outside the request's transaction."""
    assert _drf_failures(monkeypatch, 4) == [400, 400, 400, 429]
    assert (tokens(USERNAME), checked()) == (0, 3)


@pytest.mark.only_on("postgres", "mariadb")  # SQLite has one writer: the request's transaction holds it
@pytest.mark.django_db(transaction=True, databases="__all__")
@pytest.mark.parametrize("store", ["database"], indirect=True)
def test_under_atomic_requests_a_limit_on_a_second_alias_keeps_the_failures(protected, store, monkeypatch):
    """The other advice of W062: a second alias of the same database, a connection (and
    transactions) of its own."""
    from django.conf import settings

    with configure({**store, "OPTIONS": {"DATABASE": _SECOND_ALIAS[settings.DB]}}):
        assert _drf_failures(monkeypatch, 4) == [400, 400, 400, 429]
        assert tokens(USERNAME) == 0
    assert checked() == 3


# -- what an attacker sends ------------------------------------------------------------------


def test_a_username_of_a_megabyte_or_of_control_characters_costs_a_bounded_key_and_shows_nowhere(protected, caplog):
    caplog.set_level(logging.INFO, logger="django_tokenbucket")
    huge = "v" * 1_000_000
    for _ in range(4):
        assert authenticate(post("198.51.100.9"), username=huge, password="x") is None
        assert authenticate(post("198.51.100.8"), username="ev\x1bil\u202e\n", password="x") is None
    assert checked() == 6  # three of each, then refused
    assert all(row.label.startswith(("username=… (value not stored)", "ip=")) for row in RateLimit.objects.all())
    assert "vvvv" not in caplog.text and "ev\x1bil" not in caplog.text


@pytest.mark.parametrize("username", [["victim"], {"name": "victim"}, True, None])
def test_a_username_that_is_no_text_is_refused_unchecked_and_answers_as_a_failure(protected, username):
    """A project's JSON login may pass what the client sent as it is."""
    response = Client(REMOTE_ADDR="203.0.113.7").post(
        "/api/login/", json.dumps({"username": username, "password": "p"}), content_type="application/json"
    )
    assert response.status_code == 401  # the view's own answer to a failed login, not a 500 nor a 429
    assert authenticate(post(), username=username, password="p") is None
    assert checked() == 0
    assert not RateLimit.objects.exists()


def test_a_login_by_email_is_counted_by_it_and_credentials_naming_no_account_by_address(protected):
    """allauth logs in by email with ``authenticate(request, email=..., password=...)``; a
    custom backend may take a phone number: neither is refused for want of a username."""

    class ByEmailOrPhone:
        def authenticate(self, request, email=None, phone=None, password=None):
            return None

    import sys
    import types

    module = types.ModuleType("tests_login_by_email")
    module.Backend = ByEmailOrPhone
    sys.modules["tests_login_by_email"] = module
    with override_settings(AUTHENTICATION_BACKENDS=[BACKEND, "tests_login_by_email.Backend"]):
        for _ in range(3):
            authenticate(post("198.51.100.1"), email=" Victim@Example.COM", password="x")
        assert tokens(("username", "victim@example.com")) == 0
        for _ in range(3):
            authenticate(post(), phone="+15550100", password="x")
        assert tokens(("ip", "203.0.113.7")) == 0
        assert authenticate(post(), email="", password="x") is None  # an empty one: refused
    del sys.modules["tests_login_by_email"]
