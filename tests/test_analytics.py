"""Denial analytics (issue 31): what each process counts, what a flush writes, what the
store gives back, the memory bound, forks, the command's ``top`` and ``stats``, and the
log line per key that starts being denied.

On the database and Redis backends, through the real stores. Store writes are counted by
wrapping the real backend's ``write_analytics``, which still does the work.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import time
from io import StringIO

import pytest
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import CommandError
from django.db import connections
from django.test import RequestFactory, override_settings

from django_tokenbucket import analytics, limiter, logs
from django_tokenbucket.backends import get_backend
from django_tokenbucket.keys import encode_key

from . import views
from .concurrency import run_processes
from .settings import TOKENBUCKET as BASE_SETTINGS
from .test_conformance import store_overrides

LIMITS = {
    "login": {"rate": 3, "period": 60},
    "search": {"rate": 100, "period": 60},
    "shadowed": {"rate": 1, "period": 60, "shadow": True},
}
#: An hour between flushes: only the test's own ``flush()`` writes.
ANALYTICS = {"FLUSH": 3600, "TOP_KEYS": 5, "MAX_KEYS": 50}


def _settings(**more):
    return {**BASE_SETTINGS, "LIMITS": LIMITS, "ANALYTICS": ANALYTICS, **more}


@pytest.fixture(params=["database", "redis"])
def backend(request, transactional_db):
    overrides = store_overrides(request.param, request)
    with override_settings(TOKENBUCKET=_settings(**overrides)):
        yield request.param


@pytest.fixture
def writes(backend, monkeypatch):
    """The calls of the store's ``write_analytics`` (each one a write to the store)."""
    store = get_backend()
    made: list[tuple[int, int]] = []
    real = store.write_analytics

    def counted(minutes, keys):
        made.append((len(minutes), len(keys)))
        return real(minutes, keys)

    monkeypatch.setattr(store, "write_analytics", counted)
    return made


def _deny(key, times):
    """Call ``login`` for ``key`` until it has been denied ``times`` times; return the calls allowed."""
    allowed = denied = 0
    while denied < times:
        if limiter.limit("login", key).ok:
            allowed += 1
        else:
            denied += 1
    return allowed


# -- settings ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("yes", "must be None or a dict"),
        ({"FLUSH": 0}, "FLUSH'] must be a number of seconds from 0.1 to 3600"),
        ({"FLUSH": True}, "FLUSH'] must be a number"),
        ({"TOP_KEYS": -1}, "TOP_KEYS'] must be a whole number from 0 to 1000"),
        ({"TOP_KEYS": 10, "MAX_KEYS": 5}, "MAX_KEYS'] must be a whole number from TOP_KEYS (10)"),
        ({"FLUSHES": 1}, "unknown key(s) 'FLUSHES'"),
    ],
)
def test_a_malformed_setting_is_a_check_error_and_refused_at_use(value, problem):
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "ANALYTICS": value}):
        errors = [m for m in run_checks() if m.id == "django_tokenbucket.E053"]
        assert len(errors) == 1 and problem in errors[0].msg
        with pytest.raises(ImproperlyConfigured, match="ANALYTICS"):
            analytics.active()


def test_off_by_default_and_then_nothing_is_counted(db):
    assert analytics.active() is None
    assert not [m for m in run_checks() if m.id == "django_tokenbucket.E053"]
    limiter.limit("login", "alice")
    assert analytics.pending() == {}


# -- counting and flushing -----------------------------------------------------------


