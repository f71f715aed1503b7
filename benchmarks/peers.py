#!/usr/bin/env python
"""django-tokenbucket next to its peers and to bare round trips, in one run (issue 8).

Every implementation is an *adapter* with one method, ``decide(key) -> allowed``, given the
same limit (100 per second, burst 100) on the same PostgreSQL and Redis:

    baseline   SELECT 1 (Django connection)   PING (django-redis client)
    ours       database backend (portable path, PostgreSQL)   Redis backend
    reference  textbook ORM token bucket: atomic + get_or_create + select_for_update + save
    peers      django-ratelimit (fixed window)   DRF UserRateThrottle (sliding log)
               limits: fixed window, moving window (Redis storage)

Phases, each adapter in every round of each phase (rounds rotate the order, so that all
adapters see the same machine load):

1. sanity: a limit of 5 allows exactly 5 sequential calls; otherwise the run stops.
2. round trips per decision, counted on the wire: libpq's trace (every ReadyForQuery,
   BEGIN and COMMIT included) and redis-py's sends.
3. single process: p50/p99 latency and decisions/s, on 1,000 distinct keys and on one hot key.
4. ``--processes`` (8) processes on one hot key, started together by a barrier:
   decisions/s, and admitted against what the algorithm allows in that time.
5. the database backend with 10^3 and then 10^6 stored rows (``--rows``), loaded with
   ``INSERT ... generate_series``.
6. Redis bytes per key (``MEMORY USAGE``) after 10 decisions on one key.

    make bench                                           # creates .venv-bench, runs this
    .venv-bench/bin/python benchmarks/peers.py --json benchmarks/results/latest.json
    .venv-bench/bin/python benchmarks/peers.py --quick   # about a minute

Not a test: it asserts nothing about speed. It prints a table (and writes JSON with
``--json PATH``); the targets of issue 8 are reported as ratios from the same run.
PostgreSQL: database ``tokenbucket_bench``, created and dropped here. Redis: database 14,
keys under ``tbbench`` only.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.peers_settings"


def setup_django() -> None:
    import django

    django.setup()


# --------------------------------------------------------------------------- adapters


class Adapter:
    """One implementation behind ``decide(key) -> allowed``, for the limit ``spec`` of the settings."""

    name = ""
    family = ""  # baseline, ours, reference, peer
    store = ""  # postgresql, redis
    algorithm = ""
    #: The glob of the Redis keys it writes (for MEMORY USAGE), or None.
    redis_pattern: str | None = None

    def __init__(self, spec: str) -> None:
        from django.conf import settings

        self.spec = spec
        self.count, self.period = settings.SPECS[spec]

    def decide(self, key: str) -> bool:
        raise NotImplementedError

    def rate_string(self, long: bool = False) -> str:
        unit = {1: "second", 60: "minute", 3600: "hour"}[self.period]
        return f"{self.count}/{unit if long else unit[0]}"

    def bound(self, elapsed: float) -> float | None:
        """Most admissions the algorithm allows in ``elapsed`` seconds on a fresh key."""
        windows = elapsed / self.period
        if self.algorithm == "token bucket":
            return self.count + self.count * windows
        if self.algorithm in {"sliding log", "moving window"}:
            return self.count * (math.floor(windows) + 1)
        if self.algorithm == "fixed window":
            # An interval of that length overlaps at most floor(Δ/W) + 2 windows.
            return self.count * (math.floor(windows) + 2)
        return None


class SelectOne(Adapter):
    name, family, store, algorithm = "SELECT 1", "baseline", "postgresql", "-"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django.db import connection

        self.connection = connection

    def decide(self, key: str) -> bool:
        with self.connection.cursor() as cursor:
            cursor.execute("SELECT 1")
            cursor.fetchone()
        return True


class UpdateOne(Adapter):
    """One durable write in autocommit (``UPDATE ... SET n = n + 1``, a WAL flush at commit): the
    floor for any limiter that writes its state to PostgreSQL."""

    name, family, store, algorithm = "UPDATE 1 row", "baseline", "postgresql", "-"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django.db import connection

        self.connection = connection

    def decide(self, key: str) -> bool:
        with self.connection.cursor() as cursor:
            cursor.execute("UPDATE bench_counter SET n = n + 1 WHERE id = %s", [zlib.crc32(key.encode()) % 1000])
        return True


class Ping(Adapter):
    name, family, store, algorithm = "PING", "baseline", "redis", "-"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django_redis import get_redis_connection

        self.client = get_redis_connection("default")

    def decide(self, key: str) -> bool:
        return bool(self.client.ping())


class _Ours(Adapter):
    """``limiter.limit()`` — the public API, Status and signals included — on one backend.

    The limiter uses the process' configured backend; both of ours live in one process
    here, so the adapter puts its own in place before each call (a module attribute).
    """

    family, algorithm = "ours", "token bucket"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django_tokenbucket.api import Limiter

        self.backend = self.make_backend()
        # A limiter of its own on this adapter's backend: the adapters of one process
        # never share the process-wide default.
        self.limiter = Limiter(self.backend)

    def make_backend(self) -> Any:
        raise NotImplementedError

    def decide(self, key: str) -> bool:
        return self.limiter.limit(self.spec, key).ok


class OursDatabase(_Ours):
    """The database backend as configured by default: on PostgreSQL, its fast path (one
    statement per decision)."""

    name, store = "tokenbucket db", "postgresql"
    options: dict[str, Any] = {}
    #: Keys of another adapter's rows in the same table.
    key_prefix = ""

    def make_backend(self) -> Any:
        from django_tokenbucket.backends.database import DatabaseBackend

        return DatabaseBackend(self.options)

    def decide(self, key: str) -> bool:
        return super().decide(self.key_prefix + key)


class OursDatabasePortable(OursDatabase):
    """The portable path (``select_for_update`` in a transaction), used inside the caller's
    transaction and on other databases: ``FAST_PATH = False``."""

    name, options, key_prefix = "tokenbucket db portable", {"FAST_PATH": False}, "portable:"


class OursDatabaseAsyncCommit(OursDatabase):
    """The fast path with ``ASYNC_COMMIT``: commits do not wait for the WAL flush (a
    database crash may lose the last fraction of a second of consumption)."""

    name, options, key_prefix = "tokenbucket db async commit", {"ASYNC_COMMIT": True}, "async:"


class OursDatabaseSharded(OursDatabase):
    """The fast path on a limit spread over shards (``"shards": 8`` for the 100/s limit,
    2 for the small sanity and memory limits, whose 5 tokens split only so far)."""

    name, key_prefix = "tokenbucket db 8 shards", "sharded:"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        self.config = {"rate": self.count, "period": self.period, "shards": 8 if spec == "bench" else 2}

    def decide(self, key: str) -> bool:
        return self.limiter.limit(f"{self.spec}-sharded", self.key_prefix + key, config=self.config).ok


class OursDatabaseShardedPortable(OursDatabaseSharded):
    """The same shards on the portable path, which holds each row's lock for 4 round trips."""

    name, options, key_prefix = "tokenbucket db portable 8 shards", {"FAST_PATH": False}, "sharded-portable:"


