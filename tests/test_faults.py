"""The network between the limiter and its store breaks (RELIABILITY-PLAN F2, F4).

Every fault goes through tests/faultproxy.py, a TCP proxy in front of the real
PostgreSQL, MariaDB or Redis: it refuses connections, accepts them and never answers,
cuts them mid-transaction, or delays every reply. The limiter uses the ``proxied``
database alias (tests/settings.py) or a django-redis cache pointed at the proxy.

What must hold: fail closed answers 503 (the store failed, not the client) and fail
open lets every request through; every failed decision is signalled, but the warnings
are throttled per limit; each decision ends within what the configured timeouts allow;
and a failed decision leaves the stored state as it was, never half-written.
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import socket
import threading
import time
from contextlib import contextmanager, nullcontext
from typing import Any

import pytest
from django.conf import settings
from django.db import DatabaseError, connections, transaction
from django.test import Client, override_settings

from django_tokenbucket import BackendUnavailable, LimitRequest, limiter, signals
from django_tokenbucket.algorithms import MICRO
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.base import BUSY_WINDOW
from django_tokenbucket.backends.redis import SCRIPT
from django_tokenbucket.keys import encode_key
from django_tokenbucket.models import RateLimit
from django_tokenbucket.testing import frozen_clock

from .concurrency import FIGURES, run_processes, sized
from .faultproxy import FaultProxy
from .redis_servers import RedisServer, delete_keys
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = pytest.mark.django_db(transaction=True, databases="__all__")

T0 = 1_700_000_000.0
REDIS_BACKEND = "django_tokenbucket.backends.redis.RedisBackend"
PROCESSES = 8
OUTAGE_S = sized(2.0, 10.0)
LOG_INTERVAL = 10
#: Redis timeouts for the outage runs (the database's are in tests/settings.py, "proxied").
REDIS_TIMEOUTS = {"SOCKET_CONNECT_TIMEOUT": 0.25, "SOCKET_TIMEOUT": 0.25}
#: Added to what the timeouts allow, for a request's own work and a busy 2-core machine.
SLACK_S = 1.0


def figure(case: str, **figures: Any) -> None:
    FIGURES.append({"case": case, **figures})
    print(f"\n{case} {figures}")


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# ---------------------------------------------------------------------------------------
# The store behind the proxy
# ---------------------------------------------------------------------------------------


@contextmanager
def database_behind_proxy(**tokenbucket):
    """The limiter on the ``proxied`` alias: the test database, through a FaultProxy."""
    upstream = connections["default"].settings_dict
    with FaultProxy(upstream["HOST"] or "127.0.0.1", int(upstream["PORT"])) as proxy:
        # Every thread's connection to "proxied" is made from this very dict, and forked
        # workers inherit it: pointing it at the proxy reaches them all.
        proxied = connections["proxied"].settings_dict
        assert proxied is connections.settings["proxied"]
        saved = proxied["HOST"], proxied["PORT"]
        proxied["HOST"], proxied["PORT"] = "127.0.0.1", str(proxy.port)
        connections["proxied"].close()
        try:
            options = {"OPTIONS": {"DATABASE": "proxied"}, "LOG_INTERVAL": LOG_INTERVAL}
            with override_settings(TOKENBUCKET={**BASE_SETTINGS, **options, **tokenbucket}):
                yield proxy
        finally:
            connections["proxied"].close()
            proxied["HOST"], proxied["PORT"] = saved


@contextmanager
def redis_behind_proxy(server: RedisServer | None = None, cache_options: dict | None = None, **tokenbucket):
    """The limiter on a django-redis cache that reaches Redis through a FaultProxy.

    Without ``server``: the suite's Redis, under this run's key prefix (deleted around).
    """
    if server is None:
        upstream, db = (settings.REDIS_HOST, settings.REDIS_PORT), settings.REDIS_DB
        delete_keys()
    else:
        upstream, db = ("127.0.0.1", server.port), 0
    with FaultProxy(*upstream) as proxy:
        cache = {
            "BACKEND": "django_redis.cache.RedisCache",
            "LOCATION": f"redis://127.0.0.1:{proxy.port}/{db}",
            "KEY_PREFIX": settings.REDIS_KEY_PREFIX,
            "OPTIONS": {**REDIS_TIMEOUTS, **(cache_options or {})},
        }
        options = {"BACKEND": REDIS_BACKEND, "OPTIONS": {"CACHE": "proxied"}, "LOG_INTERVAL": LOG_INTERVAL}
        try:
            with override_settings(
                CACHES={**settings.CACHES, "proxied": cache},
                TOKENBUCKET={**BASE_SETTINGS, **options, **tokenbucket},
            ):
                yield proxy
        finally:
            if server is None:
                delete_keys()


def stored_state(store: str) -> Any:
    """Everything the store holds for this run, read directly (not through the proxy)."""
    if store == "database":
        return sorted(RateLimit.objects.using("default").values_list("name", "key", "value", "ts"))
    from django_redis import get_redis_connection

    client = get_redis_connection("redis")
    keys = sorted(client.scan_iter(match=f"{settings.REDIS_KEY_PREFIX}:*", count=1000))
    return {key: client.get(key) for key in keys}


# ---------------------------------------------------------------------------------------
# F2: the store unreachable or stalled under N=8 load, through the HTTP stack
# ---------------------------------------------------------------------------------------


class _Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.records += 1


def _requests_during_the_outage(barrier: Any, index: int, path: str, duration: float) -> dict[str, Any]:
    """Worker: GET ``path`` in a closed loop for ``duration`` seconds."""
    failures: list[bool] = []

    def count(sender: Any, fail_open: bool, **kwargs: Any) -> None:
        failures.append(fail_open)

    signals.rate_limit_backend_error.connect(count, weak=False)
    warnings = _Count()
    logging.getLogger("django_tokenbucket").addHandler(warnings)
    client = Client()
    codes: list[int] = []
    no_store: list[bool] = []
    latencies: list[float] = []
    barrier.wait()
    started = time.monotonic()
    while time.monotonic() < started + duration:
        begun = time.perf_counter()
        response = client.get(path, HTTP_ACCEPT="application/json")
        latencies.append(time.perf_counter() - begun)
        codes.append(response.status_code)
        no_store.append(response.get("Cache-Control") == "no-store")
    return {
        "codes": codes,
        "no_store": no_store,
        "latencies": latencies,
        "backend_errors": len(failures),
        "signalled_fail_open": set(failures),
        "warnings": warnings.records,
        "span": time.monotonic() - started,
    }


STORES = [
    pytest.param("database", marks=pytest.mark.only_on("postgres", "mariadb"), id="database"),
    pytest.param("redis", marks=pytest.mark.redis, id="redis"),
]
OUTAGES = [
    pytest.param("refused", False, id="refused-fail-closed"),
    pytest.param("refused", True, id="refused-fail-open"),
    pytest.param("blackhole", True, id="blackhole-fail-open"),
]


@pytest.mark.concurrency
@pytest.mark.parametrize("store", STORES)
@pytest.mark.parametrize(("fault", "fail_open"), OUTAGES)
def test_f2_store_unreachable_under_load(store, fault, fail_open):
    """N processes request a rate-limited view while the store refuses or never answers."""
    behind_proxy = database_behind_proxy if store == "database" else redis_behind_proxy
    # What one decision may wait for: a connection that never completes its handshake.
    if store == "database":
        budget = float(connections["proxied"].settings_dict["OPTIONS"]["connect_timeout"])
    else:
        budget = REDIS_TIMEOUTS["SOCKET_CONNECT_TIMEOUT"] + REDIS_TIMEOUTS["SOCKET_TIMEOUT"]
    with behind_proxy(FAIL_OPEN=fail_open) as proxy, frozen_clock(T0):
        client = Client()
        # The limit (1/m, keyed on the address) is spent before the outage: during it,
        # an allowed request can only be the fail mode, and a refusal is 503, never 429.
        assert client.get("/probe/").status_code == 200
        assert client.get("/probe/").status_code == 429
        before = stored_state(store)
        if fault == "refused":
            proxy.refuse()
        else:
            proxy.blackhole()
        results = run_processes(_requests_during_the_outage, PROCESSES, "/probe/", OUTAGE_S)
        assert stored_state(store) == before  # nothing was written during the outage
        proxy.resume()
        # The store is back: the same client is refused by the limit again, not by the outage.
        assert client.get("/probe/").status_code == 429

    codes = [code for r in results for code in r["codes"]]
    latencies = [x for r in results for x in r["latencies"]]
    decisions = len(codes)
    expected = 200 if fail_open else 503
    assert decisions >= PROCESSES and set(codes) == {expected}, sorted(set(codes))
    if not fail_open:
        assert all(flag for r in results for flag in r["no_store"])
    # Every failed decision is signalled (for counting), with the fail mode it applied...
    assert sum(r["backend_errors"] for r in results) == decisions
    assert all(r["signalled_fail_open"] == {fail_open} for r in results)
    # ...but each process warns at most once per limit per LOG_INTERVAL.
    for r in results:
        assert 1 <= r["warnings"] <= math.floor(r["span"] / LOG_INTERVAL) + 1, r
    assert max(latencies) <= budget + SLACK_S
    figure(
        "F2",
        store=store if store == "redis" else settings.DB,
        fault=fault,
        fail_mode="open" if fail_open else "closed",
        N=PROCESSES,
        outage_s=OUTAGE_S,
        decisions=decisions,
        outcomes={str(expected): decisions},
        backend_errors=sum(r["backend_errors"] for r in results),
        log_lines=sum(r["warnings"] for r in results),
        latency_ms={"p50": round(pct(latencies, 0.5) * 1000, 1), "p99": round(pct(latencies, 0.99) * 1000, 1)},
        timeout_budget_ms=round(budget * 1000),
        state_delta=0,
    )


@pytest.mark.only_on("postgres", "mariadb")
def test_f2_timeout_bounds_connecting_to_a_server_that_never_answers():
    """Red-team case 6: a server that accepts TCP and never answers held every request
    until the client gave up, since TIMEOUT's watchdog needs a socket, which connecting
    has not made yet. The backend now gives the driver a connect timeout from TIMEOUT
    when the database's OPTIONS have none (PostgreSQL's minimum is 2 s)."""
    options = connections["proxied"].settings_dict["OPTIONS"]
    saved = options.pop("connect_timeout")
    outcome: dict[str, Any] = {}

    def decide() -> None:
        started = time.perf_counter()
        try:
            limiter.limit("f2-connect", "k", config={"rate": 10, "period": 60})
        except BackendUnavailable as exc:
            outcome["error"] = exc
        finally:
            outcome["elapsed"] = time.perf_counter() - started
            connections.close_all()

    try:
        with database_behind_proxy(OPTIONS={"DATABASE": "proxied", "TIMEOUT": 0.5}) as proxy, frozen_clock(T0):
            proxy.blackhole()
            thread = threading.Thread(target=decide, daemon=True)  # its own, unopened connection
            thread.start()
            thread.join(10)
            hung = thread.is_alive()
            proxy.drop()
            proxy.resume()
            thread.join(10)
    finally:
        options["connect_timeout"] = saved
    assert not hung, "connecting was not bounded"
    assert "error" in outcome and outcome["elapsed"] <= 2 + SLACK_S
    figure("F2-connect", store=settings.DB, timeout_s=0.5, failed_after_ms=round(outcome["elapsed"] * 1000))


@pytest.mark.only_on("mariadb")
def test_f2_a_connection_that_stalls_is_bounded_by_the_read_timeout():
    """The server stops answering on a connection already open (no new handshake to time out)."""
    read_timeout = connections["proxied"].settings_dict["OPTIONS"]["read_timeout"]
    config = {"rate": 10, "period": 60}
    with database_behind_proxy() as proxy, frozen_clock(T0):
        assert limiter.limit("f2-stall", "k", config=config).value == 9  # the connection is open
        before = stored_state("database")
        proxy.blackhole()
        started = time.perf_counter()
        with pytest.raises(BackendUnavailable, match="Lost connection"):
            limiter.limit("f2-stall", "k", config=config)
        elapsed = time.perf_counter() - started
        assert stored_state("database") == before
        proxy.resume()
        # The broken connection was discarded: the next call reconnects and decides.
        assert limiter.limit("f2-stall", "k", config=config).value == 8
    # The client library may retry a read that timed out, up to three attempts in all.
    assert elapsed <= 3 * read_timeout + SLACK_S
    figure("F2-stall", store=settings.DB, read_timeout_s=read_timeout, failed_after_ms=round(elapsed * 1000))


NO_ANSWER = r"database 'proxied': no answer within TIMEOUT = 0.5 s; the connection was closed"


@pytest.mark.only_on("postgres", "mariadb")
@pytest.mark.parametrize(
    "fail_open, in_callers_transaction, quiet",
    [
        (False, False, False),
        (True, False, False),
        (True, False, True),
        (False, True, False),
        (True, True, False),
    ],
    ids=[
        "fail-closed",
        "fail-open-busy",
        "fail-open",
        "callers-transaction-fail-closed",
        "callers-transaction-fail-open",
    ],
)
def test_f2_timeout_bounds_a_connection_that_stalls(fail_open, in_callers_transaction, quiet):
    """The backend's TIMEOUT ends the wait where the driver has no read timeout (psycopg).

    Inside the caller's transaction the connection, and so the transaction, is lost:
    the caller hears it as a database error whatever the fail mode, and nothing of its
    transaction is committed. A database that answered this process within BUSY_WINDOW
    is busy, not down: FAIL_OPEN refuses (issue 35, item 7); one that has been quiet
    longer is let through.
    """
    timeout = 0.5
    config = {"rate": 10, "period": 60}
    options = {"OPTIONS": {"DATABASE": "proxied", "TIMEOUT": timeout}, "FAIL_OPEN": fail_open}
    with database_behind_proxy(**options) as proxy, frozen_clock(T0):
        assert limiter.limit("f2-timeout", "k", config=config).value == 9  # the connection is open
        before = stored_state("database")
        if quiet:
            time.sleep(BUSY_WINDOW + 0.05)
        if in_callers_transaction:
            failure = pytest.raises(DatabaseError, match=NO_ANSWER + ", and your transaction with it")
        elif fail_open and quiet:
            failure = nullcontext()
        elif fail_open:
            failure = pytest.raises(BackendUnavailable, match="the store is busy .*" + NO_ANSWER)
        else:
            failure = pytest.raises(BackendUnavailable, match=NO_ANSWER)
        with failure, transaction.atomic(using="proxied") if in_callers_transaction else nullcontext():
            # The caller's own write, in its transaction when it has one.
            RateLimit.objects.using("proxied").create(name="f2-caller", key="k", label="", value=0, ts=0)
            proxy.blackhole()
            started = time.perf_counter()
            status = limiter.limit("f2-timeout", "k", config=config)
        elapsed = time.perf_counter() - started
        if fail_open and quiet:
            assert status.ok and status.failed_open
        if in_callers_transaction:
            assert stored_state("database") == before  # the caller's write went with its transaction
        else:
            assert stored_state("database") == sorted([*before, ("f2-caller", "k", 0, 0)])
        # What the proxy holds of the abandoned statement would reach the server once
        # traffic flows again, and might commit there (docs/reliability.md, weakness 8):
        # the proxy's connections go, and with them what they held.
        proxy.drop()
        proxy.resume()
        # The stalled connection was closed: the next call reconnects and decides.
        assert limiter.limit("f2-timeout", "k", config=config).value == 8
    assert timeout <= elapsed <= timeout + SLACK_S
    figure(
        "F2-timeout",
        store=settings.DB,
        fail_mode=("open" if quiet else "open, busy") if fail_open else "closed",
        in_callers_transaction=in_callers_transaction,
        timeout_s=timeout,
        failed_after_ms=round(elapsed * 1000),
    )


# ---------------------------------------------------------------------------------------
# F2: connections cut in the middle of decisions (database)
# ---------------------------------------------------------------------------------------

CUT_EVERY_S = 0.1
CUT_FOR_S = sized(2.0, 10.0)
AFTER_CUTS = 3
BIG = {"rate": 1_000_000, "period": 3600}  # the clock is pinned: no refill, no denial
PAIR = [LimitRequest("f2-a", "k", config=BIG), LimitRequest("f2-b", "k", config=BIG)]


def _decide_while_connections_are_cut(barrier: Any, index: int, cuts_over: Any) -> dict[str, Any]:
    """Worker: decide two limits at once until the cuts stop, then a few more times."""
    admitted = failed = ambiguous = 0
    surfaced: list[str] = []
    barrier.wait()
    after: list[bool] = []
    while len(after) < AFTER_CUTS:
        over = cuts_over.is_set()
        try:
            ok = limiter.limit_many(PAIR).ok
        except BackendUnavailable as exc:
            ok = False
            failed += 1
            ambiguous += exc.__cause__.ambiguous
        except Exception as exc:  # anything else reached the caller
            surfaced.append(f"{type(exc).__name__}: {exc}")
            ok = False
        admitted += ok
        if over:
            after.append(ok)
    return {"admitted": admitted, "failed": failed, "ambiguous": ambiguous, "surfaced": surfaced, "after_cuts": after}


@pytest.mark.concurrency
@pytest.mark.only_on("postgres", "mariadb")
@pytest.mark.parametrize(
    "options",
    [{}, pytest.param({"FAST_PATH": False}, marks=pytest.mark.only_on("postgres"))],
    ids=["default-path", "portable-path"],
)
def test_f2_connections_cut_mid_decision_write_all_or_nothing(options):
    """The proxy cuts every connection every 100 ms while 4 processes decide two limits at once.

    A cut transaction is rolled back by the server, so both limits lose a token or neither
    does. A cut COMMIT (or the fast path's one statement) may have committed: the client
    cannot know, so it reports such a failure as ambiguous, and only those may have
    consumed.
    """
    processes = 4
    with database_behind_proxy(OPTIONS={"DATABASE": "proxied", **options}) as proxy, frozen_clock(T0):
        cuts_over = multiprocessing.get_context("fork").Event()
        stop = threading.Event()

        def cut_connections() -> None:
            deadline = time.monotonic() + CUT_FOR_S
            while time.monotonic() < deadline and not stop.wait(CUT_EVERY_S):
                proxy.drop()
            cuts_over.set()

        cutter = threading.Thread(target=cut_connections, daemon=True)
        cutter.start()
        try:
            results = run_processes(_decide_while_connections_are_cut, processes, cuts_over)
        finally:
            stop.set()
            cutter.join()
        values = {name: limiter.get_value(name, "k", config=BIG) for name in ("f2-a", "f2-b")}

    admitted = sum(r["admitted"] for r in results)
    failed = sum(r["failed"] for r in results)
    ambiguous = sum(r["ambiguous"] for r in results)
    consumed = {name: 1_000_000 - value for name, value in values.items()}
    assert [s for r in results for s in r["surfaced"]] == []  # only BackendUnavailable
    assert proxy.dropped > 0 and failed > 0  # the cuts did hit decisions in flight
    assert consumed["f2-a"] == consumed["f2-b"]  # never half-written
    assert admitted <= consumed["f2-a"] <= admitted + ambiguous <= admitted + failed
    # Once the cuts stop, every process decides again: the broken connections were replaced.
    # The first call may still fail: a connection the last cut hit while it sat idle
    # between two calls is only found dead when used (F1 without CONN_HEALTH_CHECKS).
    assert all(r["after_cuts"][1:] == [True] * (AFTER_CUTS - 1) for r in results), [r["after_cuts"] for r in results]
    figure(
        "F2-cut",
        store=settings.DB,
        path="portable" if options or settings.DB != "postgres" else "fast path",
        N=processes,
        cut_for_s=CUT_FOR_S,
        connections_cut=proxy.dropped,
        admitted=admitted,
        failed=failed,
        ambiguous=ambiguous,
        consumed_a=consumed["f2-a"],
        consumed_b=consumed["f2-b"],
        consumed_by_failed_decisions=consumed["f2-a"] - admitted,
    )


# ---------------------------------------------------------------------------------------
# F4: Redis slow: every reply 500 ms late, socket_timeout 50 ms
# ---------------------------------------------------------------------------------------

F4_TIMEOUTS = {"SOCKET_CONNECT_TIMEOUT": 0.05, "SOCKET_TIMEOUT": 0.05}
F4_LATENCY_S = 0.5
F4_DECISIONS = 20
F4_CONFIG = {"rate": 100, "period": 3600}
F4_PAIR = [LimitRequest("f4-a", "k", config=F4_CONFIG), LimitRequest("f4-b", "k", config=F4_CONFIG)]


def scripts_run(client: Any) -> int:
    stats = client.info("commandstats")
    return sum(stats.get(f"cmdstat_{name}", {}).get("calls", 0) for name in ("evalsha", "eval"))


def settle(call: Any, seconds: float = 3.0) -> Any:
    """Call until a decision comes back from Redis: a 50 ms timeout can expire on a busy
    machine, and a node whose breaker opened is tried again within its back-off (1 s at most)."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        try:
            status = call()
        except BackendUnavailable:
            time.sleep(0.01)
            continue
        if not any(s.failed_open for s in status):
            return status
        time.sleep(0.01)
    raise AssertionError(f"no decision in {seconds} s")


@pytest.mark.redis_processes
@pytest.mark.parametrize("fail_open", [False, True], ids=["fail-closed", "fail-open"])
def test_f4_slow_redis_times_out_into_the_fail_mode(fail_open):
    with RedisServer() as server, redis_behind_proxy(server, F4_TIMEOUTS, FAIL_OPEN=fail_open) as proxy:
        direct = server.client()
        # Loaded beforehand, so every script call the server counts is one run of it.
        direct.script_load(SCRIPT)
        backend = get_backend()
        backend_errors: list[object] = []

        def count(sender: Any, **kwargs: Any) -> None:
            backend_errors.append(kwargs["exception"])

        with frozen_clock(T0):
            settle(lambda: limiter.limit_many(F4_PAIR))  # leaves an open connection in the pool
            proxy.latency = F4_LATENCY_S
            if fail_open:
                # Redis answered a moment ago: a reply that is late now is a busy Redis, and
                # FAIL_OPEN does not let that through (issue 35, item 7)...
                with pytest.raises(BackendUnavailable, match="the store is busy"):
                    limiter.limit_many(F4_PAIR)
                # ...but once it has been quiet for BUSY_WINDOW, it is taken for down.
                time.sleep(BUSY_WINDOW + 0.05)
            timeouts_before, ran_before = backend.errors["TimeoutError"], scripts_run(direct)
            refused_before = backend.errors["NodeUnavailable"]
            latencies = []
            signals.rate_limit_backend_error.connect(count)
            try:
                for _ in range(F4_DECISIONS):
                    started = time.perf_counter()
                    if fail_open:
                        status = limiter.limit_many(F4_PAIR)
                        assert status.ok and all(s.failed_open for s in status)
                    else:
                        with pytest.raises(BackendUnavailable):
                            limiter.limit_many(F4_PAIR)
                    latencies.append(time.perf_counter() - started)
            finally:
                signals.rate_limit_backend_error.disconnect(count)
            # Requests reach Redis at once (only replies are late): a script that ran did
            # so whole, though its caller had given up.
            ran = scripts_run(direct) - ran_before
            timeouts = backend.errors["TimeoutError"] - timeouts_before
            refused = backend.errors["NodeUnavailable"] - refused_before
            proxy.resume()
            settle(lambda: limiter.limit_many(F4_PAIR))  # Redis is fast again: decisions are back
            runs = scripts_run(direct)
            values = []
            for name in ("f4-a", "f4-b"):
                raw = direct.get(backend.key(limiter.resolve(name, F4_CONFIG), encode_key("k")))
                values.append(int(raw.split()[0]) // MICRO)
        direct.close()

    # Every decision timed out, or was refused at once by the node's breaker: the first one
    # that had to open a connection saw its handshake time out, which opened it (at the
    # defaults every node has one), and each probe after a back-off timed out again.
    assert timeouts >= 1 and timeouts + refused == F4_DECISIONS and len(backend_errors) == F4_DECISIONS
    assert ran <= F4_DECISIONS  # at most one run per decision: no client retry re-sent it
    # A script that ran for a caller that had given up was reported as maybe applied.
    ambiguous = sum(error.ambiguous for error in backend_errors)
    assert ran <= ambiguous
    # Every run of the script took one token from both limits, and nothing else took any:
    # all or nothing, the runs whose caller had given up included.
    assert values == [100 - runs] * 2
    # A decision waits for its socket timeout, never for the late reply: the bound is
    # below the injected latency.
    bound = F4_TIMEOUTS["SOCKET_CONNECT_TIMEOUT"] + F4_TIMEOUTS["SOCKET_TIMEOUT"] + 0.35
    assert bound < F4_LATENCY_S and max(latencies) <= bound
    figure(
        "F4",
        fail_mode="open" if fail_open else "closed",
        latency_injected_ms=F4_LATENCY_S * 1000,
        socket_timeout_ms=F4_TIMEOUTS["SOCKET_TIMEOUT"] * 1000,
        decisions=F4_DECISIONS,
        timeout_errors=timeouts,
        refused_by_the_breaker=refused,
        decision_ms={
            "p50": round(pct(latencies, 0.5) * 1000, 1),
            "p99": round(pct(latencies, 0.99) * 1000, 1),
            "max": round(max(latencies) * 1000, 1),
        },
        scripts_that_ran_anyway=ran,
        ambiguous=ambiguous,
    )


# ---------------------------------------------------------------------------------------
# The proxy itself
# ---------------------------------------------------------------------------------------


@contextmanager
def echo_server():
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=echo, args=(conn,), daemon=True).start()

    def echo(conn: Any) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:  # the proxy cut the connection
                pass

    threading.Thread(target=serve, daemon=True).start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.close()


def _exchange(port: int, payload: bytes = b"ping", timeout: float = 2.0) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(payload)
        return sock.recv(64)


def _child_holds_the_proxy(ready: Any, done: Any) -> None:
    ready.set()
    done.wait(10)


@pytest.mark.django_db(databases=[])
def test_the_proxy_passes_delays_refuses_blackholes_and_cuts():
    with echo_server() as upstream, FaultProxy("127.0.0.1", upstream) as proxy:
        assert _exchange(proxy.port) == b"ping"
        proxy.latency = 0.3
        started = time.perf_counter()
        assert _exchange(proxy.port) == b"ping"
        assert time.perf_counter() - started >= 0.3
        proxy.latency = 0.0

        # A forked child keeps no copy of the listener: refusing still refuses.
        context = multiprocessing.get_context("fork")
        ready, done = context.Event(), context.Event()
        child = context.Process(target=_child_holds_the_proxy, args=(ready, done), daemon=True)
        child.start()
        try:
            assert ready.wait(10)
            proxy.refuse()
            with pytest.raises(ConnectionRefusedError):
                _exchange(proxy.port)
        finally:
            done.set()
            child.join(10)

        proxy.blackhole()  # listens again, answers nothing
        with pytest.raises(TimeoutError):
            _exchange(proxy.port, timeout=0.3)

        proxy.resume()
        with socket.create_connection(("127.0.0.1", proxy.port), timeout=2) as sock:
            sock.sendall(b"one")
            assert sock.recv(64) == b"one"
            # >= 1: the black-holed connection above may not have noticed its client left yet.
            assert proxy.drop() >= 1
            with pytest.raises((ConnectionResetError, BrokenPipeError)):
                sock.sendall(b"two")
                if not sock.recv(64):
                    raise ConnectionResetError
        assert _exchange(proxy.port) == b"ping"
