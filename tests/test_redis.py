"""What only the Redis backend does: the Lua script's arithmetic, keys, TTLs, NOSCRIPT,
failures of a real Redis, system checks, and exactness under several processes.

The shared behaviour is in test_conformance.py (its ``redis`` param). Servers that a
test breaks (stops, pauses, restarts, fills) are redis-server processes it starts on a
port of its own (tests/redis_servers.py); nothing is mocked.
"""

from __future__ import annotations

import hashlib
import logging
import math
import socket
import time
from contextlib import contextmanager
from dataclasses import FrozenInstanceError, replace
from functools import partial
from importlib import resources

import pytest
import redis
from django.conf import settings
from django.core.cache import caches
from django.core.checks import run_checks
from django.core.exceptions import ImproperlyConfigured
from django.test import override_settings
from hypothesis import event, given
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry

from django_tokenbucket import BackendUnavailable, LimitRequest, limiter
from django_tokenbucket.algorithms import MAX_AMOUNT, MICRO, Decision, State
from django_tokenbucket.api import Limiter
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.base import BUSY_WINDOW, BackendError, Outcome, Request
from django_tokenbucket.backends.redis import BIGNUM_MARKER, SCRIPT, RedisBackend, state_key
from django_tokenbucket.backends.redis import spares as spares_module
from django_tokenbucket.backends.redis.connections import may_have_run, packed_read
from django_tokenbucket.backends.redis.keyspace import cursor_carries_slot, scanned_fraction
from django_tokenbucket.backends.redis.script import MAX_TTL_MS, as_msgpack, fast_decision, fast_outcome, reply_outcome
from django_tokenbucket.keys import encode_key
from django_tokenbucket.limits import FIXED_WINDOW, LimitConfig, parse_limit
from django_tokenbucket.testing import frozen_clock

from . import parity
from .concurrency import hammer, run_processes, sized, summarise
from .parity import ALICE, ONE_PER_SECOND
from .redis_servers import RedisServer, delete_keys, keys_without_ttl, once_answered, other_keys
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.redis

T0 = 1_700_000_000.0
T0_US = int(T0 * MICRO)
REDIS_BACKEND = "django_tokenbucket.backends.redis.RedisBackend"


@pytest.fixture
def backend(redis_store):
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, **redis_store}):
        backend = get_backend()
        assert isinstance(backend, RedisBackend)
        yield backend


def stored_state(backend: RedisBackend, config: LimitConfig, key) -> State | None:
    raw = backend.client().get(backend.key(config, encode_key(key)))
    if raw is None:
        return None
    value, ts = raw.split()
    return State(int(value), int(ts))


def our_keys(backend: RedisBackend) -> str:
    return f"{caches[backend.cache_alias].key_prefix}:*"


# ---------------------------------------------------------------------------------------
# Parity: the Lua script and the Python algorithms agree on every generated trace
# ---------------------------------------------------------------------------------------


def replay(backend: RedisBackend, start: int, trace, note=lambda label: None) -> None:
    delete_keys()
    client = backend.client()

    def stored(request: Request) -> State | None:
        key = backend.key(request.config, request.key)
        raw = client.get(key)
        if raw is None:
            return None
        assert client.pttl(key) > 0, f"{key} has no TTL"
        return State(*map(int, raw.split()))

    parity.replay(lambda requests, apply: backend.decide(requests, apply=apply), stored, start, trace, note)


class ScriptOnly(RedisBackend):
    """Every decision by the script, which the parity tests hold to the Python algorithms."""

    def _reads_first(self, requests, apply):
        return False


class ReadsFirst(RedisBackend):
    """Every decision of one limit read first, as a key denied lately is: a denial or a
    check decided from GET and TIME, what writes handed to the script."""

    def _reads_first(self, requests, apply):
        return len(requests) == 1


@pytest.fixture(params=[ScriptOnly, ReadsFirst], ids=["script", "read first"])
def deciding(request, backend):
    return request.param(backend.options)


@parity.PARITY
@given(parity.traces())
def test_lua_and_python_agree_on_every_decision(deciding, case):
    """Decisions, values, retry_after, full_after and stored states, bit for bit."""
    replay(deciding, *case, note=event)  # statistics: pytest --hypothesis-show-statistics


@parity.PARITY
@given(parity.near_ties())
def test_lua_and_python_agree_on_near_ties(deciding, case):
    replay(deciding, *case)


@pytest.mark.parametrize("config, trace", parity.BEYOND_53_BITS, ids=parity.BEYOND_53_BITS_IDS)
def test_lua_and_python_agree_beyond_53_bits(deciding, config, trace):
    replay(deciding, T0_US, parity.beyond_53_bits_trace(config, trace))


def test_lua_and_python_agree_when_a_window_moves(deciding):
    """A window stored under one start and period, decided under others, realigns alike."""
    replay(deciding, T0_US, parity.window_move_trace())


def test_lua_and_python_agree_at_the_clock_skew_tolerance(deciding):
    replay(deciding, T0_US, parity.clock_skew_trace())


class CountingScripts(RedisBackend):
    """The backend, counting the scripts it runs (each still runs)."""

    scripts = 0

    def _run(self, connection, keys, argv, deadline=None):
        self.scripts += 1
        return super()._run(connection, keys, argv, deadline)


@pytest.fixture
def counting(backend):
    return CountingScripts(backend.options)


def test_a_key_denied_lately_is_denied_from_one_read_without_the_script(counting, without_deny_cache):
    own = Limiter(counting)
    client = counting.client()
    with frozen_clock(T0) as clock:
        for _ in range(5):
            assert own.limit("login", "flood").ok
        assert (counting.scripts, counting.reads["sent"]) == (5, 0)
        # The last admission left the bucket empty: its next calls are likely denied.
        key = counting.key(own.resolve("login"), encode_key("flood"))
        stored, ttl = client.get(key), client.pttl(key)
        denials = [own.limit("login", "flood") for _ in range(20)]
        assert counting.scripts == 5 and counting.reads == {"sent": 20, "decided": 20}
        assert all(not d.ok and d.retry_after == 12.0 and d.value == 0 for d in denials)
        assert client.get(key) == stored and client.pttl(key) <= ttl  # nothing written
        clock.advance(12)  # one token back: the read sees an admission, which the script makes
        admitted = own.limit("login", "flood")
        assert admitted.ok and admitted.value == 0
        assert counting.scripts == 6 and counting.reads == {"sent": 21, "decided": 20}
        # A check never writes: it is read, whether or not the key was denied lately.
        assert own.check("login", "never-denied").value == 4
        assert counting.scripts == 6 and counting.reads["decided"] == 21


@pytest.mark.parametrize("key", ["tb:1:tb:login|{9f8e}", "k" * 300, ""])
def test_a_read_is_sent_as_redis_py_packs_it(key):
    for commands in ([("GET", key), ("TIME",)], [("GET", key)]):
        assert b"".join(packed_read(commands)) == b"".join(redis.Connection().pack_commands(commands))
    assert packed_read([("GET", key + "é"), ("TIME",)]) is None  # the client's encoding packs it