class OursRedis(_Ours):
    name, store = "tokenbucket redis", "redis"
    redis_pattern = "tbbench:*:tokenbucket:*"

    def make_backend(self) -> Any:
        from django_tokenbucket.backends.redis import RedisBackend

        return RedisBackend({"CACHE": "default"})


class TextbookORM(Adapter):
    """The token bucket most tutorials write: lock the row, refill by the app's clock, save."""

    name, family, store, algorithm = "textbook ORM", "reference", "postgresql", "token bucket"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django.db import transaction

        from benchmarks.textbook.models import Bucket

        self.atomic = transaction.atomic
        self.buckets = Bucket.objects
        self.per_second = self.count / self.period

    def decide(self, key: str) -> bool:
        with self.atomic():
            bucket, _ = self.buckets.select_for_update().get_or_create(
                key=f"{self.spec}:{key}", defaults={"tokens": self.count, "updated": time.time()}
            )
            now = time.time()
            bucket.tokens = min(self.count, bucket.tokens + max(0.0, now - bucket.updated) * self.per_second)
            bucket.updated = now
            allowed = bucket.tokens >= 1
            if allowed:
                bucket.tokens -= 1
            bucket.save()
            return allowed


class DjangoRatelimit(Adapter):
    """django-ratelimit's core (what its decorator calls): cache.add, then cache.incr."""

    name, family, store, algorithm = "django-ratelimit", "peer", "redis", "fixed window"
    redis_pattern = "tbbench:*:rl:*"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django.test import RequestFactory
        from django_ratelimit.core import is_ratelimited

        self.is_ratelimited = is_ratelimited
        self.request = RequestFactory().get("/")
        self.rate = self.rate_string()
        self.key = ""

    def _key(self, group: str, request: object) -> str:
        return self.key

    def decide(self, key: str) -> bool:
        self.key = key
        return not self.is_ratelimited(self.request, group=self.spec, key=self._key, rate=self.rate, increment=True)


