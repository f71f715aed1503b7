"""A primary of a real Redis Cluster SIGKILLed while several OS processes decide
(issue 34): the backend's deadline and per-node breaker, sync and asyncio, at the
defaults (issue 46): no ``TIMEOUT`` in the settings, so the default deadline (0.2 s).

A local cluster of its own (3 primaries, a replica each, ``cluster-node-timeout`` 2000,
tests/redis_servers.py) serves 4 processes deciding round-robin on 48 keys spread over
the three primaries, with the documented client settings (``SOCKET_CONNECT_TIMEOUT``
0.2, ``SOCKET_TIMEOUT`` 0.1), and again with none (``bare``: what a project that
configures nothing has; the backend's own connections then time out within the
deadline). Every key's bucket is spent before the kill, so the rest of the run is
denials that write nothing: what a replica may not have received when its primary died
(asynchronous replication, see docs/redis.md) does not enter the count, and any
admission past a bucket's capacity would be the backend's doing. What is asserted:

- a call failed by a node's breaker made no connection attempt (counted by the
  connection class, per call);
- the failed calls' p50 is at most 5 ms (they fail at once: issue 34's target), and no
  call outlived the deadline by more than a generous margin;
- the healthy keys' slowest call took at most 300 ms (the deadline, plus what scheduling
  on a loaded 2-core machine adds; without a deadline they took up to a second);
- no key was admitted more than its capacity;
- every process decided on the crashed primary's keys again after the replica was
  promoted, without a restart;
- healthy keys never failed because of the crashed node's breaker.

The same crash under Sentinel (a master, its replica, one sentinel failing over after
1 s of silence) holds to the same assertions; there every key is on the master.

The figures (failure window, failed-call latency, healthy keys' latency) are printed, and
appended as JSON lines to the file ``TOKENBUCKET_FAILOVER_FIGURES`` names, if set
(``make bench-failover``, benchmarks/suite/failover.py, writes them to docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import multiprocessing
import os
import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import redis
from django.conf import settings
from django.test import override_settings
from redis.cluster import RedisCluster

from django_tokenbucket import BackendUnavailable, limiter
from django_tokenbucket.backends import get_backend
from django_tokenbucket.backends.redis import aio
from django_tokenbucket.backends.redis.bounded import DEFAULT_TIMEOUT
from django_tokenbucket.backends.redis.breaker import BREAKERS
from django_tokenbucket.keys import encode_key
from django_tokenbucket.testing import frozen_clock

from .concurrency import run_processes
from .redis_servers import (
    CONNECTS,
    AsyncCountingConnection,
    AsyncCountingSentinelConnection,
    CountingConnection,
    CountingSentinelConnection,
    LocalCluster,
    LocalSentinel,
    RedisServer,
)
from .settings import TOKENBUCKET as BASE_SETTINGS

pytestmark = [
    pytest.mark.redis_processes,
    pytest.mark.concurrency,
    pytest.mark.redis_faults,
    pytest.mark.default_deadline,
]

T0 = 1_700_000_000.0
#: No TIMEOUT in the settings: every call has the default deadline.
TIMEOUT = DEFAULT_TIMEOUT
#: Beyond TIMEOUT, what scheduling on a busy 2-core machine may add; the unbounded calls
#: of issue 34 took up to ~1 s on healthy keys and seconds on the crashed node's.
MARGIN = 0.6
#: Issue 46's targets at the defaults: the failed calls' p50, and the healthy keys' slowest
#: call (the deadline, waiting out CLUSTERDOWN, and 100 ms for scheduling; issue 34's
#: unbounded calls took 1,072 ms).
FAILED_CALL_P50 = 0.005
HEALTHY_SLOWEST = 0.3
#: The client settings of the runs: docs/redis.md's, and none at all.
CACHE_SETTINGS = {
    "documented": {"SOCKET_CONNECT_TIMEOUT": 0.2, "SOCKET_TIMEOUT": 0.1},
    "bare": {},
}
CAPACITY = 3
KEYS = [f"crash-{i}" for i in range(48)]
LIMIT = {"rate": CAPACITY, "period": 3600}
PROCESSES = 4
TASKS = 4
#: Seconds of load before the kill, and at most after it (the run ends earlier once
#: every process has decided on the crashed primary's keys after the promotion).
BEFORE_KILL = 1.0
AFTER_KILL = 15.0


@pytest.fixture(params=sorted(CACHE_SETTINGS))
def cache_settings(request) -> str:
    return request.param


@pytest.fixture
def crash_cluster(monkeypatch, without_deny_cache, cache_settings):
    # Without the deny cache: the workers' clock is pinned, so the spent buckets would be
    # refused from memory for the whole run and never meet the crashed store.
    monkeypatch.setitem(aio._ASYNCIO_CLASSES, CountingConnection, AsyncCountingConnection)
    local = LocalCluster(masters=3, replicas=1).start()
    cache = {
        "BACKEND": "django_redis.cache.RedisCache",
        "LOCATION": local.url,
        "KEY_PREFIX": settings.REDIS_KEY_PREFIX,
        "OPTIONS": {
            "CONNECTION_FACTORY": "django_tokenbucket.backends.redis.ClusterConnectionFactory",
            **CACHE_SETTINGS[cache_settings],
            "REDIS_CLIENT_KWARGS": {"connection_class": CountingConnection},
        },
    }
    try:
        with deciding_on(cache):
            yield local
    finally:
        local.close()


@contextmanager
def deciding_on(cache: dict[str, Any]) -> Iterator[None]:
    """The Redis backend on ``cache`` (as the alias "crash"), with no TIMEOUT, and fresh breakers."""
    tokenbucket = {
        **BASE_SETTINGS,
        "BACKEND": "django_tokenbucket.backends.redis.RedisBackend",
        "OPTIONS": {"CACHE": "crash"},
    }
    BREAKERS.clear()
    try:
        with override_settings(CACHES={**settings.CACHES, "crash": cache}, TOKENBUCKET=tokenbucket):
            yield
    finally:
        BREAKERS.clear()


def key_ports(backend) -> dict[str, int]:
    """Each key's primary (its port), as the cluster stands before the crash."""
    client: RedisCluster = backend.client()
    config = limiter.resolve("crash", config=LIMIT)
    return {key: client.get_node_from_key(backend.key(config, encode_key(key))).port for key in KEYS}


