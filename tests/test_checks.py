"""System checks and runtime configuration errors (B10, B11, B3 at the API)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from decimal import Decimal
from io import StringIO
from pathlib import Path

import pytest
from django.conf import settings
from django.core.checks import Error, Warning, run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import SystemCheckError
from django.db import connections
from django.test import override_settings

from django_tokenbucket import LimitRequest, limiter
from django_tokenbucket.backends.database import DatabaseBackend
from django_tokenbucket.testing import frozen_clock

REPO = Path(__file__).resolve().parents[1]
BASE = settings.TOKENBUCKET


def tokenbucket(**changes):
    """Return the test TOKENBUCKET setting with ``changes``."""
    return {**BASE, **changes}


def with_limits(**limits):
    return tokenbucket(LIMITS={**BASE["LIMITS"], **limits})


def our_messages(**kwargs):
    return [m for m in run_checks(**kwargs) if (m.id or "").startswith("django_tokenbucket.")]


def ids(messages):
    return sorted(m.id for m in messages)


# ---------------------------------------------------------------------------------------
# System checks, in process
# ---------------------------------------------------------------------------------------


def test_test_settings_pass_the_checks():
    messages = our_messages()
    assert messages == [], messages
    call_command("check", stdout=StringIO(), stderr=StringIO())


@pytest.mark.parametrize(
    "name, spec, bad",
    [
        ("signup", {"kind": "token bucket", "rate": "10/M"}, "10/M"),
        ("signup", "1e3/s", "1e3/s"),
        ("signup", {"rate": 10}, "10"),
        ("signup", {"rate": "5/m", "capacity": float("nan")}, "nan"),
        ("signup", {"rate": "5/m", "capacity": 0}, "0"),
        ("signup", {"rate": "5/m", "burst": 3}, "burst"),
        ("signup", {"kind": "sliding", "rate": "5/m"}, "sliding"),
        ("signup", {"rate": "5/m", "start": 0}, "start"),
        ("signup", None, "None"),
        ("", "5/m", "''"),
        (" padded", "5/m", "' padded'"),
        (42, "5/m", "42"),
    ],
    ids=repr,
)
def test_broken_limit_gives_e003_naming_it(name, spec, bad):
    with override_settings(TOKENBUCKET=tokenbucket(LIMITS={**BASE["LIMITS"], name: spec})):
        messages = our_messages()
        errors = [m for m in messages if m.id == "django_tokenbucket.E003"]
        assert len(errors) == 1, messages
        error = errors[0]
        assert isinstance(error, Error) and error.is_serious()
        assert repr(name) in error.msg
        assert bad in error.msg
        assert repr(name) in str(error.obj)
        # The other limits are fine and not reported.
        assert "'login'" not in error.msg

        with pytest.raises(SystemCheckError) as excinfo:
            call_command("check", stdout=StringIO(), stderr=StringIO())
        assert "django_tokenbucket.E003" in str(excinfo.value)
        assert repr(name) in str(excinfo.value)


def test_every_broken_limit_is_reported():
    with override_settings(TOKENBUCKET=with_limits(one="10/M", two={"rate": 10}, three="5/m")):
        errors = [m for m in our_messages() if m.id == "django_tokenbucket.E003"]
        assert len(errors) == 2
        assert any("'one'" in e.msg for e in errors) and any("'two'" in e.msg for e in errors)


@pytest.mark.parametrize("limits", [[("login", "5/m")], "login=5/m", None, 5], ids=repr)
def test_limits_not_a_dict_e002(limits):
    with override_settings(TOKENBUCKET=tokenbucket(LIMITS=limits)):
        assert "django_tokenbucket.E002" in ids(our_messages())


def test_tokenbucket_not_a_dict_e001():
    with override_settings(TOKENBUCKET=[("LIMITS", {})]):
        assert ids(our_messages()) == ["django_tokenbucket.E001"]


@pytest.mark.parametrize("names", [("Login", "login"), ("API_calls", "api_calls"), ("straße", "STRASSE")])
def test_names_differing_only_in_case_e004(names):
    with override_settings(TOKENBUCKET=tokenbucket(LIMITS={n: "5/m" for n in names})):
        errors = [m for m in our_messages() if m.id == "django_tokenbucket.E004"]
        assert len(errors) == 1
        assert all(repr(n) in errors[0].msg for n in names)


@pytest.mark.parametrize(
    "backend",
    [
        "django_tokenbucket.backends.nosuch.Backend",
        "django_tokenbucket.backends.database.NoSuchBackend",
        "nosuchpackage.Backend",
        "NoDots",
        "",
    ],
)
def test_unimportable_backend_e005(backend):
    with override_settings(TOKENBUCKET=tokenbucket(BACKEND=backend)):
        errors = [m for m in our_messages() if m.id == "django_tokenbucket.E005"]
        assert len(errors) == 1
        assert repr(backend) in errors[0].msg


@pytest.mark.parametrize("backend", [None, 42, ["django_tokenbucket.backends.database.DatabaseBackend"]], ids=repr)
def test_backend_not_a_string_is_an_error_not_a_crash(backend):
    with override_settings(TOKENBUCKET=tokenbucket(BACKEND=backend)):
        messages = our_messages()  # must not raise
        assert any(m.is_serious() and repr(backend) in m.msg for m in messages), messages


def test_backend_that_is_not_a_backend_fails_the_check():
    # Importable, but not a BaseBackend: the check must say so, not the first request.
    path = "django_tokenbucket.limits.LimitConfig"
    with override_settings(TOKENBUCKET=tokenbucket(BACKEND=path)):
        with pytest.raises(ImproperlyConfigured):
            limiter.limit("login", key="k")
        messages = our_messages()
        assert any(m.is_serious() and repr(path) in m.msg for m in messages), messages


@pytest.mark.parametrize("value", ["yes", 1, 0, None, "False"], ids=repr)
def test_fail_open_not_a_bool_e006(value):
    with override_settings(TOKENBUCKET=tokenbucket(FAIL_OPEN=value)):
        errors = [m for m in our_messages() if m.id == "django_tokenbucket.E006"]
        assert len(errors) == 1
        assert repr(value) in errors[0].msg


def too_many_requests(request, status):
    """A RESPONSE callable, for the check that accepts one."""


@pytest.mark.parametrize(
    ("setting", "value", "check_id", "says"),
    [
        ("RESPONSE", "myapp.views.nope", "E023", "cannot be imported"),
        ("RESPONSE", 429, "E023", "is not callable"),
        ("HEADERS", "yes", "E016", "must be True or False"),
        ("LOG_INTERVAL", "10", "E024", "must be a number of seconds >= 0"),
        ("LOG_INTERVAL", -1, "E024", "must be a number of seconds >= 0"),
        ("CELERY", [], "E025", "must be a dict, not list"),
        ("CELERY", {"MAX_ETAA": 60}, "E025", "unknown setting(s) 'MAX_ETAA'"),
        ("CELERY", {"BATCH_SIZE": 0.5}, "E025", "['BATCH_SIZE'] must be a whole number > 0"),
        ("CELERY", {"KEEP_FINISHED": -1}, "E025", "['KEEP_FINISHED'] must be a number of seconds > 0 or None"),
    ],
)
def test_every_setting_is_checked(setting, value, check_id, says):
    with override_settings(TOKENBUCKET=tokenbucket(**{setting: value})):
        messages = [m for m in our_messages() if m.id == f"django_tokenbucket.{check_id}"]
    assert len(messages) == 1 and says in messages[0].msg and setting in messages[0].msg, messages


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("RESPONSE", f"{__name__}.too_many_requests"),
        ("RESPONSE", too_many_requests),
        ("HEADERS", True),
        ("LOG_INTERVAL", 0),
        ("LOG_INTERVAL", 2.5),
        ("CELERY", {"MAX_ETA": 60, "KEEP_FINISHED": None, "BATCH_SIZE": 100}),
    ],
)
def test_good_settings_pass_their_checks(setting, value):
    with override_settings(TOKENBUCKET=tokenbucket(**{setting: value})):
        assert our_messages() == []


@pytest.mark.parametrize("value", [True, False])
def test_fail_open_bool_is_fine(value):
    with override_settings(TOKENBUCKET=tokenbucket(FAIL_OPEN=value)):
        assert our_messages() == []


@pytest.mark.parametrize("value", ["utc", "Store", "database", None, 1, ["store"]], ids=repr)
def test_bad_clock_e007(value):
    with override_settings(TOKENBUCKET=tokenbucket(CLOCK=value)):
        errors = [m for m in our_messages() if m.id == "django_tokenbucket.E007"]
        assert len(errors) == 1
        assert repr(value) in errors[0].msg


@pytest.mark.parametrize(
    "setting, value",
    [
        ("TRUSTED_PROXIES", -1),  # would key on the address the client wrote itself
        ("TRUSTED_PROXIES", True),
        ("TRUSTED_PROXIES", "1"),
        ("TRUSTED_PROXIES", 1.5),
        ("TRUSTED_PROXIES", ["10.0.0.0/8", "10.0.0.300"]),
        ("TRUSTED_PROXIES", [10]),
        ("IPV6_PREFIX", 0),  # every IPv6 client in one bucket
        ("IPV6_PREFIX", 129),
        ("IPV6_PREFIX", 64.5),
        ("IPV6_PREFIX", True),
        ("IP_HEADER", ""),
        ("IP_HEADER", ["CF-Connecting-IP"]),
    ],
    ids=repr,
)
def test_bad_client_address_settings_e012(setting, value):
    with override_settings(TOKENBUCKET=tokenbucket(**{setting: value})):
        errors = [m for m in our_messages() if m.id == "django_tokenbucket.E012"]
    assert len(errors) == 1
    assert setting in errors[0].msg


@pytest.mark.parametrize(
    "setting, value",
    [
        ("TRUSTED_PROXIES", 0),
        ("TRUSTED_PROXIES", 2),
        ("TRUSTED_PROXIES", ["10.0.0.0/8", "2001:db8::1"]),
        ("TRUSTED_PROXIES", ()),
        ("IPV6_PREFIX", 48),
        ("IPV6_PREFIX", 128),
    ],
    ids=repr,
)
def test_good_client_address_settings(setting, value):
    with override_settings(TOKENBUCKET=tokenbucket(**{setting: value})):
        assert our_messages() == []


@pytest.mark.parametrize("trusted, warned", [(None, True), (1, True), (["173.245.48.0/20"], False)], ids=repr)
def test_an_ip_header_that_is_never_honoured_is_reported(trusted, warned):
    """Red-team case 6: IP_HEADER with a count of proxies was silently ignored."""
    with override_settings(TOKENBUCKET=tokenbucket(IP_HEADER="CF-Connecting-IP", TRUSTED_PROXIES=trusted)):
        assert [m.id for m in our_messages()] == (["django_tokenbucket.W003"] if warned else [])


@pytest.mark.parametrize(
    "setting, value, check_id",
    [("FOLD_KEY_CASE", "yes", "E016"), ("COUNT_OPTIONS", 1, "E016"), ("KEY_SECRET", "short", "E017"), ("KEY_SECRET", 42, "E017")],
    ids=repr,
)
def test_key_and_method_settings_are_checked(setting, value, check_id):
    with override_settings(TOKENBUCKET=tokenbucket(**{setting: value})):
        assert [m.id for m in our_messages()] == [f"django_tokenbucket.{check_id}"]


@pytest.mark.parametrize(
    "setting, value, remote",
    [("TRUSTED_PROXIES", -1, "10.0.0.1"), ("TRUSTED_PROXIES", "1", "10.0.0.1"), ("IPV6_PREFIX", 129, "2001:db8::1")],
    ids=repr,
)
def test_bad_client_address_settings_fail_the_request_not_silently(rf, setting, value, remote):
    from django_tokenbucket.ip import client_ip

    request = rf.get("/", REMOTE_ADDR=remote, HTTP_X_FORWARDED_FOR="6.6.6.6, 198.51.100.7")
    with override_settings(TOKENBUCKET=tokenbucket(**{setting: value})):
        with pytest.raises(ImproperlyConfigured, match=setting):
            client_ip(request)


@pytest.mark.parametrize("value", ["store", "app"])
def test_good_clock(value):
    with override_settings(TOKENBUCKET=tokenbucket(CLOCK=value)):
        assert our_messages() == []


@pytest.mark.parametrize(
    "setting, value",
    [
        ("RETRY_ATTEMPTS", 0),
        ("RETRY_ATTEMPTS", 1.5),
        ("RETRY_ATTEMPTS", True),
        ("RETRY_BASE_DELAY", -1),
        ("RETRY_MAX_DELAY", "1"),
    ],
)
def test_bad_retry_settings_e008(setting, value):
    with override_settings(TOKENBUCKET=tokenbucket(**{setting: value})):
        assert "django_tokenbucket.E008" in ids(our_messages())


@pytest.mark.parametrize("key", ["LIMIT", "limits", "FAILOPEN", "TIMEOUT"])
def test_unknown_setting_w002(key):
    with override_settings(TOKENBUCKET=tokenbucket(**{key: {}})):
        messages = our_messages()
        assert ids(messages) == ["django_tokenbucket.W002"]
        assert isinstance(messages[0], Warning) and not messages[0].is_serious()
        assert repr(key) in messages[0].msg
        # A warning alone does not fail ``manage.py check``.
        call_command("check", stdout=StringIO(), stderr=StringIO())


def test_options_not_a_dict_is_an_error_not_a_crash():
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS="default")):
        messages = our_messages()  # must not raise
        assert any(m.is_serious() for m in messages), messages


def test_database_option_not_in_databases_e009():
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS={"DATABASE": "nosuchdb"})):
        errors = [m for m in our_messages() if m.id == "django_tokenbucket.E009"]
        assert len(errors) == 1 and "'nosuchdb'" in errors[0].msg


@pytest.mark.parametrize("extra", [{"CACHE": "default"}, {"fast_path": True}, {"DATABASES": "default"}])
def test_unknown_database_option_e013(extra):
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS={"DATABASE": "unreachable", **extra})):
        messages = our_messages()
        assert ids(messages) == ["django_tokenbucket.E013"]
        assert repr(next(iter(extra))) in messages[0].msg and "'ASYNC_COMMIT'" in messages[0].hint


@pytest.mark.parametrize("flag", ["FAST_PATH", "ASYNC_COMMIT"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_database_flags_must_be_bools_e014(flag, value):
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS={"DATABASE": "unreachable", flag: value})):
        messages = our_messages()
        assert ids(messages) == ["django_tokenbucket.E014"]
        assert repr(flag) in messages[0].msg and repr(value) in messages[0].msg


def test_database_flags_as_bools_are_fine():
    options = {"DATABASE": "unreachable", "FAST_PATH": False, "ASYNC_COMMIT": True}
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS=options)):
        assert our_messages() == []


@pytest.mark.parametrize("value", ["yes", "AUTO", 1, None])
def test_database_prepare_must_be_auto_or_a_bool_e014(value):
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS={"DATABASE": "unreachable", "PREPARE": value})):
        messages = our_messages()
        assert ids(messages) == ["django_tokenbucket.E014"]
        assert "'PREPARE'" in messages[0].msg and repr(value) in messages[0].msg


@pytest.mark.parametrize("value", ["auto", True, False])
def test_database_prepare_values_are_fine(value):
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS={"DATABASE": "unreachable", "PREPARE": value})):
        assert our_messages() == []


@pytest.mark.parametrize("value", [0, -1, float("nan"), float("inf"), True, "2", [2]])
def test_database_timeout_must_be_positive_seconds_e015(value):
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS={"DATABASE": "unreachable", "TIMEOUT": value})):
        messages = our_messages()
        assert ids(messages) == ["django_tokenbucket.E015"]
        assert "'TIMEOUT'" in messages[0].msg and repr(value) in messages[0].msg
        # Projects that skip the checks meet the same message at the first decision.
        with pytest.raises(ImproperlyConfigured, match=r"'TIMEOUT'.*positive number of seconds"):
            limiter.get_value("ten_per_minute", "k")


@pytest.mark.parametrize("value", [None, 0.5, 3])
def test_database_timeout_in_seconds_is_fine(value):
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS={"DATABASE": "unreachable", "TIMEOUT": value})):
        assert our_messages() == []


def test_non_sqlite_database_gives_no_w001():
    # 'unreachable' is a PostgreSQL alias; the check reads its vendor without connecting.
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS={"DATABASE": "unreachable"})):
        assert our_messages() == []


@pytest.mark.only_on("sqlite")  # needs the SQLite alias of the sqlite run
@pytest.mark.parametrize("mode", [None, "DEFERRED", "EXCLUSIVE"])
def test_sqlite_without_immediate_w001(monkeypatch, mode):
    connection = connections["default"]
    options = {k: v for k, v in connection.settings_dict.get("OPTIONS", {}).items() if k != "transaction_mode"}
    if mode is not None:
        options["transaction_mode"] = mode
    monkeypatch.setitem(connection.settings_dict, "OPTIONS", options)
    with override_settings(TOKENBUCKET=tokenbucket(OPTIONS={"DATABASE": "default"})):
        messages = our_messages()
        assert ids(messages) == ["django_tokenbucket.W001"]
        assert "'default'" in messages[0].msg
        assert "IMMEDIATE" in messages[0].hint


@pytest.mark.only_on("sqlite")  # needs the SQLite alias of the sqlite run
@pytest.mark.parametrize("mode", ["IMMEDIATE", "immediate"])
def test_sqlite_with_immediate_no_w001(monkeypatch, mode):
    connection = connections["default"]
    monkeypatch.setitem(
        connection.settings_dict, "OPTIONS", {**connection.settings_dict.get("OPTIONS", {}), "transaction_mode": mode}
    )
    assert our_messages() == []


class SubclassedDatabaseBackend(DatabaseBackend):
    """A project's own subclass: it keeps every check of the database backend."""