def test_a_key_prefix_beyond_ascii_is_read_first_through_the_clients_packing(backend, without_deny_cache):
    prefix = f"{settings.REDIS_KEY_PREFIX}-clé"
    caches_now = {**settings.CACHES, "redis": {**settings.CACHES["redis"], "KEY_PREFIX": prefix}}
    with override_settings(CACHES=caches_now):
        counting = CountingScripts(backend.options)
        own = Limiter(counting)
        try:
            statuses = [own.limit("login", "accent") for _ in range(8)]
            assert [s.ok for s in statuses] == [True] * 5 + [False] * 3
            assert counting.scripts == 5 and counting.reads == {"sent": 3, "decided": 3}
        finally:
            counting.client().delete(counting.key(own.resolve("login"), encode_key("accent")))


def test_a_key_reset_elsewhere_is_admitted_at_once(counting, without_deny_cache):
    """Reading first is a guess of the path only: a reset by another process counts at once."""
    own = Limiter(counting)
    with frozen_clock(T0):
        for _ in range(6):
            own.limit("login", "reset")
        counting.client().delete(counting.key(own.resolve("login"), encode_key("reset")))
        assert own.limit("login", "reset").value == 4
        assert counting.reads == {"sent": 2, "decided": 1}  # the 6th call, then an admission


# The script's two paths: the common one in plain doubles, and the general one (bignum.lua).
# A script cut at the marker where bignum.lua is joined runs the common path alone and
# answers "general path" where the whole script would go on: the boundary is seen exactly.

COMMON_PATH_ONLY = (
    resources.files("django_tokenbucket.backends.redis").joinpath("lua", "decide.lua").read_text(encoding="utf-8").partition(BIGNUM_MARKER)[0]
    + 'return redis.error_reply("django_tokenbucket: the general path")\n'
)


class CommonPathOnly(RedisBackend):
    def _run(self, connection, keys, argv, deadline=None):
        return connection.client.execute_command("EVAL", COMMON_PATH_ONLY, len(keys), *keys, *argv)


@pytest.fixture
def common_only(backend):
    return CommonPathOnly(backend.options)


M53 = MAX_AMOUNT  # 2^53
#: (id, config, trace of (dt, [(count, reserve)]), start time, whether the common path
#: decides the last step; every earlier step it decides).
PATHS = [
    ("capacity-2^53-1", parity._config(rate=M53 - 1, period=1, capacity=M53 - 1), [(0, [(M53 - 1, False)])], T0_US, True),
    ("capacity-2^53", parity._config(rate=M53, period=1, capacity=M53), [(0, [(M53, False)])], T0_US, False),
    # full_after multiplies the deficit by the period: just below, and at 2^53.
    ("wait-product-below", parity._config(rate=1, period=2**27, capacity=2**26 - 1), [(0, [(2**26 - 1, False)])], T0_US, True),
    ("wait-product-at", parity._config(rate=1, period=2**27, capacity=2**26), [(0, [(2**26, False)])], T0_US, False),
    # A partial refill after a long idle time: rate * elapsed just below and at 2^53.
    (
        "refill-product-below",
        parity._config(rate=2**26, period=2**27, capacity=2**26 - 1),
        [(0, [(2**26 - 1, False)]), (2**27 - 1, [(1, False)])],
        T0_US,
        True,
    ),
    # A deep debt (uncapped reservations) and a wait far past 2^53 µs from now: the common
    # path, until the value itself passes -2^53.
    ("debt-below", parity._config(rate=1, period=1, capacity=1), [(0, [(M53 - 1, True)])], T0_US, True),
    ("debt-past", parity._config(rate=1, period=1, capacity=1), [(0, [(M53 - 1, True)]), (0, [(M53 - 1, True)])], T0_US, False),
    # A fresh or long idle bucket: rate * elapsed far past 2^53 is known full without it.
    ("idle-huge-product", parity._config(rate=M53 - 1, period=1, capacity=3), [(0, [(3, False)]), (2**52, [(2, False)])], T0_US, True),
    # The clock itself: just below 2^53 µs, then at it.
    ("now-2^53", parity._config(rate=MICRO, period=MICRO, capacity=MICRO), [(0, [(1, False)]), (1, [(1, False)])], M53 - 1, False),
    (
        "window-below",
        parity._config(FIXED_WINDOW, rate=M53 - 1, period=M53 - 1, capacity=M53 - 1, start=0),
        [(0, [(M53 - 1, False)]), (5, [(1, False)])],
        T0_US,
        True,
    ),
    (
        "window-debt-past",
        parity._config(FIXED_WINDOW, rate=1, period=1, capacity=1, start=0),
        [(0, [(M53 - 1, True)]), (1, [(M53 - 1, True)])],
        T0_US,
        False,
    ),
]


@pytest.mark.parametrize("config, trace, start, common", [case[1:] for case in PATHS], ids=[case[0] for case in PATHS])
def test_the_common_path_stops_exactly_where_doubles_stop_being_exact(backend, common_only, config, trace, start, common):
    """Below 2^53 the common path decides as Python does; at or past it, the general path does."""
    steps = parity.beyond_53_bits_trace(config, trace)
    replay(backend, start, steps)  # the whole script: Python's results either way
    if common:
        replay(common_only, start, steps)
    else:
        replay(common_only, start, steps[:-1])
        with pytest.raises(BackendError, match="the general path"):
            replay(common_only, start, steps)


def test_the_general_path_decides_one_limit_as_the_common_path_does(backend):
    """The general path also takes single requests (past 2^53): on small numbers too, it agrees."""
    general_only = SCRIPT.replace("if #ARGV == 3 and #KEYS == 1 then", "if false then", 1)
    assert general_only != SCRIPT

    class GeneralPathOnly(RedisBackend):
        def _run(self, connection, keys, argv, deadline=None):
            return connection.client.execute_command("EVAL", general_only, len(keys), *keys, *argv)

    config = parity._config(rate=5 * MICRO, period=MICRO, capacity=10 * MICRO, max_reserved=3 * MICRO)
    window = parity._config(FIXED_WINDOW, rate=5 * MICRO, period=10 * MICRO, capacity=8 * MICRO)
    trace = [
        (0, [Request(config, ALICE, 9 * MICRO)], True),
        (123_457, [Request(config, ALICE, 3 * MICRO, True)], True),
        (1, [Request(config, ALICE, MICRO, True)], True),
        (-3 * MICRO, [Request(window, ALICE, 7 * MICRO)], True),
        (MICRO, [Request(window, ALICE, 2 * MICRO)], True),
        (20 * MICRO, [Request(window, ALICE, 0)], False),
    ]
    replay(GeneralPathOnly(backend.options), T0_US, trace)


# ---------------------------------------------------------------------------------------
# Keys and TTLs
# ---------------------------------------------------------------------------------------