class Recorder:
    """What one process saw of each call: when, how long, how it ended, and what the
    crashed node's breaker and connection count did meanwhile."""

    def __init__(self, ports: dict[str, int], dead_port: int, dead_node: str, flag: Any) -> None:
        self.ports, self.dead_port, self.dead_node, self.flag = ports, dead_port, dead_node, flag
        self.calls: list[tuple[float, float, str, bool]] = []  # start, seconds, outcome, on the dead node
        self.admitted: Counter[str] = Counter()
        self.violations: list[str] = []
        self.healthy_refused = 0
        self.healthy_errors: Counter[str] = Counter()

    def before(self) -> tuple[int, int]:
        return CONNECTS[self.dead_port], BREAKERS.get(self.dead_node).rejected

    def after(self, key: str, started: float, before: tuple[int, int], outcome: str, text: str) -> None:
        elapsed = time.monotonic() - started
        dead = self.ports[key] == self.dead_port
        connects, rejected = self.before()
        if rejected > before[1] and connects != before[0]:
            self.violations.append(f"a call refused by the breaker made {connects - before[0]} connection attempt(s)")
        if not dead and "could not be reached lately" in text and self.dead_node in text:
            self.healthy_refused += 1
        if not dead and outcome == "failed":
            # "the store failed: ClusterDownError: ...", or "the store is busy (...): DeadlineExceeded: ..."
            self.healthy_errors[re.sub(r"^.*?the store (?:failed|is busy \([^)]*\)): ", "", text).partition(":")[0]] += 1
        self.calls.append((started, elapsed, outcome, dead))

    def result(self) -> dict[str, Any]:
        return {
            "calls": self.calls,
            "admitted": dict(self.admitted),
            "violations": self.violations,
            "healthy_refused": self.healthy_refused,
            "healthy_errors": dict(self.healthy_errors),
            "rejected": BREAKERS.get(self.dead_node).rejected,
            "connects_to_dead": CONNECTS[self.dead_port],
            "decisions": dict(get_backend().async_calls),
        }

    def running(self, ends: float) -> bool:
        return time.monotonic() < ends and not self.flag.is_set()


def sync_worker(
    barrier, index: int, ports: dict[str, int], dead_port: int, dead_node: str, flag, go
) -> dict[str, Any]:
    recorder = Recorder(ports, dead_port, dead_node, flag)
    with frozen_clock(T0):
        warm_up()
    meet(barrier, go)
    ends = time.monotonic() + BEFORE_KILL + AFTER_KILL
    i = index
    with frozen_clock(T0):
        while recorder.running(ends):
            key = KEYS[i % len(KEYS)]
            i += 1
            before, started = recorder.before(), time.monotonic()
            try:
                status = limiter.limit("crash", key, config=LIMIT)
                outcome, text = ("admitted" if status.ok else "denied"), ""
                recorder.admitted[key] += status.ok
            except BackendUnavailable as exc:
                outcome, text = "failed", str(exc)
            recorder.after(key, started, before, outcome, text)
    return recorder.result()