def test_a_flush_writes_what_the_decisions_were_once_per_store(backend, writes):
    before = analytics.current_minute()
    assert _deny("mallory", 4) == 3
    _deny("eve", 2)
    for _ in range(7):
        assert limiter.limit("search", "alice").ok
    assert analytics.pending() == {"login": {"allowed": 6, "denied": 6}, "search": {"allowed": 7, "denied": 0}}
    assert writes == []  # nothing written per decision

    assert analytics.flush() == 1
    assert len(writes) == 1
    assert analytics.pending() == {}
    rows = analytics.minutes("login", since=5)
    assert len(rows) == 5 and rows[-1].minute == analytics.current_minute()
    assert sum(row.allowed for row in rows) == 6 and sum(row.denied for row in rows) == 6
    assert {row.minute for row in rows if row.allowed or row.denied} <= {before, before + 1}
    top = analytics.denied_keys("login", since=5)
    assert [(key.digest, key.denied) for key in top] == [
        (encode_key("mallory").digest, 4),
        (encode_key("eve").digest, 2),
    ]
    # The database keeps a key's label; Redis keeps none (as for its buckets).
    assert [key.label for key in top] == (["mallory", "eve"] if backend == "database" else ["", ""])
    assert analytics.denied_keys("search", since=5) == []

    # Nothing new: a flush writes nothing.
    assert analytics.flush() == 0 and len(writes) == 1


def test_writes_stay_one_per_flush_however_many_decisions_and_keys(backend, writes):
    for index in range(300):
        limiter.limit("login", f"rotating-{index}")  # allowed: 300 keys, one call each
    for index in range(120):
        _deny(f"attacker-{index}", 1)  # 120 keys denied once, more than MAX_KEYS (50)
    analytics.flush()
    assert len(writes) == 1
    minute_rows, key_rows = writes[0]
    assert minute_rows <= 2  # one row per limit and minute (a minute may have turned)
    assert key_rows <= 2 * ANALYTICS["TOP_KEYS"]  # the top keys only
    rows = analytics.minutes("login", since=5)
    assert sum(row.allowed for row in rows) == 300 + 120 * 3
    assert sum(row.denied for row in rows) == 120


def test_shadow_denials_count_as_allowed_and_overrides_as_what_they_did(backend):
    for _ in range(3):
        assert limiter.limit("shadowed", "k").ok
    limiter.block("login", "blocked")
    limiter.exempt("login", "vip")
    for _ in range(2):
        assert not limiter.limit("login", "blocked").ok
        assert limiter.limit("login", "vip").ok
    assert analytics.pending() == {"shadowed": {"allowed": 3, "denied": 0}, "login": {"allowed": 2, "denied": 2}}


def test_a_limit_another_limit_refused_counts_nothing(backend):
    _deny("k", 1)
    result = limiter.limit_many([("search", "k"), ("login", "k")])
    assert not result.ok
    # search took nothing (all or nothing): it let nothing through, and refused nothing.
    assert analytics.pending() == {"login": {"allowed": 3, "denied": 2}}


def test_two_processes_flushes_add_up(backend):
    _deny("mallory", 2)
    analytics.flush()
    _deny("mallory", 3)  # denied from the store's answer or memory, counted all the same
    analytics.flush()
    assert sum(row.denied for row in analytics.minutes("login", since=5)) == 5
    assert analytics.denied_keys("login", since=5)[0].denied == 5


def _decide_and_flush(barrier, index, calls):
    barrier.wait()
    allowed = denied = 0
    for call in range(calls):
        if limiter.limit("search", f"shared-{call % 7}").ok:
            allowed += 1
        else:
            denied += 1
    analytics.flush()
    return {"allowed": allowed, "denied": denied}


@pytest.mark.concurrency
def test_the_stored_counts_are_the_sum_of_every_process_decisions(backend):
    # 4 processes x 60 calls on 7 shared keys of 5 tokens: 35 admitted in all, exactly.
    limits = {"search": {"rate": 5, "period": 3600}}
    with override_settings(TOKENBUCKET=_settings(**_current_store(), LIMITS=limits)):
        results = run_processes(_decide_and_flush, 4, 60)
        assert sum(r["allowed"] for r in results) == 35
        rows = analytics.minutes("search", since=5)
        assert sum(row.allowed for row in rows) == 35
        assert sum(row.denied for row in rows) == 4 * 60 - 35


def _current_store():
    from django.conf import settings

    return {name: settings.TOKENBUCKET[name] for name in ("BACKEND", "OPTIONS") if name in settings.TOKENBUCKET}


