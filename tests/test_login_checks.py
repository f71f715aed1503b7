"""The system checks of login protection (E060-E063, W060-W062), and a malformed setting
meeting a login."""

from __future__ import annotations

import pytest
from django.contrib.auth import authenticate
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings

from django_tokenbucket.auth.checks import check_login

from .settings import TOKENBUCKET as BASE_SETTINGS

BACKEND = "django_tokenbucket.auth.LoginBackend"
MODEL_BACKEND = "django.contrib.auth.backends.ModelBackend"
LIMITS = {**BASE_SETTINGS["LIMITS"], "login_failures": "5/15m"}


def ids(login=None, backends=(BACKEND, MODEL_BACKEND), **tokenbucket):
    settings = {**BASE_SETTINGS, "LIMITS": LIMITS, **tokenbucket}
    if login is not None:
        settings["LOGIN"] = login
    with override_settings(TOKENBUCKET=settings, AUTHENTICATION_BACKENDS=list(backends)):
        return [(message.id.rpartition(".")[2], message.msg) for message in check_login()]


def test_the_defaults_with_the_backend_listed_are_fine():
    assert ids() == []
    assert ids({"COOLOFF": lambda n: 60 * 10 ** min(n - 1, 2), "KEYS": ["username", ("ip", "user_agent")]}) == []


@pytest.mark.parametrize(
    ("login", "says"),
    [
        ("yes", "must be None, False or a dict"),
        ({"KEYS": "username"}, "KEYS must be a non-empty list"),
        ({"KEYS": ["email"]}, "KEYS: 'email' is not one of 'username', 'ip', 'user_agent'"),
        ({"KEYS": [("ip", "ip")]}, "names a part twice"),
        ({"KEYS": ["ip", ["ip"]]}, "is given twice"),
        ({"COOLOFF": 0}, "COOLOFF must be None, seconds, a timedelta or a callable"),
        ({"COOLOFF": "no.such.path"}, "cannot be imported"),
        ({"RESET_ON_SUCCESS": 1}, "['RESET_ON_SUCCESS'] must be True or False"),
        ({"LIMIT": ""}, "must be the name of a limit"),
        ({"LOCKOUT": 5}, "unknown key(s) 'LOCKOUT'"),
        ({"RESPONSE": 42}, "RESPONSE must be a callable"),
    ],
)
def test_a_malformed_setting_is_e060(login, says):
    ((code, message),) = ids(login)
    assert code == "E060"
    assert says in message


def test_an_unknown_limit_is_e061():
    assert ids({"LIMIT": "nope"})[0][0] == "E061"


def test_a_cooloff_without_overrides_is_e062():
    assert [code for code, _ in ids({"COOLOFF": 60}, OVERRIDES=False)] == ["E062"]


@pytest.mark.parametrize(
    ("cooloff", "says"),
    [(lambda n: "1h", "returned '1h'"), (lambda n: 1 / 0, "raised ZeroDivisionError"), (lambda n: -5, "positive")],
)
def test_a_cooloff_callable_returning_no_duration_is_e063(cooloff, says):
    ((code, message),) = ids({"COOLOFF": cooloff})
    assert code == "E063" and says in message


def test_a_backend_before_login_backend_is_w060():
    ((code, message),) = ids(backends=[MODEL_BACKEND, BACKEND])
    assert code == "W060" and MODEL_BACKEND in message


def test_login_set_without_the_backend_is_w061_and_the_defaults_alone_are_silent():
    assert ids({"KEYS": ["username"]}, backends=[MODEL_BACKEND])[0][0] == "W061"
    assert ids(backends=[MODEL_BACKEND]) == []


def test_a_login_limit_in_a_database_with_atomic_requests_is_w062(monkeypatch):
    from django.db import connections

    monkeypatch.setitem(connections.settings["default"], "ATOMIC_REQUESTS", True)
    from django.conf import settings as django_settings

    monkeypatch.setitem(django_settings.DATABASES["default"], "ATOMIC_REQUESTS", True)
    assert [code for code, _ in ids()] == ["W062"]
    redis = {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis"}}
    assert ids(**redis) == []


def test_a_malformed_setting_meeting_a_login_names_the_problem():
    with override_settings(
        TOKENBUCKET={**BASE_SETTINGS, "LOGIN": {"KEYS": []}}, AUTHENTICATION_BACKENDS=[BACKEND, MODEL_BACKEND]
    ):
        with pytest.raises(ImproperlyConfigured, match=r"TOKENBUCKET\['LOGIN'\]: KEYS must be a non-empty list"):
            authenticate(username="a", password="b")


def test_login_off_is_silent():
    assert ids(None, LOGIN=None) == []
    assert ids(None, LOGIN=False) == []


def test_the_lockouts_bucket_is_known_to_the_admin_and_the_command_of_every_process():
    from django_tokenbucket import registry
    from django_tokenbucket.auth.receivers import know_the_lockouts_limit

    with override_settings(
        TOKENBUCKET={**BASE_SETTINGS, "LIMITS": LIMITS, "LOGIN": {"COOLOFF": lambda n: 60 * n}},
        AUTHENTICATION_BACKENDS=[BACKEND, MODEL_BACKEND],
    ):
        know_the_lockouts_limit()  # what django_tokenbucket's ready() runs
        known = registry.known_limits(load_views=False)["login_failures.lockouts"]
    assert (known.config.capacity_tokens, known.source) == (1000, "inline")