def test_a_database_backend_subclass_is_checked_as_one():
    path = f"{__name__}.SubclassedDatabaseBackend"
    with override_settings(TOKENBUCKET=tokenbucket(BACKEND=path, OPTIONS={"FAST_PATHH": True, "TIMEOUT": -1})):
        messages = our_messages()
    assert ids(messages) == ["django_tokenbucket.E013", "django_tokenbucket.E015"]
    assert "'FAST_PATHH'" in messages[0].msg and "SubclassedDatabaseBackend" in messages[0].msg


def test_every_backend_alias_is_checked_and_named():
    backends = {
        "default": {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend"},
        "fast": {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "nope"}},
        "billing": {"BACKEND": "django_tokenbucket.backends.database.DatabaseBackend", "OPTIONS": {"DATABASE": "x"}},
        "broken": {"BACKEND": "no.such.Backend"},
    }
    with override_settings(TOKENBUCKET={"BACKENDS": backends, "LIMITS": {"a": {"rate": "1/s", "backend": "fats"}}}):
        messages = {m.id: m.msg for m in our_messages()}
    assert messages["django_tokenbucket.E020"].startswith("TOKENBUCKET['BACKENDS']['fast']['OPTIONS']['CACHE'] = 'nope'")
    assert messages["django_tokenbucket.E009"].startswith("TOKENBUCKET['BACKENDS']['billing']['OPTIONS']['DATABASE']")
    assert messages["django_tokenbucket.E005"].startswith("TOKENBUCKET['BACKENDS']['broken']['BACKEND'] = 'no.such.Backend'")
    assert "Rate limit 'a' is stored on backend 'fats'" in messages["django_tokenbucket.E019"]