def test_memory_is_bounded_under_key_rotation_and_a_heavy_key_keeps_its_count(backend):
    settings = analytics.active()
    store = get_backend()
    heavy = encode_key("heavy").digest
    for index in range(5000):
        analytics.record_denied(settings, store, "login", encode_key(f"one-off-{index}").digest, "")
        if index % 10 == 0:
            analytics.record_denied(settings, store, "login", heavy, "")
    counted = [keys for per_minute in analytics._keys.values() for keys in per_minute.values()]
    assert counted and all(len(keys.counts) <= ANALYTICS["MAX_KEYS"] for keys in counted)
    analytics.flush()
    top = analytics.denied_keys("login", since=5, limit=1)
    assert (top[0].digest, top[0].denied) == (heavy, 500)


def test_a_store_that_fails_keeps_the_counts_for_the_next_flush(backend, monkeypatch, caplog):
    from django_tokenbucket.backends.base import BackendError

    _deny("mallory", 2)
    store = get_backend()
    real = store.write_analytics

    def down(minutes, keys):
        raise BackendError("the store is down")

    monkeypatch.setattr(store, "write_analytics", down)
    with caplog.at_level(logging.WARNING, "django_tokenbucket"):
        assert analytics.flush() == 0
    assert "could not be written" in caplog.text and "kept for the next flush" in caplog.text
    assert analytics.pending()["login"]["denied"] == 2
    monkeypatch.setattr(store, "write_analytics", real)
    assert analytics.flush() == 1
    assert sum(row.denied for row in analytics.minutes("login", since=5)) == 2


def test_the_flusher_thread_writes_within_flush_seconds(backend):
    with override_settings(TOKENBUCKET=_settings(**_current_store(), ANALYTICS={"FLUSH": 0.2})):
        _deny("mallory", 1)
        deadline = time.monotonic() + 10
        while not analytics.denied_keys("login", since=5) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [key.denied for key in analytics.denied_keys("login", since=5)] == [1]
        assert analytics.pending() == {}


def _child_counts(connection):
    try:
        pending_at_fork = analytics.pending()
        _deny("child", 1)
        analytics.flush()
        connection.send({"at_fork": pending_at_fork, "after": analytics.pending()})
    finally:
        connections.close_all()


def test_a_forked_child_starts_with_nothing_counted_and_flushes_its_own(backend):
    _deny("parent", 1)
    parents = analytics.pending()
    connections.close_all()
    context = multiprocessing.get_context("fork")
    parent, child = context.Pipe()
    process = context.Process(target=_child_counts, args=(child,))
    process.start()
    assert parent.poll(60)
    report = parent.recv()
    process.join(30)
    assert report == {"at_fork": {}, "after": {}}
    assert analytics.pending() == parents  # the parent's counts are the parent's to write
    analytics.flush()
    top = {key.digest: key.denied for key in analytics.denied_keys("login", since=5)}
    assert top == {encode_key("parent").digest: 1, encode_key("child").digest: 1}


@pytest.mark.parametrize(
    ("since", "limit", "problem"),
    [(0, 5, "span the last 1 to 60 minutes"), (61, 5, "span the last 1 to 60 minutes"), (5, 0, ">= 1")],
)
def test_reading_bad_spans_names_the_limit(backend, since, limit, problem):
    with pytest.raises(ValueError, match=f"rate limit 'login': .*{problem}"):
        analytics.denied_keys("login", since=since, limit=limit)


def test_reading_an_unknown_limit_says_so(backend):
    with pytest.raises(ValueError, match="unknown rate limit 'nope'"):
        analytics.minutes("nope")


# -- the command ---------------------------------------------------------------------


def _command(*args):
    out = StringIO()
    call_command("tokenbucket", *args, stdout=out)
    return out.getvalue()


def test_top_prints_the_most_denied_keys(backend):
    _deny("mallory", 3)
    _deny("eve\x1b[2J", 1)  # a client's key with a terminal escape
    analytics.flush()
    out = _command("top", "login", "--since", "10m")
    lines = out.splitlines()
    assert "the most denied keys of the last 10 min" in lines[0]
    assert lines[1].startswith("  1. 3 denied  " + encode_key("mallory").digest[:16])
    assert lines[2].startswith("  2. 1 denied  " + encode_key("eve\x1b[2J").digest[:16])
    assert "\x1b" not in out
    if backend == "database":  # the stored label, its escape already escaped
        assert lines[1].endswith("  mallory") and lines[2].endswith("  eve\\x1b[2J")
    data = json.loads(_command("top", "login", "--json", "--limit", "1"))
    assert data == {"name": "login", "minutes": 60, "keys": [
        {"digest": encode_key("mallory").digest, "label": "mallory" if backend == "database" else "", "denied": 3}
    ]}