class DRFThrottle(Adapter):
    """DRF's stock UserRateThrottle (SimpleRateThrottle's history list in the cache), made per call as DRF does."""

    name, family, store, algorithm = "DRF UserRateThrottle", "peer", "redis", "sliding log"
    redis_pattern = "tbbench:*:throttle_*"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from rest_framework.throttling import UserRateThrottle

        self.throttle_class = type("BenchThrottle", (UserRateThrottle,), {"rate": self.rate_string(), "scope": spec})

    def decide(self, key: str) -> bool:
        request = SimpleNamespace(user=SimpleNamespace(is_authenticated=True, pk=key))
        return bool(self.throttle_class().allow_request(request, None))


class _Limits(Adapter):
    family, store = "peer", "redis"
    redis_pattern = "tbbench-limits*"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        import limits
        from django.conf import settings
        from limits.storage import RedisStorage

        storage = RedisStorage(settings.REDIS_URL, key_prefix="tbbench-limits")
        self.limiter = self.strategy(limits.strategies)(storage)
        self.item = limits.parse(f"{self.count} per {self.period} second")

    def strategy(self, strategies: Any) -> Any:
        raise NotImplementedError

    def decide(self, key: str) -> bool:
        # The strategies store different types: keep their keys apart.
        return bool(self.limiter.hit(self.item, self.spec, self.algorithm, key))


class LimitsFixed(_Limits):
    name, algorithm = "limits fixed window", "fixed window"

    def strategy(self, strategies: Any) -> Any:
        return strategies.FixedWindowRateLimiter


class LimitsMoving(_Limits):
    name, algorithm = "limits moving window", "moving window"

    def strategy(self, strategies: Any) -> Any:
        return strategies.MovingWindowRateLimiter


ADAPTERS: list[type[Adapter]] = [
    SelectOne,
    UpdateOne,
    OursDatabase,
    OursDatabasePortable,
    OursDatabaseAsyncCommit,
    OursDatabaseSharded,
    OursDatabaseShardedPortable,
    TextbookORM,
    Ping,
    OursRedis,
    DjangoRatelimit,
    DRFThrottle,
    LimitsFixed,
    LimitsMoving,
]


def make_adapters(spec: str, only: set[str] | None = None) -> dict[str, Adapter]:
    return {cls.name: cls(spec) for cls in ADAPTERS if only is None or cls.name in only}


# --------------------------------------------------------------------------- stores


def _admin_connection() -> Any:
    import psycopg
    from django.conf import settings

    return psycopg.connect(
        host=settings.PG_HOST, port=settings.PG_PORT, user=settings.PG_USER, dbname="postgres", autocommit=True
    )


@contextmanager
def bench_stores() -> Iterator[None]:
    """Create and migrate ``tokenbucket_bench`` and clear our Redis keys; undo both afterwards."""
    from django.conf import settings
    from django.core.management import call_command
    from django.db import connections

    with _admin_connection() as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {settings.PG_DATABASE} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {settings.PG_DATABASE}")
    clear_redis()
    try:
        call_command("migrate", run_syncdb=True, verbosity=0)
        with connections["default"].cursor() as cursor:
            cursor.execute("CREATE TABLE bench_counter (id int PRIMARY KEY, n bigint NOT NULL DEFAULT 0)")
            cursor.execute("INSERT INTO bench_counter (id) SELECT generate_series(0, 999)")
        yield
    finally:
        connections.close_all()
        clear_redis()
        with _admin_connection() as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {settings.PG_DATABASE} WITH (FORCE)")