@pytest.mark.parametrize(
    ("setting", "problem"),
    [
        ({"BACKENDS": {"fast": {}}}, "with a 'default' alias"),
        ({"BACKENDS": {"default": {}}, "BACKEND": "x"}, "both BACKENDS and BACKEND/OPTIONS"),
        ({"BACKENDS": {"default": {"BACKNED": "x"}}}, "unknown key(s) 'BACKNED'"),
    ],
)
def test_a_malformed_backends_setting_is_e018(setting, problem):
    with override_settings(TOKENBUCKET={"LIMITS": BASE["LIMITS"], **setting}):
        messages = [m for m in our_messages() if m.id == "django_tokenbucket.E018"]
        assert len(messages) == 1 and problem in messages[0].msg
        with pytest.raises(ImproperlyConfigured, match=re.escape(problem)):
            limiter.limit("anything", config={"rate": "1/s"})


# ---------------------------------------------------------------------------------------
# ``manage.py check`` in a subprocess
# ---------------------------------------------------------------------------------------


def _manage_check(variant: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "DJANGO_SETTINGS_MODULE": "tests.broken_settings", "TOKENBUCKET_BROKEN": variant}
    env.pop("PYTHONWARNINGS", None)
    return subprocess.run(
        [sys.executable, "manage.py", "check"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_manage_py_check_fails_on_a_broken_limit():
    from tests.broken_settings import BROKEN_LIMIT_NAME

    result = _manage_check("limit")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "django_tokenbucket.E003" in output
    assert BROKEN_LIMIT_NAME in output
    assert "10/M" in output
    assert "Traceback" not in output


def test_manage_py_check_warns_about_sqlite_without_immediate():
    result = _manage_check("sqlite_deferred")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output  # a warning, not an error
    assert "django_tokenbucket.W001" in output
    assert "IMMEDIATE" in output


# ---------------------------------------------------------------------------------------
# Runtime: unknown names and bad configs raise, never silently allow (B10)
# ---------------------------------------------------------------------------------------


def test_unknown_limit_name_raises():
    for call in (
        lambda: limiter.limit("no_such_limit"),
        lambda: limiter.limit("no_such_limit", key="k", throws=True),
        lambda: limiter.check("no_such_limit", key="k"),
        lambda: limiter.get_value("no_such_limit", key="k"),
        lambda: limiter.reset("no_such_limit", key="k"),
        lambda: limiter.limit_many([("login", "k"), ("no_such_limit", "k")]),
    ):
        with pytest.raises(ImproperlyConfigured) as excinfo:
            call()
        assert "'no_such_limit'" in str(excinfo.value)


def test_limit_names_are_case_sensitive():
    with pytest.raises(ImproperlyConfigured, match="'LOGIN'"):
        limiter.limit("LOGIN", key="k")


@pytest.mark.parametrize(
    "config, bad",
    [
        ({"rate": "10/M"}, "10/M"),
        ("10/M", "10/M"),
        ("1e3/s", "1e3/s"),
        ({"rate": 10}, "10"),
        ({"rate": "5/m", "capacity": -1}, "-1"),
        ({"rate": "5/m", "capacity": float("inf")}, "inf"),
        ({"rate": "5/m", "bogus": 1}, "bogus"),
        ({"rate": "5/m", "capacity": [1]}, "[1]"),
        (42, "42"),
        (["5/m"], "['5/m']"),
    ],
    ids=repr,
)
def test_bad_inline_config_raises(config, bad):
    for call in (limiter.limit, limiter.check, limiter.get_value, limiter.reset):
        with pytest.raises(ImproperlyConfigured) as excinfo:
            call("inline_limit", key="k", config=config)
        message = str(excinfo.value)
        assert "'inline_limit'" in message and bad in message


def test_broken_settings_entry_raises_at_runtime():
    with override_settings(TOKENBUCKET=with_limits(signup="10/M")):
        with pytest.raises(ImproperlyConfigured, match="'signup'"):
            limiter.limit("signup", key="k")


BAD_COUNTS = [0, -1, -(10**9), float("nan"), float("inf"), True, Decimal("NaN"), 1e308, "1", None, 6, 5.0000001]


@pytest.mark.django_db(transaction=True)
def test_bad_count_raises_and_changes_nothing():
    from django_tokenbucket.models import RateLimit

    with frozen_clock() as clock:
        assert limiter.limit("login", key="k", count=2).value == 3
        before = list(RateLimit.objects.values_list("name", "key", "value", "ts"))
        clock.advance(1)  # any write would now carry a new timestamp
        value = limiter.get_value("login", key="k")
        for count in BAD_COUNTS:
            for call in (limiter.limit, limiter.check):
                with pytest.raises(ValueError) as excinfo:
                    call("login", key="k", count=count)
                assert "'login'" in str(excinfo.value)
            with pytest.raises(ValueError):
                limiter.limit_many([LimitRequest("ten_per_minute", "k"), LimitRequest("login", "k", count)])
            assert limiter.get_value("login", key="k") == value
        for reserve in (1, "yes", None):
            with pytest.raises(ValueError):
                limiter.limit("login", key="k", reserve=reserve)
        with pytest.raises(ValueError):
            limiter.limit("login", key=True)
        assert list(RateLimit.objects.values_list("name", "key", "value", "ts")) == before
        assert limiter.get_value("ten_per_minute", key="k") == 10


@pytest.mark.django_db(transaction=True)
def test_count_beyond_capacity_plus_max_reserved_raises():
    from django_tokenbucket.models import RateLimit

    with frozen_clock():
        assert limiter.limit("reservable", key="k", count=30, reserve=True).ok
        with pytest.raises(ValueError, match="'reservable'"):
            limiter.limit("reservable", key="k2", count=31, reserve=True)
        with pytest.raises(ValueError, match="'reservable'"):
            limiter.limit("reservable", key="k2", count=11)
    assert RateLimit.objects.count() == 1


# ---------------------------------------------------------------------------------------
# B11: the config changes while the state persists
# ---------------------------------------------------------------------------------------

BIG = {"kind": "token bucket", "rate": 100, "period": 60}  # capacity 100
SMALL = {"kind": "token bucket", "rate": 10, "period": 60}  # capacity 10
HALF_RATE = {"kind": "token bucket", "rate": 5, "period": 60, "capacity": 10}


@pytest.mark.django_db(transaction=True)
def test_capacity_shrinks_while_state_persists():
    with frozen_clock() as clock:
        status = limiter.limit("b11", key="k", count=20, config=BIG)
        assert status.ok and status.value == 80
        assert limiter.get_value("b11", key="k", config=BIG) == 80

        # The capacity drops from 100 to 10 with 80 tokens stored: they clamp to 10.
        assert limiter.get_value("b11", key="k", config=SMALL) == 10
        assert limiter.check("b11", key="k", count=10, config=SMALL).ok
        with pytest.raises(ValueError):
            limiter.check("b11", key="k", count=11, config=SMALL)
        status = limiter.limit("b11", key="k", count=10, config=SMALL)
        assert status.ok and status.value == 0
        assert status.retry_after is None

        denied = limiter.limit("b11", key="k", config=SMALL)
        assert not denied.ok
        assert denied.value == 0
        assert denied.retry_after is not None and denied.retry_after > 0
        assert denied.retry_after == pytest.approx(6.0)  # one token at 10 per minute
        assert isinstance(denied.retry_after_header, int) and denied.retry_after_header >= 1

        # Going back to the big config does not mint the clamped-away tokens.
        assert limiter.get_value("b11", key="k", config=BIG) <= 10
        clock.advance(denied.retry_after)
        assert limiter.limit("b11", key="k", config=SMALL).ok


@pytest.mark.django_db(transaction=True)
def test_rate_halved_while_state_persists():
    with frozen_clock() as clock:
        assert limiter.limit("b11_half", key="k", count=10, config=SMALL).value == 0
        clock.advance(3)  # half a token earned at the old rate

        denied = limiter.limit("b11_half", key="k", config=HALF_RATE)  # no ZeroDivisionError
        assert not denied.ok
        assert denied.retry_after is not None and denied.retry_after > 0
        assert isinstance(denied.retry_after_header, int) and denied.retry_after_header >= 1
        assert denied.reset_after is not None and denied.reset_after > 0
        # The wait is exact under the new rate: it succeeds then, and not a microsecond before.
        clock.advance(denied.retry_after - 0.000001)
        assert not limiter.check("b11_half", key="k", config=HALF_RATE).ok
        clock.advance(0.000001)
        assert limiter.limit("b11_half", key="k", config=HALF_RATE).ok

        # Tiny rates give long, finite, positive waits.
        tiny = {"kind": "token bucket", "rate": Decimal("0.000001"), "period": 86400, "capacity": 10}
        denied = limiter.limit("b11_half", key="k", count=5, config=tiny)
        assert not denied.ok and denied.retry_after > 0


@pytest.mark.django_db(transaction=True)
def test_fixed_window_shrinks_while_state_persists():
    big = {"kind": "fixed window", "rate": 100, "period": 60, "start": 0}
    small = {"kind": "fixed window", "rate": 10, "period": 60, "start": 0}
    with frozen_clock(1_700_000_010.0):
        assert limiter.limit("b11_window", key="k", count=20, config=big).value == 80
        assert limiter.get_value("b11_window", key="k", config=small) <= 10
        assert limiter.limit("b11_window", key="k", count=10, config=small).ok
        denied = limiter.limit("b11_window", key="k", config=small)
        assert not denied.ok and denied.retry_after > 0
        assert denied.retry_after_header >= 1