def test_keys_use_the_cache_key_function_and_hash_tag_the_key(backend):
    config = parse_limit("ten_per_minute", BASE_SETTINGS["LIMITS"]["ten_per_minute"])
    digest = encode_key("alice").digest
    expected = f"{settings.REDIS_KEY_PREFIX}:1:tokenbucket:ten_per_minute:{{{digest[:16]}}}{digest[16:]}"
    assert backend.key(config, encode_key("alice")) == expected
    with override_settings(CACHES={**settings.CACHES, "redis": {**settings.CACHES["redis"], "VERSION": 7}}):
        assert backend.key(config, encode_key("alice")) == expected.replace(":1:", ":7:", 1)
    with frozen_clock(T0):
        limiter.limit("ten_per_minute", "alice", count=3)
    assert backend.client().get(expected) == f"7000000 {T0_US}".encode()


@pytest.mark.parametrize("name", ["with space", "a{b}c", "x" * 65, "ümlaut", "colon:name", "~tilde"])
def test_other_names_are_hashed_and_stay_distinct(name):
    raw = state_key(replace(ONE_PER_SECOND, name=name), ALICE)
    digest = hashlib.sha256(name.encode()).hexdigest()
    assert raw == f"tokenbucket:~{digest}:{{{ALICE.digest[:16]}}}{ALICE.digest[16:]}"
    # The one brace pair is the hash tag, whatever the name holds.
    assert raw.count("{") == raw.count("}") == 1
    tilde, plain = replace(ONE_PER_SECOND, name="~tilde"), replace(ONE_PER_SECOND, name="tilde")
    assert state_key(tilde, ALICE) != state_key(plain, ALICE)


def test_every_written_key_expires_when_its_bucket_is_full_again(backend):
    """TTL == time until full (ceiling, in ms), measured on Redis' own clock."""
    client = backend.client()
    status = limiter.limit("ten_per_minute", "ttl", count=3)  # full again in 18 s
    key = backend.key(limiter.resolve("ten_per_minute"), encode_key("ttl"))
    assert status.reset_after == pytest.approx(18.0)
    assert 17_000 < client.pttl(key) <= 18_000
    window = limiter.limit("window", "ttl")  # 5 per minute, windows on the minute
    window_key = backend.key(limiter.resolve("window"), encode_key("ttl"))
    assert 0 < client.pttl(window_key) <= math.ceil(window.reset_after * 1000) <= 60_000
    reserved = limiter.limit("reservable", "ttl", count=30, reserve=True)  # -20: full in 30 s
    reserved_key = backend.key(limiter.resolve("reservable"), encode_key("ttl"))
    assert reserved.reset_after == pytest.approx(30.0)
    assert 29_000 < client.pttl(reserved_key) <= 30_000


def test_a_denial_and_a_check_write_nothing(backend):
    client = backend.client()
    limiter.limit("ten_per_minute", "d", count=10)
    key = backend.key(limiter.resolve("ten_per_minute"), encode_key("d"))
    before, ttl_before = client.get(key), client.pttl(key)
    assert not limiter.limit("ten_per_minute", "d").ok
    assert not limiter.limit_many([("burst", "d"), ("ten_per_minute", "d")]).ok
    assert client.get(key) == before and client.pttl(key) <= ttl_before
    assert not client.exists(backend.key(limiter.resolve("burst"), encode_key("d")))
    limiter.check("login", "never-written")
    limiter.get_value("login", "never-written")
    assert not client.exists(backend.key(limiter.resolve("login"), encode_key("never-written")))


def test_a_small_ttl_is_at_least_one_millisecond(backend):
    config = {"rate": 1000, "period": 0.001, "capacity": 1000}  # full again 1 µs later
    limiter.limit("fast", "k", config=config, count=0.001)
    key = backend.key(limiter.resolve("fast", config), encode_key("k"))
    assert backend.client().pttl(key) in (0, 1) or not backend.client().exists(key)


def test_time_comes_from_redis(backend):
    seconds, micros = backend.client().time()
    status = limiter.limit("login", "clock")
    assert abs(status.timestamp - (seconds + micros / MICRO)) < 1.0


def test_app_clock_setting_uses_this_hosts_time(backend):
    with override_settings(TOKENBUCKET={**settings.TOKENBUCKET, "CLOCK": "app"}):
        before = time.time()
        status = limiter.limit("login", "app-clock")
        assert before <= status.timestamp <= time.time()


def test_no_key_is_left_without_a_ttl(backend):
    """Every kind of write: fresh keys, reservations, windows, all-or-nothing, a rebase."""
    with frozen_clock(T0) as clock:
        for i in range(30):
            limiter.limit("ten_per_minute", i % 7)
            limiter.limit("window", i % 5, count=2)
            limiter.limit("reservable", i % 3, count=7, reserve=True)
            limiter.limit_many([("burst", i % 4), ("login", i % 4)])
            clock.advance(0.7 if i % 2 else -3600)  # backwards: denials rebase and write
    total, immortal = keys_without_ttl(backend.client(), our_keys(backend))
    assert total >= 20 and immortal == 0


# ---------------------------------------------------------------------------------------
# NOSCRIPT: a flushed, restarted or failed-over server lost the script
# ---------------------------------------------------------------------------------------


@pytest.mark.redis_processes
def test_script_flush_is_recovered_without_an_error():
    # A private server: SCRIPT FLUSH empties the script cache of every user of a server.
    with private_redis() as server, frozen_clock(T0):
        backend = get_backend()
        client = server.client()
        assert limiter.limit("login", "ns").ok
        client.script_flush()
        reloads = backend.script_reloads
        assert limiter.limit("login", "ns").value == 3
        assert backend.script_reloads == reloads + 1  # one EVAL, and the script is cached again
        assert client.script_exists(backend._script.sha) == [True]
        assert limiter.limit("login", "ns").value == 2
        assert backend.script_reloads == reloads + 1
        client.close()


@pytest.mark.redis_processes
def test_a_client_that_decodes_responses_works_too():
    with private_redis(CONNECTION_POOL_KWARGS={"decode_responses": True}), frozen_clock(T0):
        assert isinstance(get_backend().client().get("missing") or "", str)
        assert limiter.limit("login", "decoded", count=2).value == 3
        assert limiter.limit_many([("login", "decoded", 3), ("burst", "decoded")]).ok
        denied = limiter.limit("login", "decoded")
        assert not denied.ok and denied.retry_after == pytest.approx(12.0)


@contextmanager
def private_redis(*args: str, fail_open: bool = False, **options):
    """A redis-server of this test's own, as the cache alias ``private`` used by the limiter."""
    with RedisServer(*args) as server:
        cache = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": server.url,
            "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 0.5, "SOCKET_TIMEOUT": 2, **options},
        }
        options = {"CACHE": "private"}
        tokenbucket = {
            **BASE_SETTINGS,
            "BACKEND": REDIS_BACKEND,
            "OPTIONS": options,
            "FAIL_OPEN": fail_open,
            "LOG_INTERVAL": 0,  # every failure logged, so the tests can count them
        }
        with override_settings(CACHES={**settings.CACHES, "private": cache}, TOKENBUCKET=tokenbucket):
            yield server