def redis_client() -> Any:
    from django_redis import get_redis_connection

    return get_redis_connection("default")


def clear_redis() -> None:
    from django.conf import settings

    client = redis_client()
    for key in client.scan_iter(match=f"{settings.REDIS_PREFIX}*", count=1000):
        client.delete(key)


# --------------------------------------------------------------------------- counting round trips


@contextmanager
def count_round_trips() -> Iterator[dict[str, int]]:
    """Count what goes over the wire: PostgreSQL round trips (libpq trace) and Redis sends/replies."""
    from django.db import connections
    from redis.connection import AbstractConnection

    counts = {"sql": 0, "redis": 0, "redis_replies": 0}
    pgconns = []
    for alias in connections:
        connections[alias].ensure_connection()
        pgconns.append(connections[alias].connection.pgconn)
    trace = tempfile.TemporaryFile("w+")
    send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response

    def counting_send(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["redis"] += 1
        return send(self, *args, **kwargs)

    def counting_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["redis_replies"] += 1
        return read(self, *args, **kwargs)

    AbstractConnection.send_packed_command = counting_send  # type: ignore[method-assign]
    AbstractConnection.read_response = counting_read  # type: ignore[method-assign]
    for pgconn in pgconns:
        pgconn.trace(trace.fileno())
    try:
        yield counts
    finally:
        for pgconn in pgconns:
            pgconn.untrace()
        AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
        AbstractConnection.read_response = read  # type: ignore[method-assign]
        trace.seek(0)
        # One ReadyForQuery from the server closes every round trip (simple or extended protocol).
        counts["sql"] = sum(1 for line in trace if "\tB\t" in line and "\tReadyForQuery" in line)
        trace.close()


def round_trips(adapters: dict[str, Adapter], keys: int = 50) -> dict[str, dict[str, float]]:
    result = {}
    for name, adapter in adapters.items():
        names = [f"rt:{i}" for i in range(keys)]
        for key in names:  # rows, keys and connections exist: the steady state
            adapter.decide(key)
        with count_round_trips() as counts:
            allowed = sum(adapter.decide(key) for key in names)
        result[name] = {
            "sql": counts["sql"] / keys,
            "redis": counts["redis"] / keys,
            "redis_replies": counts["redis_replies"] / keys,
            "allowed_share": allowed / keys,
        }
    return result


# --------------------------------------------------------------------------- phases


def sanity(adapters: dict[str, Adapter]) -> None:
    """A limit of 5 per hour allows exactly 5 sequential calls on a fresh key, then denies."""
    failures = []
    for name, adapter in adapters.items():
        if adapter.family == "baseline":
            continue
        got = [adapter.decide("sanity-key") for _ in range(7)]
        if got != [True] * 5 + [False] * 2:
            failures.append(f"{name}: {got}")
    if failures:
        raise SystemExit("sanity check failed (a limit of 5 must allow exactly 5 calls):\n  " + "\n  ".join(failures))


def percentile(ordered: list[float], share: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def timed_batch(decide: Callable[[str], bool], keys: Callable[[int], str], seconds: float) -> tuple[list[float], int]:
    """Call ``decide`` for ``seconds``; return each call's latency (µs) and how many were allowed."""
    clock = time.perf_counter_ns
    latencies: list[float] = []
    allowed = 0
    deadline = clock() + int(seconds * 1e9)
    i = 0
    while True:
        key = keys(i)
        started = clock()
        ok = decide(key)
        ended = clock()
        latencies.append((ended - started) / 1000)
        allowed += ok
        i += 1
        if ended > deadline:
            return latencies, allowed


def summary(latencies: list[float], allowed: int) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "calls": len(ordered),
        "p50_us": round(statistics.median(ordered), 1),
        "p99_us": round(percentile(ordered, 0.99), 1),
        # Decisions per second of one process, from the time spent inside decide().
        "per_second": round(len(ordered) / (sum(ordered) / 1e6)),
        "allowed_share": round(allowed / len(ordered), 3),
    }


def single_process(
    adapters: dict[str, Adapter], rounds: int, seconds: float, distinct: int
) -> dict[str, dict[str, dict[str, float]]]:
    """Interleaved rounds of every adapter, on ``distinct`` keys in turn and on one hot key."""
    names = list(adapters)
    distinct_keys = [f"d:{i}" for i in range(distinct)]
    for adapter in adapters.values():  # warm up: rows and connections exist
        for key in distinct_keys:
            adapter.decide(key)
    modes: dict[str, Callable[[int], str]] = {
        "distinct": lambda i: distinct_keys[i % distinct],
        "hot": lambda i: "hot",
    }
    samples: dict[str, dict[str, tuple[list[float], int]]] = {mode: {n: ([], 0) for n in names} for mode in modes}
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for mode, keys in modes.items():
            offset = random.randrange(distinct)
            for name in order:
                latencies, allowed = timed_batch(
                    adapters[name].decide, lambda i, keys=keys, offset=offset: keys(i + offset), seconds
                )
                kept, count = samples[mode][name]
                samples[mode][name] = (kept + latencies, count + allowed)
    return {mode: {n: summary(*samples[mode][n]) for n in names} for mode in modes}


def _worker(index: int, spec: str, barrier: Any, commands: Any, results: Any) -> None:  # runs in a spawned process
    setup_django()
    adapters = make_adapters(spec)
    for adapter in adapters.values():
        adapter.decide(f"warm-{index}")
    results.put(("ready", index))
    while True:
        command = commands.get()
        if command is None:
            break
        name, key, seconds = command
        decide = adapters[name].decide
        barrier.wait()
        calls = admitted = 0
        started = time.time()
        deadline = started + seconds
        while True:
            admitted += decide(key)
            calls += 1
            if calls % 8 == 0 and time.time() > deadline:
                break
        results.put((name, calls, admitted, started, time.time()))
    from django.db import connections

    connections.close_all()


def many_processes(
    spec: str, names: list[str], processes: int, rounds: int, seconds: float
) -> dict[str, dict[str, float]]:
    """``processes`` workers on one hot key per adapter and round, started by a barrier."""
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(processes)
    results = context.Queue()
    queues = [context.Queue() for _ in range(processes)]
    workers = [
        context.Process(target=_worker, args=(i, spec, barrier, queues[i], results), daemon=True)
        for i in range(processes)
    ]
    for worker in workers:
        worker.start()
    for _ in workers:
        results.get(timeout=120)
    adapters = make_adapters(spec, set(names))
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    try:
        for r in range(rounds):
            order = names[r % len(names) :] + names[: r % len(names)]
            for name in order:
                key = f"mp:{r}"
                for queue in queues:
                    queue.put((name, key, seconds))
                got = [results.get(timeout=seconds * 10 + 60) for _ in workers]
                calls = sum(g[1] for g in got)
                admitted = sum(g[2] for g in got)
                elapsed = max(g[4] for g in got) - min(g[3] for g in got)
                bound = adapters[name].bound(elapsed)
                runs[name].append({"calls": calls, "admitted": admitted, "elapsed": elapsed, "bound": bound or 0})
    finally:
        for queue in queues:
            queue.put(None)
        for worker in workers:
            worker.join(timeout=30)
    out = {}
    for name, items in runs.items():
        has_bound = adapters[name].bound(1.0) is not None
        over = [max(0.0, item["admitted"] - math.floor(item["bound"])) for item in items] if has_bound else [0.0]
        out[name] = {
            "per_second": round(statistics.median(item["calls"] / item["elapsed"] for item in items)),
            "admitted": sum(int(item["admitted"]) for item in items),
            "allowed": sum(math.floor(item["bound"]) for item in items) if has_bound else None,
            "over_admitted": sum(over) if has_bound else None,
            "worst_run_over": max(over) if has_bound else None,
            "runs": len(items),
        }
    return out


def key_scale(rows: int, seconds: float, rounds: int) -> dict[str, Any]:
    """The database backend's latency with 10^3 rows, then with ``rows`` rows, on random stored keys."""
    from django.conf import settings
    from django.db import connection

    from django_tokenbucket.algorithms import MICRO

    count, _ = settings.SPECS["bench"]
    db = OursDatabase("bench")
    select = SelectOne("bench")

    def load(first: int, last: int) -> float:
        started = time.perf_counter()
        with connection.cursor() as cursor:
            # The digest is keys.encode_key()'s for the str key 'k<i>': sha256 of b"s<len>:k<i>".
            cursor.execute(
                """
                INSERT INTO django_tokenbucket_ratelimit (name, key, label, value, ts)
                SELECT 'bench', encode(sha256(convert_to('s' || length(k) || ':' || k, 'UTF8')), 'hex'), k,
                       %s, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint
                FROM (SELECT 'k' || i AS k FROM generate_series(%s, %s) AS i) AS keys
                """,
                [count * MICRO, first, last],
            )
            cursor.execute("VACUUM ANALYZE django_tokenbucket_ratelimit")
        return time.perf_counter() - started

    def measure(stored: int) -> dict[str, Any]:
        pick = random.Random(stored)
        samples: dict[str, tuple[list[float], int]] = {"tokenbucket db": ([], 0), "SELECT 1": ([], 0)}
        for _ in range(rounds):
            for name, adapter in (("tokenbucket db", db), ("SELECT 1", select)):
                latencies, allowed = timed_batch(adapter.decide, lambda i: f"k{pick.randint(1, stored)}", seconds)
                kept, n = samples[name]
                samples[name] = (kept + latencies, n + allowed)
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*), pg_total_relation_size('django_tokenbucket_ratelimit')"
                " FROM django_tokenbucket_ratelimit"
            )
            stored_rows, size = cursor.fetchone()
        return {name: summary(*s) for name, s in samples.items()} | {
            "rows": stored_rows,
            "table_and_indexes_mb": round(size / 2**20, 1),
            "bytes_per_row": round(size / stored_rows),
        }

    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_tokenbucket_ratelimit")
    load(1, 1000)
    small = measure(1000)
    load_seconds = load(1001, rows)
    large = measure(rows)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM django_tokenbucket_ratelimit")
    return {"small": small, "large": large, "load_seconds": round(load_seconds, 1)}