def test_stats_prints_each_limit_and_one_limit_minute_by_minute(backend):
    _deny("mallory", 2)
    for _ in range(4):
        limiter.limit("search", "alice")
    analytics.flush()
    out = _command("stats")
    assert "Calls of the last 60 min" in out
    login = next(line for line in out.splitlines() if line.startswith("login "))
    assert login.split() == ["login", "3", "2", "40.0"]
    search = next(line for line in out.splitlines() if line.startswith("search "))
    assert search.split() == ["search", "4", "0", "0.0"]

    out = _command("stats", "login", "--since", "5m")
    assert out.splitlines()[0].startswith("login: 3 allowed, 2 denied in the last 5 min")
    assert len(out.splitlines()) == 2 + 5
    data = json.loads(_command("stats", "login", "--since", "1h", "--every", "30m", "--json"))
    assert data["every_minutes"] == 30 and len(data["rows"]) == 2
    assert sum(row["denied"] for row in data["rows"]) == 2


@pytest.mark.parametrize(
    ("args", "problem"),
    [
        (("top", "login", "--since", "2h"), "longer than the 1h"),
        (("top", "login", "--since", "soon"), "is not a duration"),
        (("top", "login", "--limit", "0"), "--limit must be from 1 to 1000"),
        (("stats", "--since", "2d"), "longer than the 24h"),
        (("top", "nope"), "unknown rate limit 'nope'"),
    ],
)
def test_the_command_refuses_bad_input_clearly(backend, args, problem):
    with pytest.raises(CommandError, match=problem):
        _command(*args)


def test_the_command_says_how_to_turn_analytics_on(db):
    with pytest.raises(CommandError, match=r"analytics are off: set TOKENBUCKET\['ANALYTICS'\]"):
        _command("top", "login")


# -- the log line per key that starts being denied -----------------------------------


@pytest.fixture
def info(caplog):
    with caplog.at_level(logging.INFO, "django_tokenbucket"):
        yield caplog


def _started(caplog):
    return [record for record in caplog.records if "started denying" in record.getMessage()]


def test_one_line_per_key_that_starts_being_denied(backend, info):
    with override_settings(TOKENBUCKET=_settings(**_current_store(), LOG_INTERVAL=0)):
        _deny("mallory", 5)
        _deny("eve", 2)
        lines = _started(info)
        assert len(lines) == 2
        assert "rate limit 'login' started denying key 'mallory'" in lines[0].getMessage()
        assert lines[0].tokenbucket_limit == "login"
        assert lines[0].tokenbucket_digest == encode_key("mallory").digest[:12]
        assert lines[0].tokenbucket_path is None


def test_a_rotation_of_keys_gives_one_line_per_log_interval(backend, info):
    with override_settings(TOKENBUCKET=_settings(**_current_store(), LOG_INTERVAL=3600)):
        for index in range(20):
            _deny(f"rotating-{index}", 1)
        assert len(_started(info)) == 1


def test_the_line_names_the_path_escaped(backend, info):
    with override_settings(TOKENBUCKET=_settings(**_current_store(), LOG_INTERVAL=0)):
        hostile = "/inline-ip/%0ACRITICAL%20forged%20line"  # the request's path decodes %0A
        statuses = [views.inline_ip(RequestFactory().get(hostile, REMOTE_ADDR="192.0.2.9")).status_code for _ in range(3)]
        assert statuses == [200, 200, 429]
        (line,) = _started(info)
        message = line.getMessage()
        assert "\n" not in message and "'/inline-ip/\\nCRITICAL forged line'" in message
        assert line.tokenbucket_path == "/inline-ip/\nCRITICAL forged line"


def test_nothing_is_tracked_while_info_is_not_logged(backend):
    assert not logs.denial_log.enabled()
    _deny("mallory", 3)
    assert not logs.denial_log._spells