@pytest.mark.redis_processes
def test_a_restarted_server_is_used_again_without_an_error():
    with private_redis() as server, frozen_clock(T0):
        assert limiter.limit("login", "r", count=2).value == 3
        server.restart()  # no persistence: the state and the script cache are gone
        assert limiter.limit("login", "r").value == 4
        assert get_backend().script_reloads == 2  # the first use of each server loads it too


# ---------------------------------------------------------------------------------------
# Failures (RELIABILITY-PLAN F3-F6): the fail mode applies on both django-redis paths
# ---------------------------------------------------------------------------------------

ERROR_PATHS = pytest.mark.parametrize("ignore_exceptions", [False, True], ids=["raising", "IGNORE_EXCEPTIONS"])


def warnings_of(caplog):
    """The limiter's warnings about the store. Not the overrides' (django_tokenbucket.overrides):
    these tests have no database access, so reading the overrides fails and says so, once."""
    return [
        r
        for r in caplog.records
        if r.name == "django_tokenbucket"
        and r.levelno == logging.WARNING
        and not r.getMessage().startswith("rate-limit overrides could not be read")
    ]


@pytest.mark.redis_processes
@ERROR_PATHS
def test_redis_down_fails_closed_by_default(ignore_exceptions, caplog):
    with private_redis(IGNORE_EXCEPTIONS=ignore_exceptions) as server:
        assert limiter.limit("login", "down").ok
        server.stop()
        with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
            with pytest.raises(BackendUnavailable, match="login"):
                limiter.limit("login", "down")
        [record] = warnings_of(caplog)
        assert "fail closed" in record.getMessage() and "ConnectionError" in record.getMessage()
        with pytest.raises(BackendUnavailable):
            limiter.reset("login", "down")
        if ignore_exceptions:
            # The cache API hides the failure (returns the default); the limiter does not.
            assert caches["private"].get("anything", "hidden") == "hidden"
        server.start()
        # Recovered: the breaker's next probe finds the server, and the pool reconnects.
        assert once_answered(lambda: limiter.limit("login", "down")).ok


@pytest.mark.redis_processes
@ERROR_PATHS
def test_redis_down_fails_open_when_configured(ignore_exceptions, caplog):
    with private_redis(IGNORE_EXCEPTIONS=ignore_exceptions, fail_open=True) as server:
        server.stop()
        with caplog.at_level(logging.WARNING, logger="django_tokenbucket"):
            statuses = [limiter.limit("login", "open") for _ in range(8)]
        assert all(s.ok and s.failed_open for s in statuses)
        assert len(warnings_of(caplog)) == 8 and "FAIL_OPEN" in warnings_of(caplog)[0].getMessage()
        # The first call was refused a connection, which opened the node's breaker: the
        # calls after it failed at once (but a probe now and then, each refused too).
        errors = get_backend().errors
        assert errors["ConnectionError"] >= 1 and errors["NodeUnavailable"] >= 1
        assert errors["ConnectionError"] + errors["NodeUnavailable"] == 8
        with pytest.raises(BackendUnavailable):  # reading has nothing to allow
            limiter.get_value("login", "open")


@pytest.mark.redis_processes
def test_a_read_that_fails_is_a_backend_failure_that_wrote_nothing(without_deny_cache):
    """A key denied lately is read first; a store down then fails the read, not ambiguously."""
    with private_redis() as server, frozen_clock(T0):
        for _ in range(6):
            limiter.limit("login", "read")
        server.stop()
        with pytest.raises(BackendUnavailable, match="login") as failure:
            limiter.limit("login", "read")
        assert failure.value.__cause__.ambiguous is False
        assert get_backend().reads["sent"] == 2 and get_backend().errors["ConnectionError"] == 1
        server.start()  # empty: the bucket is fresh again
        assert once_answered(lambda: limiter.limit("login", "read")).value == 4


@pytest.mark.redis_processes
def test_nothing_listening_is_a_backend_failure():
    server = RedisServer()  # a free port, never started: connections are refused
    cache = {"BACKEND": "django_redis.cache.RedisCache", "LOCATION": server.url}
    tokenbucket = {**BASE_SETTINGS, "BACKEND": REDIS_BACKEND, "OPTIONS": {"CACHE": "refused"}}
    with override_settings(CACHES={**settings.CACHES, "refused": cache}, TOKENBUCKET=tokenbucket):
        with pytest.raises(BackendUnavailable, match=r"Connection refused|Error 111") as failure:
            limiter.limit("login", "k")
    server.close()
    # Refused while connecting: nothing was sent, so nothing can have been applied.
    assert failure.value.__cause__.ambiguous is False


@pytest.mark.parametrize(
    "make_client, retries",
    [
        # django-redis builds its pool from the cache's options: no retry unless given.
        (lambda: redis.Redis(connection_pool=redis.ConnectionPool(host="127.0.0.1", port=1)), False),
        (lambda: redis.Redis(connection_pool=redis.ConnectionPool(port=1, retry=Retry(NoBackoff(), 0))), False),
        (lambda: redis.Redis(connection_pool=redis.ConnectionPool(port=1, retry=Retry(NoBackoff(), 2))), True),
        (lambda: redis.Redis(connection_pool=redis.ConnectionPool(port=1, retry_on_error=[RedisConnectionError])), True),
        # redis-py's own default, when a client is made directly: 3 retries.
        (lambda: redis.Redis(host="127.0.0.1", port=1), True),
    ],
    ids=["django-redis-default", "retry-0", "retry-2", "retry-on-error", "redis-py-default"],
)
def test_a_client_that_may_resend_makes_failed_writes_ambiguous(make_client, retries):
    """After a resend, the attempt that failed is not the only one that may have run."""
    # A failure to connect sent nothing, unless the client went on to try again on its own.
    refused = RedisConnectionError("Error 111 connecting to 127.0.0.1:1. Connection refused.")
    assert may_have_run(make_client(), refused) is retries  # made, never connected


@pytest.mark.redis_processes
@ERROR_PATHS
def test_a_server_refusing_commands_is_a_backend_failure(ignore_exceptions):
    """A password the client lacks (NOAUTH): Redis answers, with an error."""
    with private_redis("--requirepass", "secret", IGNORE_EXCEPTIONS=ignore_exceptions):
        with pytest.raises(BackendUnavailable, match=r"Authentication|NOAUTH"):
            limiter.limit("login", "k")
    with private_redis("--requirepass", "secret", IGNORE_EXCEPTIONS=ignore_exceptions, fail_open=True):
        assert limiter.limit("login", "k").failed_open