def redis_memory(adapters: dict[str, Adapter], decisions: int = 10) -> dict[str, dict[str, int]]:
    """Bytes Redis uses (MEMORY USAGE) for one key's state after ``decisions`` allowed calls."""
    client = redis_client()
    out = {}
    for name, adapter in adapters.items():
        if adapter.redis_pattern is None:
            continue
        clear_redis()
        for _ in range(decisions):
            adapter.decide("memory-key")
        keys = list(client.scan_iter(match=adapter.redis_pattern, count=1000))
        out[name] = {"keys": len(keys), "bytes": sum(client.memory_usage(key, samples=0) or 0 for key in keys)}
    clear_redis()
    return out


# --------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    import django
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("SHOW server_version")
        postgres = cursor.fetchone()[0]
    info = redis_client().info("server")
    packages = {}
    for package in ("django-redis", "redis", "djangorestframework", "django-ratelimit", "limits", "psycopg"):
        try:
            from importlib.metadata import version

            packages[package] = version(package)
        except Exception:  # pragma: no cover - a peer not installed
            packages[package] = None
    try:
        import hiredis  # noqa: F401

        packages["hiredis"] = "installed"
    except ImportError:
        packages["hiredis"] = None
    return {
        "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "django": django.get_version(),
        "postgresql": postgres.split()[0],
        "redis": info.get("redis_version"),
        "packages": packages,
    }


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 2)


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    single = result["single"]["distinct"]
    many = result["processes"]
    scale = result.get("scale")

    def p50(name: str) -> float | None:
        return single.get(name, {}).get("p50_us")

    def mp(name: str) -> float | None:
        return many.get(name, {}).get("per_second")

    rows: list[dict[str, Any]] = [
        {
            "target": "DB backend p50 ≤ 1.5× SELECT 1 (same Django connection)",
            "value": ratio(p50("tokenbucket db"), p50("SELECT 1")),
            "limit": 1.5,
            "better": "lower",
        },
        {
            "target": "8-process hot-key throughput: DB backend ≥ 5× textbook ORM",
            "value": ratio(mp("tokenbucket db"), mp("textbook ORM")),
            "limit": 5.0,
            "better": "higher",
        },
        {
            "target": "8-process hot-key throughput: DB backend ≥ 0.7× Redis backend",
            "value": ratio(mp("tokenbucket db"), mp("tokenbucket redis")),
            "limit": 0.7,
            "better": "higher",
        },
        {
            "target": "Redis backend p50 ≤ 1.3× PING",
            "value": ratio(p50("tokenbucket redis"), p50("PING")),
            "limit": 1.3,
            "better": "lower",
        },
        {
            "target": "Redis backend p50 < django-ratelimit p50",
            "value": ratio(p50("tokenbucket redis"), p50("django-ratelimit")),
            "limit": 1.0,
            "better": "lower",
        },
        {
            "target": "Redis backend p50 < DRF UserRateThrottle p50",
            "value": ratio(p50("tokenbucket redis"), p50("DRF UserRateThrottle")),
            "limit": 1.0,
            "better": "lower",
        },
    ]
    if scale:
        rows.append(
            {
                "target": f"DB backend p50 flat from 10^3 to {scale['large']['rows']:,} rows (≤ 1.2×)",
                "value": ratio(scale["large"]["tokenbucket db"]["p50_us"], scale["small"]["tokenbucket db"]["p50_us"]),
                "limit": 1.2,
                "better": "lower",
                # The two sizes run one after the other, not interleaved: SELECT 1 in the
                # same rounds shows how much of the change is the machine's.
                "normalized": ratio(
                    scale["large"]["tokenbucket db"]["p50_us"] / scale["large"]["SELECT 1"]["p50_us"],
                    scale["small"]["tokenbucket db"]["p50_us"] / scale["small"]["SELECT 1"]["p50_us"],
                ),
            }
        )
    over = {name: many[name]["over_admitted"] for name in ("tokenbucket db", "tokenbucket redis") if name in many}
    rows.append(
        {
            "target": "zero over-admission for our backends (8 processes, hot key)",
            "value": sum(v or 0 for v in over.values()),
            "limit": 0,
            "better": "lower",
        }
    )
    for row in rows:
        value, limit = row["value"], row["limit"]
        if value is None:
            row["met"] = None
        elif row["better"] == "lower":
            row["met"] = value <= limit if limit else value == 0
        else:
            row["met"] = value >= limit
    return rows


