"""Signals fire exactly once per decision; store-failure warnings are rate-limited; shadow
mode denies nothing and signals what enforcement would deny (RELIABILITY-PLAN H8)."""

from __future__ import annotations

import logging
import random
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from django.conf import settings
from django.db import connections
from django.test import override_settings

from django_tokenbucket import BackendUnavailable, limiter, logs, signals
from django_tokenbucket.testing import frozen_clock

from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True, databases=["default", "unreachable"])

T0 = 1_700_000_000.0
SHADOW = {"rate": "1/m", "shadow": True}


@contextmanager
def recorded() -> Iterator[list[tuple[str, dict]]]:
    """Record every signal of django_tokenbucket.signals, in order, with its arguments."""
    seen: list[tuple[str, dict]] = []
    receivers = {}
    for name in ("rate_limit_allowed", "rate_limit_denied", "rate_limit_backend_error"):

        def receiver(sender, _name=name, **kwargs):
            kwargs.pop("signal")
            seen.append((_name, kwargs))

        receivers[name] = receiver
        getattr(signals, name).connect(receiver)
    try:
        yield seen
    finally:
        for name, receiver in receivers.items():
            getattr(signals, name).disconnect(receiver)


def kinds(seen: list[tuple[str, dict]]) -> list[tuple[str, str]]:
    return [(kind, args.get("name") or ",".join(args["names"])) for kind, args in seen]


def test_allowed_and_denied_calls_send_one_signal_each():
    with frozen_clock(T0), recorded() as seen:
        limiter.limit("login", "k", count=4)
        limiter.limit("login", "k", count=2)
    assert kinds(seen) == [("rate_limit_allowed", "login"), ("rate_limit_denied", "login")]
    allowed, denied = seen[0][1], seen[1][1]
    assert allowed["key"] == "k" and allowed["count"] == 4 and allowed["status"].ok
    assert denied["count"] == 2 and not denied["status"].ok and denied["shadow"] is False


def test_checks_and_reads_send_nothing():
    with frozen_clock(T0), recorded() as seen:
        limiter.check("login", "k")
        limiter.get_value("login", "k")
        limiter.reset("login", "k")
    assert seen == []


def test_shadow_mode_reports_would_deny_once():
    with frozen_clock(T0), recorded() as seen:
        first = limiter.limit("shadowed", "k", config=SHADOW)
        second = limiter.limit("shadowed", "k", config=SHADOW)
    assert first.ok and second.ok and second.would_deny
    assert kinds(seen) == [("rate_limit_allowed", "shadowed"), ("rate_limit_denied", "shadowed")]
    assert seen[1][1]["shadow"] is True


def test_several_limits_send_one_signal_per_limit():
    with frozen_clock(T0), recorded() as seen:
        limiter.limit_many([("login", "k"), ("ten_per_minute", "k")])
    assert kinds(seen) == [("rate_limit_allowed", "login"), ("rate_limit_allowed", "ten_per_minute")]


def test_an_all_or_nothing_denial_reports_no_allowance():
    """When one limit denies, nothing is consumed: the others were not "allowed" either."""
    with frozen_clock(T0):
        limiter.limit("ten_per_minute", "k", count=10)
        with recorded() as seen:
            result = limiter.limit_many([("login", "k"), ("ten_per_minute", "k")])
        assert not result.ok and limiter.get_value("login", "k") == 5
    assert kinds(seen) == [("rate_limit_denied", "ten_per_minute")]


def test_drf_throttles_of_one_view_signal_once_per_limit(client):
    # Two throttles (anon and user scopes): DRF asks each, the limiter decides them together.
    with frozen_clock(T0), recorded() as seen:
        assert client.get("/api/default/").status_code == 200
    assert sorted(kinds(seen)) == [("rate_limit_allowed", "anon"), ("rate_limit_allowed", "user")]


def test_decorated_view_signals_once_per_request(client):
    with frozen_clock(T0), recorded() as seen:
        for _ in range(3):
            client.get("/inline-ip/")  # 2 per minute
    assert [kind for kind, _ in seen] == ["rate_limit_allowed", "rate_limit_allowed", "rate_limit_denied"]


# -- store failures ------------------------------------------------------------------------


@pytest.fixture
def failing_store():
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "OPTIONS": {"DATABASE": "unreachable"}, "RETRY_ATTEMPTS": 1}):
        yield
    connections["unreachable"].close()


def test_a_store_failure_signals_once_per_call(failing_store):
    with recorded() as seen:
        with pytest.raises(BackendUnavailable):
            limiter.limit_many([("login", "k"), ("ten_per_minute", "k")])
    [(kind, args)] = seen
    assert kind == "rate_limit_backend_error"
    assert args["names"] == ["login", "ten_per_minute"] and args["fail_open"] is False
    assert args["exception"] is not None