@pytest.mark.redis_processes
@ERROR_PATHS
def test_a_slow_server_times_out_into_the_fail_mode(ignore_exceptions):
    """F4: the server stops answering; SOCKET_TIMEOUT=0.05 bounds every decision.

    Just after an answer, a reply that times out is a busy Redis, refused even under
    FAIL_OPEN (issue 35, item 7); once Redis has been silent for BUSY_WINDOW, it is taken
    for down and the calls fail open. The first of those must open a new connection, whose
    handshake times out: no connection could be made, so the node's breaker opens and the
    calls after it fail at once, but for a probe now and then.
    """
    with private_redis(SOCKET_TIMEOUT=0.05, IGNORE_EXCEPTIONS=ignore_exceptions, fail_open=True) as server:
        assert limiter.limit("login", "slow").ok
        server.pause()
        with pytest.raises(BackendUnavailable, match="the store is busy"):
            limiter.limit("login", "slow")
        time.sleep(BUSY_WINDOW)
        latencies = []
        for _ in range(20):
            started = time.perf_counter()
            status = limiter.limit("login", "slow")
            latencies.append(time.perf_counter() - started)
            assert status.ok and status.failed_open
        errors = get_backend().errors
        assert errors["TimeoutError"] >= 2 and errors["NodeUnavailable"] >= 1
        assert errors["TimeoutError"] + errors["NodeUnavailable"] == 21, errors
        server.resume()
        ends = time.monotonic() + 3.0  # the breaker's next probe finds it (FAIL_OPEN: no error)
        while limiter.limit("login", "slow").failed_open:
            assert time.monotonic() < ends, "no probe reached the server again"
            time.sleep(0.01)
        assert limiter.limit("login", "slow").ok
    latencies.sort()
    print(f"\nF4 slow Redis: socket_timeout=50 ms, decision p50={latencies[10] * 1000:.1f} ms, max={latencies[-1] * 1000:.1f} ms")
    # The paused server never answers, so each call returned only because its socket timed
    # out (the TimeoutError count above). The bound is loose on purpose: it tells a bounded
    # wait from a hung one and stays clear of scheduling noise on a busy CI machine.
    assert latencies[-1] < 2.0


@pytest.mark.redis_processes
def test_out_of_memory_under_noeviction_is_a_backend_failure_not_a_reset():
    with private_redis("--maxmemory-policy", "noeviction") as server:
        with frozen_clock(T0):
            limiter.limit("login", "oom", count=5)
            client = server.client()
            # A maxmemory below what the server already uses makes every write fail for
            # certain; filling up to a limit instead races the allocator's own bookkeeping
            # (freed client buffers bring usage back under the limit now and then).
            client.config_set("maxmemory", "1")
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                client.set("filler", "x")
            # A call that must write fails (Redis checks memory at the script's first write,
            # so no script writes part of its keys); reads and denials still work.
            with pytest.raises(BackendUnavailable, match="OutOfMemoryError"):
                limiter.limit("login", "oom-fresh")
            assert not limiter.limit("login", "oom").ok
            assert limiter.get_value("login", "oom") == 0  # the state survived
            client.close()


@pytest.mark.redis_processes
def test_eviction_policy_silently_resets_buckets():
    """F6: with an evicting policy, a bucket's key is just another victim. Hence the W021 check."""
    with private_redis("--maxmemory", "5mb", "--maxmemory-policy", "volatile-lru") as server:
        with frozen_clock(T0):
            for key in range(20):
                limiter.limit("login", key, count=5)
            client = server.client()
            pipe = client.pipeline(transaction=False)
            for i in range(200_000):
                pipe.set(f"filler:{i}", "x" * 32, ex=3600)
                if i % 5000 == 4999:
                    pipe.execute()
            pipe.execute()
            resets = sum(limiter.get_value("login", key) == 5 for key in range(20))
            client.close()
            messages = [m for m in run_checks(tags=["caches"]) if m.id == "django_tokenbucket.W021"]
    print(f"\nF6 eviction (volatile-lru, 5 MB, 200k filler keys): {resets} of 20 exhausted buckets reset to full")
    assert resets > 0
    assert messages and "volatile-lru" in messages[0].msg


# ---------------------------------------------------------------------------------------
# System checks
# ---------------------------------------------------------------------------------------


def redis_messages(**tokenbucket):
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "BACKEND": REDIS_BACKEND, **tokenbucket}):
        return sorted(
            (m.id, m.msg) for m in run_checks(tags=["caches"]) if (m.id or "").startswith("django_tokenbucket.")
        )


def test_check_passes_for_a_django_redis_cache(redis_store):
    """A project that configures nothing but a django-redis cache has nothing to fix."""
    policy = caches["redis"].client.get_client().config_get("maxmemory-policy")["maxmemory-policy"]
    expected = [] if policy == "noeviction" else ["django_tokenbucket.W021"]  # a developer's own Redis
    assert [check_id for check_id, _ in redis_messages(OPTIONS={"CACHE": "redis-bare"})] == expected


def test_a_cache_that_is_not_django_redis_is_an_error():
    # An error, so that "manage.py check" fails and runserver does not start (issue 33).
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "BACKEND": REDIS_BACKEND, "OPTIONS": {}}):
        [message] = [m for m in run_checks(tags=["caches"]) if (m.id or "").startswith("django_tokenbucket.")]
    # "default" is a LocMemCache here.
    assert message.id == "django_tokenbucket.E027" and message.is_serious()
    assert "CACHES['default']" in message.msg and "LocMemCache" in message.msg and "django-redis" in message.msg


def test_check_reports_a_missing_or_bad_cache_alias():
    [(check_id, message)] = redis_messages(OPTIONS={"CACHE": "nope"})
    assert check_id == "django_tokenbucket.E020" and "'nope'" in message
    [(check_id, _)] = redis_messages(OPTIONS={"CACHE": 3})
    assert check_id == "django_tokenbucket.E020"
    [(check_id, message)] = redis_messages(OPTIONS={"CACHE": "redis-bare", "DATABASE": "default"})
    assert check_id == "django_tokenbucket.E021" and "'DATABASE'" in message
    with override_settings(TOKENBUCKET={**BASE_SETTINGS, "BACKEND": REDIS_BACKEND, "OPTIONS": {"CACHE": "nope"}}):
        with pytest.raises(ImproperlyConfigured, match="nope"):
            limiter.limit("login", "k")


@pytest.mark.redis_processes
@pytest.mark.parametrize(
    "args, warned",
    [
        (("--maxmemory-policy", "allkeys-lru"), True),
        (("--maxmemory-policy", "noeviction"), False),
        # CONFIG denied (renamed away, as managed services do): nothing to say.
        (("--maxmemory-policy", "allkeys-lru", "--rename-command", "CONFIG", ""), False),
    ],
    ids=["evicting", "noeviction", "config-denied"],
)
def test_check_warns_about_an_evicting_policy(args, warned):
    with private_redis(*args) as server:
        messages = redis_messages(OPTIONS={"CACHE": "private"})
        server.stop()
        assert redis_messages(OPTIONS={"CACHE": "private"}) == []  # down: silent, never a crash
    if warned:
        [(check_id, message)] = messages
        assert check_id == "django_tokenbucket.W021" and "allkeys-lru" in message
    else:
        assert messages == []