def print_report(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(
        f"\n{m['date']} — {m['cpus']} cores, Python {m['python']}, Django {m['django']}, "
        f"PostgreSQL {m['postgresql']}, Redis {m['redis']}"
    )
    single, many, trips = result["single"], result["processes"], result["round_trips"]
    procs = result["settings"]["processes"]
    header = (
        f"{'adapter':28} {'algorithm':14} {'RT/dec':>7} "
        f"{'p50 µs':>8} {'p99 µs':>8} {'dec/s':>7} "
        f"{'hot p50':>8} {'hot p99':>8} {'hot/s':>7} {'allow%':>6} "
        f"{f'{procs}p hot/s':>9} {'admitted':>9} {'allowed':>8} {'over':>5}"
    )
    print(header)
    print("-" * len(header))
    for name in single["distinct"]:
        d, h, mp, rt = single["distinct"][name], single["hot"][name], many.get(name, {}), trips.get(name, {})
        trip = rt.get("sql", 0) + rt.get("redis", 0)
        allowed = mp.get("allowed")
        print(
            f"{name:28} {result['adapters'][name]['algorithm']:14} {trip:7.2f} "
            f"{d['p50_us']:8.0f} {d['p99_us']:8.0f} {d['per_second']:7,} "
            f"{h['p50_us']:8.0f} {h['p99_us']:8.0f} {h['per_second']:7,} {100 * h['allowed_share']:6.1f} "
            f"{mp.get('per_second', 0):9,} {mp.get('admitted', 0):9,} "
            f"{'-' if allowed is None else allowed:>8} {'-' if allowed is None else mp['over_admitted']:>5}"
        )
    if result.get("scale"):
        s = result["scale"]
        print(f"\nDB backend on random stored keys (rows loaded in {s['load_seconds']} s):")
        for label in ("small", "large"):
            part = s[label]
            print(
                f"  {part['rows']:>9,} rows: p50 {part['tokenbucket db']['p50_us']:6.0f} µs, "
                f"p99 {part['tokenbucket db']['p99_us']:6.0f} µs (SELECT 1 p50 {part['SELECT 1']['p50_us']:.0f} µs), "
                f"{part['bytes_per_row']} bytes/row"
            )
    if result.get("memory"):
        print("\nRedis memory for one key after 10 allowed decisions (MEMORY USAGE):")
        for name, mem in result["memory"].items():
            print(f"  {name:22} {mem['bytes']:5} bytes in {mem['keys']} key(s)")
    print("\nTargets (issue 8), ratios from this run:")
    for row in result["targets"]:
        mark = {True: "met", False: "MISSED", None: "n/a"}[row["met"]]
        note = f" (normalized by SELECT 1: {row['normalized']})" if "normalized" in row else ""
        print(f"  {mark:6} {row['value']!s:>6}  (target {row['limit']})  {row['target']}{note}")


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short phases and 10^5 rows: about a minute")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the single-process phase (default 6)")
    parser.add_argument("--seconds", type=float, help="seconds per adapter and round, single process (default 0.5)")
    parser.add_argument("--processes", type=int, default=8, help="processes on the hot key (default 8)")
    parser.add_argument("--mp-rounds", type=int, help="rounds of the multi-process phase (default 3)")
    parser.add_argument("--mp-seconds", type=float, help="seconds per multi-process run (default 3)")
    parser.add_argument("--rows", type=int, help="stored rows for the key-scale phase (default 10^6; 0 skips)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--only", metavar="NAMES", help="comma-separated adapter names to run (default: all)")
    args = parser.parse_args()
    quick = args.quick
    rounds = args.rounds or (3 if quick else 6)
    seconds = args.seconds or (0.2 if quick else 0.5)
    mp_rounds = args.mp_rounds or (1 if quick else 3)
    mp_seconds = args.mp_seconds or (2.0 if quick else 3.0)
    rows = args.rows if args.rows is not None else (10**5 if quick else 10**6)

    setup_django()
    started = time.perf_counter()
    # Other work on the machine shows in every figure: the load is recorded with them.
    load_before = os.getloadavg()
    with bench_stores():
        print("sanity: a limit of 5 allows 5 calls ...", flush=True)
        only = set(args.only.split(",")) if args.only else None
        sanity(make_adapters("sanity", only))
        adapters = make_adapters("bench", only)
        print("round trips per decision ...", flush=True)
        trips = round_trips(adapters)
        print(f"single process: {rounds} rounds × {len(adapters)} adapters × 2 modes × {seconds} s ...", flush=True)
        single = single_process(adapters, rounds, seconds, distinct=1000)
        print(f"{args.processes} processes on a hot key: {mp_rounds} rounds × {mp_seconds} s ...", flush=True)
        many = many_processes("bench", list(adapters), args.processes, mp_rounds, mp_seconds)
        scale = None
        if rows:
            print(f"key scale: 10^3 then {rows:,} rows ...", flush=True)
            scale = key_scale(rows, seconds, rounds)
        memory = redis_memory(make_adapters("memory", only))
        result: dict[str, Any] = {
            "machine": machine(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "settings": {
                "limit": "token bucket 100/s, burst 100 (peers: 100 per second)",
                "rounds": rounds,
                "seconds": seconds,
                "processes": args.processes,
                "mp_rounds": mp_rounds,
                "mp_seconds": mp_seconds,
                "rows": rows,
            },
            "adapters": {
                name: {"family": a.family, "store": a.store, "algorithm": a.algorithm} for name, a in adapters.items()
            },
            "round_trips": trips,
            "single": single,
            "processes": many,
            "scale": scale,
            "memory": memory,
        }
        result["targets"] = targets(result)
    finish(result, print_report, started, load_before, args.json)


def finish(
    result: dict[str, Any],
    report: Callable[[dict[str, Any]], None],
    started: float,
    load_before: tuple[float, float, float],
    json_path: str | None,
) -> None:
    """Record the run's duration and load, print the report, and write the JSON if asked."""
    result["wall_seconds"] = round(time.perf_counter() - started)
    result["machine"]["load_average"] = {
        "before": [round(x, 2) for x in load_before],
        "after": [round(x, 2) for x in os.getloadavg()],
    }
    report(result)
    load = result["machine"]["load_average"]
    print(f"\n({result['wall_seconds']} s; load average before {load['before']}, after {load['after']})")
    if json_path:
        path = Path(json_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"JSON: {path}")


if __name__ == "__main__":
    main()