def asyncio_worker(
    barrier, index: int, ports: dict[str, int], dead_port: int, dead_node: str, flag, go
) -> dict[str, Any]:
    recorder = Recorder(ports, dead_port, dead_node, flag)
    ends = 0.0

    async def task(offset: int) -> None:
        i = offset
        while recorder.running(ends):
            key = KEYS[i % len(KEYS)]
            i += 1
            # The counts are read around the call with no await between them and its
            # start or end, but other tasks run while it waits: a per-call count is exact
            # only for the calls that never waited, the ones the breaker refused.
            before, started = recorder.before(), time.monotonic()
            try:
                status = await limiter.alimit("crash", key, config=LIMIT)
                outcome, text = ("admitted" if status.ok else "denied"), ""
                recorder.admitted[key] += status.ok
            except BackendUnavailable as exc:
                outcome, text = "failed", str(exc)
            if outcome == "failed" and "could not be reached lately" in text:
                recorder.after(key, started, before, outcome, text)
            else:
                recorder.after(key, started, recorder.before(), outcome, text)
            # A call the breaker refused never waited: yield, as a server does between
            # requests, or this task would starve the others until the back-off ends.
            await asyncio.sleep(0)

    async def main() -> None:
        nonlocal ends
        # This loop's client is built before the load starts (see warm_up), and the
        # processes meet with nothing else running on the loop.
        await awarm_up()
        meet(barrier, go)
        ends = time.monotonic() + BEFORE_KILL + AFTER_KILL
        await asyncio.gather(*(task(index * TASKS + n) for n in range(TASKS)))

    with frozen_clock(T0):
        asyncio.run(main())
    return recorder.result()


def warm_up() -> None:
    """Decide once before the load, on the process's own client.

    A process's first call builds its client: the cache's classes imported, the cluster's
    topology read. On asyncio that is synchronous work the event loop cannot interrupt,
    which on a machine with a cold disk cache (the first env of a CI run) held a first
    call 1.2 s past its deadline. It happens once per process (per event loop), before any
    crash; what is measured here is the crash. The call may itself fail at its deadline
    for the same reason: the client stays built, and a worker that stopped here would
    leave the others waiting at the barrier.
    """
    try:
        limiter.check("crash", KEYS[0], config=LIMIT)
    except BackendUnavailable:
        pass


async def awarm_up() -> None:
    """``warm_up`` on the running event loop's client."""
    try:
        await limiter.acheck("crash", KEYS[0], config=LIMIT)
    except BackendUnavailable:
        pass


def meet(barrier, go) -> None:
    """Wait for the other workers; then tell the killer that the load has started."""
    barrier.wait()
    go.set()


class Killer(threading.Thread):
    """Kills the primary BEFORE_KILL after the workers started, and watches for its
    replica's promotion."""

    def __init__(self, dead, replica, flag, started) -> None:
        super().__init__(daemon=True)
        self.dead, self.replica, self.flag, self.started = dead, replica, flag, started
        self.killed_at = self.promoted_at = None

    def run(self) -> None:
        if not self.started.wait(60):
            self.flag.set()  # the workers never started: end their run
            return
        time.sleep(BEFORE_KILL)
        self.dead.process.kill()  # SIGKILL
        self.dead.process.wait()
        self.killed_at = time.monotonic()
        client = self.replica.client()
        try:
            while time.monotonic() < self.killed_at + AFTER_KILL - 3:
                try:
                    if client.info("replication")["role"] == "master":
                        self.promoted_at = time.monotonic()
                        break
                except Exception:
                    pass
                time.sleep(0.02)
        finally:
            client.close()
        if self.promoted_at is not None:
            time.sleep(3.0)  # the workers' figures after the promotion
        self.flag.set()