# ---------------------------------------------------------------------------------------
# Several OS processes on one hot key (RELIABILITY-PLAN H1, H2, H5 on RD)
# ---------------------------------------------------------------------------------------

PROCESSES = 8


def record_keys(figures, backend: RedisBackend):
    total, immortal = keys_without_ttl(backend.client(), our_keys(backend))
    figures.update(keys=total, keys_without_ttl=immortal)
    assert immortal == 0


@pytest.mark.concurrency
class TestHotKey:
    def test_h1_exact_with_a_frozen_clock(self, backend):
        config = {"rate": 100, "period": 3600}
        call = partial(limiter.limit, "h1", "hot", config=config)
        processes = sized(PROCESSES, 64)
        with frozen_clock(T0):
            results = run_processes(hammer, processes, call, 50, None)
            assert limiter.get_value("h1", "hot", config=config) == 0
        figures = summarise(results, case="H1", backend="redis", C=100)
        record_keys(figures, backend)
        assert figures["surfaced_errors"] == 0, figures["error_samples"]
        assert figures["attempts"] == processes * 50 and figures["admitted"] == 100

    def test_h2_bound_with_the_redis_clock(self, backend):
        """admitted <= C + r·Δ, Δ on Redis' clock (first to last decision), and >= 90 % of it."""
        capacity, rate, duration = sized(20, 100), 10, sized(3.0, 20.0)
        config = {"rate": rate, "period": 1, "capacity": capacity}
        call = partial(limiter.limit, "h2", "hot", config=config)
        results = run_processes(hammer, sized(PROCESSES, 32), call, None, duration)
        figures = summarise(results, case="H2", backend="redis", C=capacity, r=rate, M_s=duration)
        bound = capacity + rate * figures["store_clock_span_s"]
        figures.update(bound=round(bound, 3), excess=round(figures["admitted"] - bound, 3))
        figures["utilisation"] = round(figures["admitted"] / bound, 4)
        record_keys(figures, backend)
        assert figures["surfaced_errors"] == 0, figures["error_samples"]
        assert figures["admitted"] <= bound + 1e-6
        assert figures["admitted"] >= 0.9 * bound, figures

    def test_h5_all_or_nothing_under_contention(self, backend):
        loose = {"rate": 1000, "period": 3600}
        tight = {"rate": 10, "period": 3600}
        requests = [LimitRequest("h5-loose", "k", config=loose), LimitRequest("h5-tight", "k", config=tight)]
        with frozen_clock(T0):
            results = run_processes(hammer, 6, partial(limiter.limit_many, requests), 30, None)
            figures = summarise(results, case="H5", backend="redis")
            assert figures["surfaced_errors"] == 0, figures["error_samples"]
            assert figures["admitted"] == 10
            assert limiter.get_value("h5-loose", "k", config=loose) == 990
            assert limiter.get_value("h5-tight", "k", config=tight) == 0


def test_malformed_arguments_are_named_in_the_scripts_error(backend):
    """The common path leaves what it cannot read to the general path, which says what is wrong."""
    client = backend.client()
    key = backend.key(ONE_PER_SECOND, ALICE)
    header = as_msgpack(1, 1, MAX_TTL_MS, 5 * MICRO)
    good = as_msgpack(1, MICRO, "t", MICRO, MICRO, MICRO, 0, MICRO, 0)
    assert client.eval(SCRIPT, 1, key, "-", header, good)[1] == 1  # the common path's integers
    cases = [
        ("-", b"\xd3\x00", good, "malformed header"),  # truncated MessagePack
        ("-", header, good[:-3], "malformed request 1"),
        ("-", header, as_msgpack(2, MICRO, "t", MICRO, MICRO, MICRO, 0, MICRO, 0), "malformed request 1"),  # no key 2
        ("-", header, as_msgpack(1, MICRO, "x", MICRO, MICRO, MICRO, 0, MICRO, 0), "malformed request 1"),  # no such kind
        ("-", header, as_msgpack(1, MICRO, "t", 0, MICRO, MICRO, 0, MICRO, 0), "malformed request 1"),  # rate 0
        ("soon", header, good, "not an integer"),
    ]
    for now, head, request, message in cases:
        with pytest.raises(redis.exceptions.ResponseError, match=message):
            client.eval(SCRIPT, 1, key, now, head, request)
    client.delete(key)


def test_the_replys_decisions_are_what_the_constructors_make():
    """fast_decision and fast_outcome fill __dict__ at once; they must make equal objects."""
    fast = fast_decision(False, -3, 7, 11)
    assert fast == Decision(False, -3, 7, 11, None) and hash(fast) == hash(Decision(False, -3, 7, 11, None))
    assert repr(fast) == repr(Decision(False, -3, 7, 11, None))
    with pytest.raises(FrozenInstanceError):
        fast.value = 4  # type: ignore[misc]
    assert fast_outcome([fast], 5) == Outcome([Decision(False, -3, 7, 11, None)], 5)
    assert reply_outcome(b"5 0 -3 7 11", 1) == Outcome([fast], 5)
    assert reply_outcome("5 1 2 - 0", 1) == Outcome([Decision(True, 2, None, 0, None)], 5)


def test_the_script_is_package_data():
    assert "decide_all" in SCRIPT and "redis.call" in SCRIPT
    # bignum.lua joined in place of its marker: one script, one SHA.
    assert BIGNUM_MARKER not in SCRIPT and "local function mag_mul" in SCRIPT
    assert MAX_TTL_MS == 2**53