def test_failing_open_signals_the_error_and_the_allowance(failing_store):
    with override_settings(TOKENBUCKET={**settings.TOKENBUCKET, "FAIL_OPEN": True}), recorded() as seen:
        status = limiter.limit("login", "k")
    assert status.ok and status.failed_open
    assert [kind for kind, _ in seen] == ["rate_limit_backend_error", "rate_limit_allowed"]
    assert seen[0][1]["fail_open"] is True and seen[1][1]["status"].failed_open


@pytest.fixture
def fake_time(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(logs, "_clock", lambda: now[0])
    return now


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "django_tokenbucket" and r.levelno == logging.WARNING]


def test_store_failure_warnings_are_rate_limited_per_limit(failing_store, fake_time, caplog):
    with override_settings(TOKENBUCKET={**settings.TOKENBUCKET, "FAIL_OPEN": True}):
        with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
            for _ in range(5):
                limiter.limit("login", "k")
            limiter.limit("ten_per_minute", "k")  # another limit has its own allowance
            fake_time[0] += 9.9
            limiter.limit("login", "k")  # still within 10 s: held back
            fake_time[0] += 0.1
            limiter.limit("login", "k")
    messages = warnings_of(caplog)
    assert len(messages) == 3
    assert "'login'" in messages[0] and "suppressed" not in messages[0]
    assert "'ten_per_minute'" in messages[1]
    assert messages[2].endswith("(5 similar messages suppressed in the last 10 s)")


def test_log_interval_is_configurable(failing_store, fake_time, caplog):
    with override_settings(TOKENBUCKET={**settings.TOKENBUCKET, "FAIL_OPEN": True, "LOG_INTERVAL": 0}):
        with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
            for _ in range(3):
                limiter.limit("login", "k")
    assert len(warnings_of(caplog)) == 3
    with override_settings(TOKENBUCKET={**settings.TOKENBUCKET, "FAIL_OPEN": True, "LOG_INTERVAL": 60}):
        with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
            caplog.clear()
            limiter.limit("login", "k")
            fake_time[0] += 30
            limiter.limit("login", "k")
            fake_time[0] += 30
            limiter.limit("login", "k")
    messages = warnings_of(caplog)
    assert len(messages) == 2 and messages[1].endswith("(1 similar message suppressed in the last 60 s)")


def test_fail_closed_warnings_are_rate_limited_too(failing_store, fake_time, caplog):
    with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
        for _ in range(4):
            with pytest.raises(BackendUnavailable):
                limiter.limit("login", "k")
    [message] = warnings_of(caplog)
    assert "fail closed" in message


def test_log_interval_is_a_known_setting():
    from django_tokenbucket.checks import check_settings
    from django_tokenbucket.settings import DEFAULTS

    assert DEFAULTS["LOG_INTERVAL"] == 10
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "LOG_INTERVAL": 30}):
        assert [m.id for m in check_settings()] == []


# ---------------------------------------------------------------------------------------
# H8: shadow mode replays a trace with the enforced run's denials as would-deny
# ---------------------------------------------------------------------------------------


def figure(line: str) -> None:
    print(f"\n{line}")


def test_h8_shadow_mode_would_deny_equals_enforced_denials():
    rng = random.Random(8)
    trace = [(rng.choice([0, 0, 0.5, 1, 2, 6, 13]), rng.randint(1, 3)) for _ in range(120)]
    config = {"rate": 10, "period": 60, "capacity": 5}
    denied_signals = {"enforced": 0, "shadow": 0}

    def count(sender, name, shadow, **kwargs):
        denied_signals["shadow" if shadow else "enforced"] += 1

    def replay(name: str, spec: dict) -> list[tuple[bool, bool, float]]:
        outcomes = []
        with frozen_clock(T0) as clock:
            for dt, n in trace:
                clock.advance(dt)
                status = limiter.limit(name, "k", count=n, config=spec)
                outcomes.append((status.ok, status.would_deny, status.value))
        return outcomes

    signals.rate_limit_denied.connect(count)
    try:
        enforced = replay("h8-enforced", config)
        shadow = replay("h8-shadow", {**config, "shadow": True})
    finally:
        signals.rate_limit_denied.disconnect(count)
    denied = [i for i, (ok, _, _) in enumerate(enforced) if not ok]
    would_deny = [i for i, (_, would, _) in enumerate(shadow) if would]
    assert all(ok for ok, _, _ in shadow)  # shadow mode never denies
    assert denied and would_deny == denied
    assert [v for _, _, v in shadow] == [v for _, _, v in enforced]  # and keeps the same state
    assert denied_signals == {"enforced": len(denied), "shadow": len(denied)}
    figure(
        f"H8 {settings.DB}: {len(trace)} requests, enforced denied {len(denied)}, shadow would_deny {len(would_deny)}, shadow denied 0"
    )