def spend_every_bucket() -> None:
    with frozen_clock(T0):
        for key in KEYS:
            for _ in range(CAPACITY):
                assert limiter.limit("crash", key, config=LIMIT).ok
            assert not limiter.limit("crash", key, config=LIMIT).ok


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def crash_under_load(api: str, dead, replica, ports: dict[str, int], dead_node: str):
    """Kill ``dead`` while PROCESSES processes decide on ``ports``' keys; their results, the
    killer (when it killed, when ``replica`` was promoted) and the figures."""
    context = multiprocessing.get_context("fork")
    flag, started = context.Event(), context.Event()
    killer = Killer(dead, replica, flag, started)
    killer.start()
    worker = sync_worker if api == "sync" else asyncio_worker
    args = (ports, dead.port, dead_node, flag, started)
    results = run_processes(worker, PROCESSES, *args, timeout=BEFORE_KILL + AFTER_KILL + 60)
    killer.join(5)
    assert killer.killed_at is not None and killer.promoted_at is not None, "the replica was not promoted"

    calls = [call for result in results for call in result["calls"]]
    failed_dead = [c for c in calls if c[2] == "failed" and c[3]]
    failed_healthy = [c for c in calls if c[2] == "failed" and not c[3]]
    after = [c for c in calls if c[0] > killer.promoted_at + 0.5]
    healthy = [c for c in calls if not c[3]]

    def ms(values: list[float], *qs: float) -> list[float]:
        return [round(percentile(values, q) * 1000, 2) for q in qs]

    figures = {
        "api": api,
        "calls": len(calls),
        "failed on the crashed primary": len(failed_dead),
        "failed on healthy primaries": len(failed_healthy),
        "healthy failures by error": sum((Counter(r["healthy_errors"]) for r in results), Counter()),
        "refused by the breaker": sum(r["rejected"] for r in results),
        "connects to the crashed node": sum(r["connects_to_dead"] for r in results),
        "failure window s": round(max(c[0] + c[1] for c in failed_dead) - min(c[0] for c in failed_dead), 3)
        if failed_dead
        else 0,
        "promotion after kill s": round(killer.promoted_at - killer.killed_at, 3),
        "failed call ms p50/max": ms([c[1] for c in failed_dead], 0.5, 1),
        "healthy ms p50/p99 before": ms([c[1] for c in healthy if c[0] < killer.killed_at], 0.5, 0.99),
        "healthy ms p50/p99 between kill and promotion": ms(
            [c[1] for c in healthy if killer.killed_at < c[0] < killer.promoted_at], 0.5, 0.99
        ),
        "healthy ms p50/p99 after promotion": ms([c[1] for c in after if not c[3]], 0.5, 0.99),
        "slowest call ms": round(max(c[1] for c in calls) * 1000, 1),
        "healthy slowest call ms": round(max(c[1] for c in healthy) * 1000, 1) if healthy else None,
    }
    return results, killer, figures


def report(topology: str, cache_settings: str, figures: dict[str, Any]) -> None:
    if cache_settings == "bare":
        topology += ", no socket timeouts"
    print(f"\nissue 34 {topology} crash ({figures['api']}): {figures}")
    if path := os.environ.get("TOKENBUCKET_FAILOVER_FIGURES"):
        with open(path, "a") as out:
            out.write(json.dumps({"topology": topology, **figures}) + "\n")