def test_a_missing_cache_alias_names_the_setting_to_fix():
    """Issue 21: a typo in the alias surfaced as Django's bare InvalidCacheBackendError."""
    typo = {**BASE_SETTINGS, "BACKEND": "django_tokenbucket.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "ratelimt"}}
    with override_settings(TOKENBUCKET=typo):
        with pytest.raises(ImproperlyConfigured, match=r"TOKENBUCKET\['OPTIONS'\]\['CACHE'\] = 'ratelimt' is not an alias"):
            limiter.limit("login", "k")


# ---------------------------------------------------------------------------------------
# Listing, counting and resetting a whole limit (the admin's and the command's operations)
# ---------------------------------------------------------------------------------------


def hashing_key_function(key: str, key_prefix: str, version: int) -> str:
    """A KEY_FUNCTION that keeps nothing of the key readable."""
    return hashlib.sha256(f"{key_prefix}:{version}:{key}".encode()).hexdigest()


def test_listing_escapes_a_key_prefix_with_glob_characters(redis_store):
    # "a*" unescaped would match the keys of "ab", a neighbour's prefix; VERSION is part of the key.
    base = settings.CACHES["redis"]
    caches_with_globs = {
        **settings.CACHES,
        "globby": {**base, "KEY_PREFIX": f"{base['KEY_PREFIX']}:a*[?]", "VERSION": 3},
        "neighbour": {**base, "KEY_PREFIX": f"{base['KEY_PREFIX']}:ab[x]", "VERSION": 3},
    }
    config = parse_limit("ten_per_minute", BASE_SETTINGS["LIMITS"]["ten_per_minute"])
    with override_settings(CACHES=caches_with_globs), frozen_clock(T0):
        globby, neighbour = RedisBackend({"CACHE": "globby"}), RedisBackend({"CACHE": "neighbour"})
        for backend, keys in ((globby, ["alice", "bob"]), (neighbour, ["carol"])):
            for key in keys:
                backend.decide([Request(config, encode_key(key), MICRO)], apply=True)
        assert globby.key(config, encode_key("alice")).startswith(f"{base['KEY_PREFIX']}:a*[?]:3:tokenbucket:")
        listed = globby.list_buckets(config)
        assert sorted(b.digest for b in listed.buckets) == sorted(encode_key(k).digest for k in ("alice", "bob"))
        assert listed.cursor is None and all(b.state == State(9 * MICRO, T0_US) for b in listed.buckets)
        assert globby.count_buckets([config]) == {"ten_per_minute": 2}
        assert globby.reset_all(config) == 2
        assert neighbour.count_buckets([config]) == {"ten_per_minute": 1}  # untouched


def test_a_key_function_that_hides_the_key_cannot_list(redis_store):
    hashing = {**settings.CACHES["redis"], "KEY_FUNCTION": f"{__name__}.hashing_key_function"}
    config = parse_limit("ten_per_minute", BASE_SETTINGS["LIMITS"]["ten_per_minute"])
    with override_settings(CACHES={**settings.CACHES, "hashing": hashing}):
        backend = RedisBackend({"CACHE": "hashing"})
        backend.decide([Request(config, ALICE, MICRO)], apply=True)  # deciding works
        with pytest.raises(ImproperlyConfigured, match=r"CACHES\['hashing'\]\['KEY_FUNCTION'\] does not keep"):
            backend.list_buckets(config)
        backend.reset(config, ALICE)


def test_a_bad_cursor_or_digest_prefix_is_a_clear_error(backend):
    config = parse_limit("ten_per_minute", BASE_SETTINGS["LIMITS"]["ten_per_minute"])
    with pytest.raises(ValueError, match=r"rate limit 'ten_per_minute': 'x 1' is not a cursor"):
        backend.list_buckets(config, cursor="x 1")
    with pytest.raises(ValueError, match="a digest prefix is lowercase hex"):
        backend.list_buckets(config, digest_prefix="ABC*")
    with pytest.raises(ValueError, match="batch_size must be between 1 and 1000"):
        backend.reset_all(config, batch_size=0)


def test_a_bad_scan_cursor_is_refused_before_it_reaches_redis(backend):
    config = parse_limit("ten_per_minute", BASE_SETTINGS["LIMITS"]["ten_per_minute"])
    for cursor in ("0 \uff15", "0 +5", "0 1_0", "0 -1", f"0 {2**64}", "0 " + "9" * 5000, "1 0", "0 5 "):
        with pytest.raises(ValueError, match=r"rate limit 'ten_per_minute': .* is not a cursor of this store's"):
            backend.list_buckets(config, cursor=cursor)
    assert backend.list_buckets(config, cursor=f"0 {2**64 - 1}").buckets == []


def test_a_limit_name_with_glob_characters_lists_only_its_own_keys(backend):
    # Names outside [A-Za-z0-9_.-] are hashed in the key, so MATCH never sees their globs.
    names = ["a", "a*", "a?", "[a]", "a[", "a\\", "ab", "*", "?", "tokenbucket:*"]
    configs = {name: parse_limit(name, "10/m") for name in names}
    with frozen_clock(T0):
        for index, name in enumerate(names):
            backend.decide([Request(configs[name], encode_key(f"key{index}"), MICRO)], apply=True)
        for index, name in enumerate(names):
            listed = backend.list_buckets(configs[name])
            assert [bucket.digest for bucket in listed.buckets] == [encode_key(f"key{index}").digest], name
            prefix = encode_key(f"key{index}").digest[:10]
            assert len(backend.list_buckets(configs[name], digest_prefix=prefix).buckets) == 1, name
        assert backend.count_buckets(list(configs.values())) == dict.fromkeys(names, 1)
        assert backend.reset_all(configs["*"]) == 1 and backend.reset_all(configs["a*"]) == 1
        assert backend.count_buckets(list(configs.values())) == {name: int(name not in ("*", "a*")) for name in names}


def test_a_page_stops_at_its_time_budget_and_says_how_far_it_looked(backend, monkeypatch):
    # Nothing of the limit among 10^5 other keys, one SCAN call a page (a budget of 0 s):
    # every page is bounded although nothing matches, and its estimate goes up to the end.
    config = parse_limit("ten_per_minute", BASE_SETTINGS["LIMITS"]["ten_per_minute"])
    monkeypatch.setattr(backend, "scan_budget", 0.0)
    with frozen_clock(T0):
        backend.decide([Request(config, ALICE, 10 * MICRO)], apply=True)  # empty: stored for a minute
        with other_keys(backend.client()):
            cursor, found, progress = None, [], []
            while True:
                page = backend.list_buckets(config, cursor=cursor, page_size=1000)
                found += [bucket.digest for bucket in page.buckets]
                progress.append(page.progress)
                if page.cursor is None:
                    break
                cursor = page.cursor
    assert found == [ALICE.digest]
    # One call of COUNT 1000 a page: about 100 pages for 10^5 keys, each further on.
    assert 50 <= len(progress) <= 200
    assert progress == sorted(progress) and progress[-1] == 1.0 and 0 < progress[0] < 0.05
    assert 0.3 < progress[len(progress) // 2] < 0.7


def test_a_page_of_dense_keys_stops_once_it_is_full(backend):
    # As before the budget: the first call's COUNT is the page size, and a full page stops.
    config = parse_limit("ten_per_minute", BASE_SETTINGS["LIMITS"]["ten_per_minute"])
    with frozen_clock(T0):
        for user in range(400):
            backend.decide([Request(config, encode_key(user), MICRO)], apply=True)
        page = backend.list_buckets(config, page_size=100)
    assert 100 <= len(page.buckets) < 200 and page.cursor is not None and 0 < page.progress < 1


def redis_scan_cursors(bits: int) -> list[int]:
    """The cursors SCAN returns over a table of 2^bits buckets, in order (dictScan's
    reverse-binary increment of the cursor's masked bits), the final 0 left out."""
    mask, full = (1 << bits) - 1, (1 << 64) - 1
    reverse = lambda value: int(f"{value:064b}"[::-1], 2)  # noqa: E731
    cursors, cursor = [], 0
    while True:
        cursor = reverse((reverse((cursor | ~mask) & full) + 1) & full)
        if cursor == 0:
            return cursors
        cursors.append(cursor)


@pytest.mark.parametrize("bits", [1, 4, 10, 17])
def test_the_share_of_the_keyspace_scanned_is_the_cursor_with_its_bits_reversed(bits):
    # Whatever the table's size: the k-th cursor of 2^bits buckets is k / 2^bits of the way.
    cursors = redis_scan_cursors(bits)
    assert len(cursors) == 2**bits - 1
    assert [scanned_fraction(cursor) for cursor in cursors] == [k / 2**bits for k in range(1, 2**bits)]


def test_a_cursor_that_carries_a_slot_is_read_over_the_nodes_slots():
    # A cluster node of Redis 7.4+ or Valkey 8+ keeps a table per slot: slot in the low 14 bits.
    slots = list(range(5461, 10923))
    assert scanned_fraction(5461, slots) == 0.0
    assert scanned_fraction(8192, slots) == (8192 - 5461) / len(slots)
    assert scanned_fraction((1 << 14) | 5461, slots) == 0.5 / len(slots)
    assert scanned_fraction((3 << 14) | 10922, slots) == (len(slots) - 1 + 0.75) / len(slots)


@pytest.mark.parametrize(
    "server, carries",
    [
        ({"redis_version": "7.0.15"}, False),
        ({"redis_version": "7.2.4"}, False),
        ({"redis_version": "7.4.0"}, True),
        ({"redis_version": "8.0.2"}, True),
        ({"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "7.2.5"}, False),
        ({"redis_version": "7.2.4", "server_name": "valkey", "valkey_version": "8.0.1"}, True),
        ({}, False),
    ],
)
def test_which_cluster_nodes_carry_a_slot_in_their_cursors(server, carries):
    assert cursor_carries_slot(server) is carries


@pytest.mark.redis_processes
def test_listing_through_a_client_that_decodes_responses():
    with private_redis(CONNECTION_POOL_KWARGS={"decode_responses": True}), frozen_clock(T0):
        limiter.limit("login", "decoded", count=2)
        backend = get_backend()
        config = parse_limit("login", BASE_SETTINGS["LIMITS"]["login"])
        [bucket] = backend.list_buckets(config).buckets
        assert bucket.digest == encode_key("decoded").digest and bucket.state.value == 3 * MICRO
        assert backend.reset_all(config) == 1 and limiter.get_value("login", "decoded") == 5


# -- the spare connections decisions hand to each other -----------------------------------


def _spare_links(backend: RedisBackend) -> list:
    spares = spares_module._by_pool.get(backend.client().connection_pool)
    return [] if spares is None else spares.links


def test_a_decision_after_the_server_closed_its_connection_connects_again(backend):
    """A spare whose socket the server closed (a restart, a failover, idle clients timed
    out) is checked before use, as the pool checks what it lends: the call connects again
    instead of failing."""
    with frozen_clock(T0):
        assert limiter.limit("ten_per_minute", "closed").ok
        spares = _spare_links(backend)
        assert spares
        for spare in spares:
            host, port = spare._sock.getsockname()[:2]
            assert backend.client().client_kill_filter(addr=f"{host}:{port}", skipme=True) == 1
        statuses = [limiter.limit("ten_per_minute", "closed") for _ in range(3)]  # raises on a store failure
    assert [status.ok for status in statuses] == [True] * 3
    assert [status.value for status in statuses] == [8.0, 7.0, 6.0]  # the store decided each


def test_spares_are_at_most_a_quarter_of_the_pools_connections():
    """The pool counts a spare in use for good: the cache's other users keep three
    quarters of max_connections. A blocking pool keeps its own lending."""
    from django_tokenbucket.backends.redis.spares import give_back, lease

    where = {"host": settings.REDIS_HOST, "port": settings.REDIS_PORT, "max_connections": 8}
    pool = redis.ConnectionPool(**where)
    blocking = redis.BlockingConnectionPool(**where)
    try:
        links = [lease(pool) for _ in range(5)]
        assert len({id(link) for link in links}) == 5
        for link in links:
            give_back(pool, link)
        assert spares_module._by_pool[pool].links == links[:2]
        assert len(pool._in_use_connections) == 2 and len(pool._available_connections) == 3
        assert lease(pool) is links[1]  # a spare, not a connection the pool lends

        link = lease(blocking)
        give_back(blocking, link)
        assert blocking not in spares_module._by_pool
        assert not any(name.startswith("_django_tokenbucket") for name in vars(pool))  # nothing written on it
        assert blocking.pool.qsize() == 8  # every connection back in the pool's queue
    finally:
        pool.disconnect()
        blocking.disconnect()


def test_the_redis_py_internal_the_spares_read_is_there(backend):
    """``spares`` reads one private name of redis-py, ``Connection._sock`` (its module's
    docstring): the socket, None while disconnected. If a redis-py release renames it,
    decisions still work through the pool's own lending (the next test), but the spares
    are gone: this test says so."""
    pool = backend.client().connection_pool
    link = spares_module.lease(pool)
    try:
        assert spares_module.knows(link)
        assert isinstance(link._sock, socket.socket)  # connected: polled before each use
        link.disconnect()
        assert link._sock is None  # disconnected: connected again before use
    finally:
        spares_module.give_back(pool, link)
    assert _spare_links(backend)[-1] is link


def test_a_connection_without_the_socket_attribute_goes_through_the_pools_own_lending():
    class Link:  # a connection class that keeps its socket elsewhere
        pass

    class Pool:
        max_connections = 8

        def __init__(self) -> None:
            self.lent: list[Link] = []
            self.released: list[Link] = []

        def get_connection(self, *command: str) -> Link:
            self.lent.append(Link())
            return self.lent[-1]

        def release(self, link: Link) -> None:
            self.released.append(link)

    pool = Pool()
    for _ in range(3):
        spares_module.give_back(pool, spares_module.lease(pool))
    assert pool.released == pool.lent and len(pool.lent) == 3
    assert spares_module._by_pool[pool].links == []


def test_a_forked_child_never_writes_to_its_parents_spares(backend):
    """Two processes on one socket would read each other's replies."""
    import multiprocessing

    def ports() -> set[int]:
        return {link._sock.getsockname()[1] for link in _spare_links(backend)}

    with frozen_clock(T0):
        assert limiter.limit("ten_per_minute", "forked").ok
    parents = ports()
    assert parents
    context = multiprocessing.get_context("fork")
    queue = context.Queue()

    def child() -> None:
        with frozen_clock(T0):
            status = limiter.limit("ten_per_minute", "forked")
        queue.put((status.ok, status.value, ports()))

    process = context.Process(target=child)
    process.start()
    ok, value, own = queue.get(timeout=30)
    process.join(30)
    assert (ok, value) == (True, 8.0) and own and not own & parents
    with frozen_clock(T0):
        assert limiter.limit("ten_per_minute", "forked").value == 7.0  # the parent's spares still in step