def assert_failed_fast_bounded_and_resumed(results, killer, figures) -> None:
    calls = [call for result in results for call in result["calls"]]
    # While a breaker was open, the calls it refused made no connection attempt.
    assert [v for r in results for v in r["violations"]] == []
    assert figures["refused by the breaker"] > 0
    # The crashed node's calls failed fast (at once, most of them)...
    failed_dead = sorted(c[1] for c in calls if c[2] == "failed" and c[3])
    assert failed_dead[len(failed_dead) // 2] <= FAILED_CALL_P50, figures
    # ...no call outlived the deadline by more than the margin, and the healthy keys'
    # calls not by more than what scheduling adds.
    assert max(c[1] for c in calls) < TIMEOUT + MARGIN, figures
    assert max((c[1] for c in calls if not c[3]), default=0) <= HEALTHY_SLOWEST, figures
    # No over-admission: every bucket was spent before the kill, and stays spent.
    admitted: Counter[str] = Counter()
    for result in results:
        admitted.update(result["admitted"])
    assert sum(admitted.values()) == 0, admitted
    # The healthy keys failed only as the cluster being down made them (past TIMEOUT), or
    # by their own socket timeout on a busy machine; no breaker ever refused them...
    healthy_errors = set(figures["healthy failures by error"])
    assert healthy_errors <= {"DeadlineExceeded", "ClusterDownError", "TimeoutError"}, figures
    # ...and the crashed primary's keys failed (that is the window), the healthy keys never
    # because of its breaker...
    assert figures["failed on the crashed primary"] and sum(r["healthy_refused"] for r in results) == 0
    # ...and every process decided on the crashed primary's keys again after the
    # promotion, without a restart.
    for result in results:
        resumed = [c for c in result["calls"] if c[3] and c[0] > killer.promoted_at and c[2] != "failed"]
        assert resumed, "a process never decided on the crashed primary's keys after the promotion"
    if figures["api"] == "asyncio":
        assert all(r["decisions"].get("thread", 0) == 0 for r in results)


@pytest.mark.parametrize("api", ["sync", "asyncio"])
def test_a_primary_killed_under_load_fails_fast_bounded_and_resumes(crash_cluster, cache_settings, api):
    backend = get_backend()
    ports = key_ports(backend)
    by_node = Counter(ports.values())
    assert len(by_node) == 3, by_node
    spend_every_bucket()
    dead_port = max(by_node, key=by_node.get)
    dead = next(server for server in crash_cluster.servers if server.port == dead_port)
    key = next(key for key, port in ports.items() if port == dead_port)
    slot = backend.client().keyslot(backend.key(limiter.resolve("crash", config=LIMIT), encode_key(key)))
    replica = crash_cluster.node_for_slot(slot, role="replica")
    # The replica holds every write before the kill (all buckets were spent above).
    crash_cluster.wait_until_ok()
    results, killer, figures = crash_under_load(api, dead, replica, ports, f"127.0.0.1:{dead_port}")
    report("cluster", cache_settings, figures)
    assert_failed_fast_bounded_and_resumed(results, killer, figures)


#: Service names already used: django-redis keeps a Sentinel pool per URL for the process.
SERVICES = itertools.count()
#: docs/redis.md's Sentinel settings (SOCKET_TIMEOUT at the deadline), and none.
SENTINEL_SETTINGS = {
    "documented": {
        "SENTINEL_KWARGS": {"socket_timeout": 0.1},
        "SOCKET_CONNECT_TIMEOUT": 0.2,
        "SOCKET_TIMEOUT": TIMEOUT,
    },
    "bare": {},
}


@pytest.fixture
def crash_sentinel(monkeypatch, without_deny_cache, cache_settings):
    """A master, its replica and a sentinel that fails over after 1 s of silence."""
    service = f"tbcrash{next(SERVICES)}"
    monkeypatch.setitem(aio._ASYNCIO_CLASSES, CountingSentinelConnection, AsyncCountingSentinelConnection)
    with RedisServer() as master, RedisServer() as replica:
        replica.client().replicaof("127.0.0.1", master.port)
        with LocalSentinel(master, service=service, down_after_ms=1000) as sentinel:
            cache = {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": f"redis://{service}/0",
                "KEY_PREFIX": settings.REDIS_KEY_PREFIX,
                "OPTIONS": {
                    "CLIENT_CLASS": "django_redis.client.SentinelClient",
                    "CONNECTION_FACTORY": "django_redis.pool.SentinelConnectionFactory",
                    "SENTINELS": [sentinel.address],
                    **SENTINEL_SETTINGS[cache_settings],
                    "CONNECTION_POOL_KWARGS": {"connection_class": CountingSentinelConnection},
                },
            }
            with deciding_on(cache):
                yield master, replica, sentinel


def wait_for_replica(sentinel, master, replica) -> None:
    """Until the sentinel knows the replica, and the replica holds every write of the master."""
    client, ends = redis.Redis(host="127.0.0.1", port=sentinel.port, socket_timeout=1), time.monotonic() + 30
    try:
        while (
            not client.sentinel_slaves(sentinel.service)
            or replica.client().info("replication")["master_repl_offset"]
            < master.client().info("replication")["master_repl_offset"]
        ):
            assert time.monotonic() < ends, "the sentinel never saw the replica in sync"
            time.sleep(0.1)
    finally:
        client.close()


@pytest.mark.parametrize("api", ["sync", "asyncio"])
def test_a_sentinel_master_killed_under_load_fails_fast_bounded_and_resumes(crash_sentinel, cache_settings, api):
    """The same crash under Sentinel: every key lives on the master, so every key fails
    until the sentinel has promoted the replica and a probe finds it through the sentinel."""
    master, replica, sentinel = crash_sentinel
    spend_every_bucket()
    wait_for_replica(sentinel, master, replica)
    ports = dict.fromkeys(KEYS, master.port)
    results, killer, figures = crash_under_load(api, master, replica, ports, f"sentinel:{sentinel.service}")
    report("sentinel", cache_settings, figures)
    assert_failed_fast_bounded_and_resumed(results, killer, figures)
