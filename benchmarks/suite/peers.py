#!/usr/bin/env python
"""django-tokenbucket next to its peers and to the stores' floors, in one run (issues 8 and 19).

Every implementation is an *adapter* with one method, ``decide(key) -> allowed``, given the
same limit (100 per second, burst 100) on the same PostgreSQL and Redis:

    floors     Django SELECT 1 · a durable one-row UPDATE in autocommit · PING · GET
    reference  a plain PL/pgSQL token-bucket function, called through Django's cursor
               the textbook ORM token bucket: atomic + get_or_create + select_for_update + save
               a raw EVALSHA of a simple token-bucket Lua script (the same redis-py client)
    ours       limiter.limit() on the database backend (PostgreSQL fast path; portable
               path; async commit) and on the Redis backend
    peers      django-ratelimit (fixed window) · DRF UserRateThrottle (sliding log)
               limits: fixed window, moving window (Redis storage)

``TOKENBUCKET`` is process-wide, so each adapter of ours runs in a worker process of its
own configuration; the floors, references and peers share one more. The main process
coordinates: in every round it asks one worker at a time, in rotating order, to run one
adapter's batch, so that all of them see the same machine load (benchmarks/suite/harness.py).

Phases:

1. sanity: a limit of 5 allows exactly 5 sequential calls; otherwise the run stops.
2. round trips per decision, counted on the wire: libpq's trace (every ReadyForQuery,
   BEGIN and COMMIT included) and redis-py's sends.
3. one process: p50/p99 latency and decisions/s on fresh keys (1,000 keys in turn, each
   full again by its next turn: every decision admits, and writes) and on one hot key
   (mostly denials), and on new keys (a key no call has decided before: on the database,
   an INSERT).
4. ``--processes`` (8) processes on one hot key, started together by a barrier, per
   adapter (a pool of processes per configuration): decisions/s, and admitted against
   what the algorithm allows in that time.
5. the database backend with 10^3 and then 10^6 stored rows (``--rows``).
6. Redis bytes per key (``MEMORY USAGE``) after 10 decisions on one key.

Then the targets of issue 19, as ratios from this run, each met or missed.

    make bench                                           # creates .venv-bench, runs this
    .venv-bench/bin/python benchmarks/suite/peers.py --json benchmarks/results/peers.json
    .venv-bench/bin/python benchmarks/suite/peers.py --quick   # about a minute

Not a test: it asserts nothing about speed. PostgreSQL: database ``tokenbucket_bench``,
created and dropped here. Redis: database 14, keys under ``tbbench`` only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.suite.peers_settings"

from benchmarks.suite import harness  # noqa: E402

SETTINGS = "benchmarks.suite.peers_settings"
FACTORY = "benchmarks.suite.peers:make_adapters"
#: Names the adapters a run selected, for its worker processes (comma-separated).
SELECTED_ENV = "TOKENBUCKET_BENCH_ADAPTERS"


def setup_django() -> None:
    import django

    django.setup()


# --------------------------------------------------------------------------- adapters


class Adapter:
    """One implementation behind ``decide(key) -> allowed``, for the limit ``spec`` of the settings."""

    name = ""
    family = ""  # baseline, reference, ours, peer
    store = ""  # postgresql, redis
    algorithm = ""
    #: The worker configuration it runs in (peers_settings.BENCH_CONFIGS; "peers" for all but ours).
    config = "peers"
    #: Part of a plain ``make bench``; the others run when ``--only`` names them.
    default = True
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


class PlainFunction(Adapter):
    """A plain PL/pgSQL token bucket (benchmarks/suite/stores.py), one call through Django's cursor."""

    name, family, store, algorithm = "plain PL/pgSQL function", "reference", "postgresql", "token bucket"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django.db import connection

        self.connection = connection
        self.capacity, self.per_second = float(self.count), self.count / self.period

    def decide(self, key: str) -> bool:
        with self.connection.cursor() as cursor:
            cursor.execute(
                "SELECT bench_take_token(%s, %s, %s)", [f"{self.spec}:{key}", self.capacity, self.per_second]
            )
            return bool(cursor.fetchone()[0])


class TextbookORM(Adapter):
    """The token bucket most tutorials write: lock the row, refill by the app's clock, save."""

    name, family, store, algorithm = "textbook ORM", "reference", "postgresql", "token bucket"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django.db import transaction

        from benchmarks.suite.textbook.models import Bucket

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


class _Ours(Adapter):
    """``limiter.limit()`` — the public API, Status and signals included — with the process'
    own ``TOKENBUCKET`` (the worker's configuration)."""

    family, algorithm = "ours", "token bucket"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django_tokenbucket import limiter

        self.limiter = limiter

    def decide(self, key: str) -> bool:
        return self.limiter.limit(self.spec, key).ok


class OursDatabase(_Ours):
    """The database backend as configured by default: on PostgreSQL, its fast path (one
    statement per decision)."""

    name, store, config = "tokenbucket db", "postgresql", "db"


class _OursDatabaseVariant(_Ours):
    store = "postgresql"
    #: Keeps its rows apart from the other variants' (one table, several processes).
    key_prefix = ""

    def decide(self, key: str) -> bool:
        return self.limiter.limit(self.spec, self.key_prefix + key).ok


class OursDatabasePortable(_OursDatabaseVariant):
    """The portable path (``select_for_update`` in a transaction), used inside the caller's
    transaction and on other databases: ``FAST_PATH = False``."""

    name, config, key_prefix = "tokenbucket db portable", "db-portable", "portable:"


class OursDatabaseAsyncCommit(_OursDatabaseVariant):
    """The fast path with ``ASYNC_COMMIT``: commits do not wait for the WAL flush (a
    database crash may lose the last fraction of a second of consumption)."""

    name, config, key_prefix = "tokenbucket db async commit", "db-async-commit", "async:"


class OursDatabaseSharded(_OursDatabaseVariant):
    """The fast path on a limit spread over shards (``"shards": 8`` for the 100/s limit,
    2 for the small sanity and memory limits, whose 5 tokens split only so far)."""

    name, config, key_prefix, default = "tokenbucket db 8 shards", "db-sharded", "sharded:", False

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        self.limit_config = {"rate": self.count, "period": self.period, "shards": 8 if spec == "bench" else 2}

    def decide(self, key: str) -> bool:
        return self.limiter.limit(f"{self.spec}-sharded", self.key_prefix + key, config=self.limit_config).ok


class OursDatabaseShardedPortable(OursDatabaseSharded):
    """The same shards on the portable path, which holds each row's lock for 4 round trips."""

    name, config, key_prefix = "tokenbucket db portable 8 shards", "db-sharded-portable", "sharded-portable:"


class Ping(Adapter):
    name, family, store, algorithm = "PING", "baseline", "redis", "-"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from benchmarks.suite.stores import redis_client

        self.client = redis_client()

    def decide(self, key: str) -> bool:
        return bool(self.client.ping())


class GetOne(Adapter):
    """One ``GET`` of a stored key: what DRF's throttle sends to deny a hot key, and the
    floor of any decision that reads without a script."""

    name, family, store, algorithm = "GET", "baseline", "redis", "-"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django.conf import settings

        from benchmarks.suite.stores import redis_client

        self.client = redis_client()
        self.key = f"{settings.REDIS_PREFIX}:get:{spec}"
        self.client.set(self.key, b"x" * 64)

    def decide(self, key: str) -> bool:
        return self.client.get(self.key) is not None


#: A token bucket as a blog post would write it in Lua: tokens and the time they were
#: counted, in a hash. Written for this benchmark; no part of django-tokenbucket.
TOKEN_BUCKET_LUA = """
local capacity = tonumber(ARGV[1])
local per_second = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = capacity
if state[1] then
  tokens = math.min(capacity, tonumber(state[1]) + math.max(0, now - tonumber(state[2])) * per_second)
end
local allowed = 0
if tokens >= 1 then
  tokens = tokens - 1
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tokens, 'at', now)
redis.call('EXPIRE', KEYS[1], math.ceil(capacity / per_second) + 1)
return allowed
"""


class RawEvalsha(Adapter):
    """``EVALSHA`` of TOKEN_BUCKET_LUA through django-redis' redis-py client (the one our
    Redis backend uses), nothing around it: the floor of a Redis token bucket."""

    name, family, store, algorithm = "raw EVALSHA", "reference", "redis", "token bucket"
    redis_pattern = "tbbench:raw:*"

    def __init__(self, spec: str) -> None:
        super().__init__(spec)
        from django.conf import settings

        from benchmarks.suite.stores import redis_client

        self.client = redis_client()
        self.sha = self.client.script_load(TOKEN_BUCKET_LUA)
        self.prefix = f"{settings.REDIS_PREFIX}:raw:{spec}:"
        self.args = (str(self.count), repr(self.count / self.period))

    def decide(self, key: str) -> bool:
        return self.client.evalsha(self.sha, 1, self.prefix + key, *self.args) == 1


class OursRedis(_Ours):
    name, store, config = "tokenbucket redis", "redis", "redis"
    redis_pattern = "tbbench:*:tokenbucket:*"


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


#: In the order of the tables.
ADAPTERS: list[type[Adapter]] = [
    SelectOne,
    UpdateOne,
    PlainFunction,
    TextbookORM,
    OursDatabase,
    OursDatabasePortable,
    OursDatabaseAsyncCommit,
    OursDatabaseSharded,
    OursDatabaseShardedPortable,
    Ping,
    GetOne,
    RawEvalsha,
    LimitsFixed,
    LimitsMoving,
    DjangoRatelimit,
    DRFThrottle,
    OursRedis,
]


def make_adapters(spec: str, config: str) -> dict[str, Adapter]:
    """The adapters of a worker of ``config`` for the limit ``spec`` (the run's selection only)."""
    selected = os.environ.get(SELECTED_ENV)
    chosen = set(selected.split(",")) if selected else None
    return {cls.name: cls(spec) for cls in ADAPTERS if cls.config == config and (chosen is None or cls.name in chosen)}


# --------------------------------------------------------------------------- phases


def key_scale(where: dict[str, harness.Worker], rows: int, seconds: float, rounds: int) -> dict[str, Any]:
    """The database backend's latency with 10^3 rows, then with ``rows`` rows, on random stored keys.

    ``where`` holds the workers of ``tokenbucket db`` and of ``SELECT 1``, the yardstick:
    the two sizes run one after the other, so SELECT 1 in the same rounds shows how much
    of a change is the machine's.
    """
    from django.conf import settings
    from django.db import connection

    from django_tokenbucket.algorithms import MICRO
    from django_tokenbucket.keys import encode_key

    count, _ = settings.SPECS["bench"]

    def load(first: int, last: int) -> float:
        started = time.perf_counter()
        with connection.cursor() as cursor:
            cursor.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
            (now,) = cursor.fetchone()
            # The stored key is what the backend derives from the str key "k<i>" (an HMAC):
            # the benchmark's decisions find these rows instead of inserting their own.
            columns = "COPY django_tokenbucket_ratelimit (name, key, label, value, ts) FROM STDIN"
            with cursor.cursor.copy(columns) as copy:
                for i in range(first, last + 1):
                    encoded = encode_key(f"k{i}")
                    copy.write_row(("bench", encoded.digest, encoded.label, count * MICRO, now))
            cursor.execute("VACUUM ANALYZE django_tokenbucket_ratelimit")
        return time.perf_counter() - started

    def stored() -> tuple[int, int]:
        with connection.cursor() as cursor:
            cursor.execute(
                "SELECT count(*), pg_total_relation_size('django_tokenbucket_ratelimit')"
                " FROM django_tokenbucket_ratelimit"
            )
            return cursor.fetchone()

    def measure(loaded: int) -> dict[str, Any]:
        figures = harness.interleaved(where, "bench", rounds, seconds, {"stored": loaded})["stored"]
        rows_after, size = stored()
        return {
            **figures,
            "rows": loaded,
            # Any row a decision inserted: the loaded keys were not the backend's.
            "rows_added": rows_after - loaded,
            "table_and_indexes_mb": round(size / 2**20, 1),
            "bytes_per_row": round(size / rows_after),
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


# --------------------------------------------------------------------------- metrics cost


#: The configurations of ``metrics_cost``, each in a worker process of its own.
METRICS_MODES = {
    "off": {"METRICS": None, "ANALYTICS": None},
    "off again": {"METRICS": None, "ANALYTICS": None},
    "prometheus": {"METRICS": "prometheus", "ANALYTICS": None},
    "analytics": {"METRICS": None, "ANALYTICS": {"FLUSH": 3600}},
}
#: Sets of fresh worker processes ``metrics_cost`` spreads its rounds over.
METRICS_PROCESS_SETS = 5
#: The factory of ``metrics_cost``'s workers, and the name of their one adapter.
MEMORY_FACTORY = "benchmarks.suite.peers:memory_adapters"
IN_MEMORY = "tokenbucket in memory"


class InMemoryLimiter(Adapter):
    """``limiter.limit()`` on a backend that decides in memory (``decide_all`` on a dict), so
    that no store's time, nor its noise, is in the figure; with ``METRICS_MODES[mode]``
    set for the whole worker, as a project sets it. ``extra`` holds, in the metrics
    worker, ``prometheus_client_cost()``'s figure."""

    name, family, store, algorithm = IN_MEMORY, "ours", "memory", "token bucket"

    def __init__(self, spec: str, mode: str) -> None:
        from django.conf import settings
        from django.test import override_settings

        from django_tokenbucket.api import Limiter
        from django_tokenbucket.backends.base import BaseBackend, Outcome, decide_all, row_id

        super().__init__(spec)

        class InMemory(BaseBackend):
            keeps_analytics = True

            def __init__(self) -> None:
                super().__init__({})
                self.states: dict[Any, Any] = {}
                self.now = 1_700_000_000_000_000

            def decide(self, requests: Any, *, apply: bool) -> Outcome:
                self.now += 1000
                states = {row_id(r): self.states.get(row_id(r)) for r in requests}
                decisions, writes = decide_all(requests, states, self.now)
                if apply:
                    self.states.update(writes)
                return Outcome(decisions, self.now)

            def reset(self, config: Any, key: Any) -> None:
                self.states.pop((config.name, key.digest), None)

            def write_analytics(self, minutes: Any, keys: Any) -> None:
                pass  # not reached: analytics flush once an hour here

        override_settings(TOKENBUCKET={**settings.TOKENBUCKET, **METRICS_MODES[mode]}).enable()
        self.limiter = Limiter(InMemory())
        self.extra = {"prometheus_client_us": prometheus_client_cost()} if mode == "prometheus" else {}

    def decide(self, key: str) -> bool:
        return self.limiter.limit(self.spec, key).ok


def memory_adapters(spec: str, mode: str) -> dict[str, Adapter]:
    """The one adapter of a ``metrics_cost`` worker (``mode``: a key of ``METRICS_MODES``)."""
    return {IN_MEMORY: InMemoryLimiter(spec, mode)}


def metrics_cost(rounds: int, calls: int, process_sets: int = METRICS_PROCESS_SETS) -> dict[str, Any]:
    """What ``TOKENBUCKET["METRICS"]`` and ``TOKENBUCKET["ANALYTICS"]`` add to a decision.

    ``InMemoryLimiter`` in one worker process per configuration (``METRICS_MODES``): the
    setting is process-wide, and the bench's main process, after the rest of the run, has
    objects, garbage collections and threads of its own, which moved the earlier
    in-process figures by several µs from round to round. The configurations take turns,
    a batch of ``calls`` each, in a rotating order; each cost is the median of the
    rounds' differences with the batch of both off beside it, which a drift of the
    machine between rounds leaves out. Analytics flush once an hour here, so the figure
    is the counting every decision pays; a flush is one write per ``FLUSH`` per process,
    off the request path.

    A process has a speed of its own (its hash seed, where its memory lies): two
    processes that both have everything off differed by up to 0.8 µs a decision, run
    after run. So the ``rounds`` are spread over ``process_sets`` sets of fresh
    processes, and one configuration is both off again (``control_us``): its "cost" is
    the method's own error in this run.

    For scale, the two ``prometheus_client`` calls that its children would make a
    decision (the multiprocess mode's recorder), timed alone in the metrics worker, are
    reported as ``prometheus_client_us``.
    """
    import statistics

    modes = list(METRICS_MODES)
    per_call: dict[str, list[float]] = {mode: [] for mode in modes}
    library = []
    for process_set in range(process_sets):
        with harness.workers(SETTINGS, modes, MEMORY_FACTORY) as started:
            for worker in started.values():
                worker.call("warm", "bench", IN_MEMORY, "fresh", 1024, 1024)
            for r in range(process_set, rounds, process_sets):
                for mode in harness.rotate(modes, r):
                    per_call[mode].append(started[mode].call("per_call", "bench", IN_MEMORY, calls))
            library.append(started["prometheus"].call("describe", "bench")[IN_MEMORY]["prometheus_client_us"])

    def added(mode: str) -> float:
        return statistics.median(on - off for on, off in zip(per_call[mode], per_call["off"]))

    return {
        "off_us": round(statistics.median(per_call["off"]), 2),
        "prometheus_us": round(statistics.median(per_call["prometheus"]), 2),
        "added_us": round(added("prometheus"), 2),
        "analytics_us": round(statistics.median(per_call["analytics"]), 2),
        "analytics_added_us": round(added("analytics"), 2),
        "control_us": round(added("off again"), 2),
        "prometheus_client_us": round(statistics.median(library), 2),
        "rounds": rounds,
        "process_sets": process_sets,
        "calls": calls,
    }


def prometheus_client_cost(calls: int = 100_000) -> float:
    """µs of the two ``prometheus_client`` calls a decision makes in the multiprocess mode
    (a labelled counter's ``inc()`` and a labelled histogram's ``observe()``, each child
    looked up once, as ``PrometheusRecorder`` keeps them): what the per-thread tallies of
    every other process take the place of."""
    import statistics

    import prometheus_client

    from django_tokenbucket.metrics import BUCKETS

    registry = prometheus_client.CollectorRegistry()
    count = prometheus_client.Counter("c", "", ["limit", "backend", "outcome"], registry=registry)
    seconds = prometheus_client.Histogram("s", "", ["backend"], registry=registry, buckets=BUCKETS)
    inc, observe = count.labels("bench", "default", "allowed").inc, seconds.labels("default").observe
    timings = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(calls):
            inc()
            observe(0.00002)
        timings.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(timings)


# --------------------------------------------------------------------------- targets


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if not numerator or not denominator:
        return None
    return round(numerator / denominator, 2)


def judge(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mark each target met or missed, and by how much (a share of the target)."""
    for row in rows:
        value, limit = row["value"], row["limit"]
        if value is None:
            row["met"], row["margin"] = None, None
        elif row["better"] == "lower":
            row["met"] = value <= limit
            row["margin"] = round(value / limit - 1, 3) if limit else value
        else:
            row["met"] = value >= limit
            row["margin"] = round(1 - value / limit, 3)
    return rows


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets of issue 19 for the stores, as ratios of this run's figures."""
    single, many = result["single"], result["processes"]

    def p50(mode: str, name: str) -> float | None:
        return single[mode].get(name, {}).get("p50_us")

    def mp(name: str) -> float | None:
        return many.get(name, {}).get("per_second")

    def row(group: str, target: str, value: float | None, limit: float, better: str, **more: Any) -> dict[str, Any]:
        return {"group": group, "target": target, "value": value, "limit": limit, "better": better, **more}

    db, redis = "tokenbucket db", "tokenbucket redis"
    rows = [
        row(
            "database",
            "hot key p50 ≤ 1.5× Django `SELECT 1`",
            ratio(p50("hot", db), p50("hot", "SELECT 1")),
            1.5,
            "lower",
        ),
        row(
            "database",
            "fresh keys p50 ≤ 1.3× a raw durable one-row `UPDATE`",
            ratio(p50("fresh", db), p50("fresh", "UPDATE 1 row")),
            1.3,
            "lower",
        ),
        row(
            "database",
            "new keys (an INSERT) p50 ≤ 1.3× a raw durable one-row `UPDATE` (issue 35)",
            ratio(p50("new", db), p50("new", "UPDATE 1 row")),
            1.3,
            "lower",
        ),
        row(
            "database",
            "8 processes, hot key: ≥ 5× the textbook ORM",
            ratio(mp(db), mp("textbook ORM")),
            5.0,
            "higher",
        ),
        row(
            "database",
            "8 processes, hot key: ≥ 1.5× the plain PL/pgSQL function",
            ratio(mp(db), mp("plain PL/pgSQL function")),
            1.5,
            "higher",
        ),
    ]
    for mode, label in (("fresh", "fresh keys"), ("hot", "hot key"), ("new", "new keys")):
        # Issue 19 asked ≤ 1.15×; issue 35 asks ≤ 1.1× on new keys and on a hot key.
        floor = 1.15 if mode == "fresh" else 1.1
        rows += [
            row(
                "redis",
                f"{label} p50 ≤ {floor}× a raw `EVALSHA`",
                ratio(p50(mode, redis), p50(mode, "raw EVALSHA")),
                floor,
                "lower",
            ),
            row(
                "redis",
                f"{label} p50 below django-ratelimit's",
                ratio(p50(mode, redis), p50(mode, "django-ratelimit")),
                1.0,
                "lower",
                strict=True,
            ),
            row(
                "redis",
                f"{label} p50 below DRF's throttle's",
                ratio(p50(mode, redis), p50(mode, "DRF UserRateThrottle")),
                1.0,
                "lower",
                strict=True,
            ),
            row(
                "redis",
                f"{label} p50 ≤ 1.1× limits' fixed window",
                ratio(p50(mode, redis), p50(mode, "limits fixed window")),
                1.1,
                "lower",
            ),
        ]
    rows.append(
        row(
            "redis",
            "8 processes, hot key: ≥ 0.8× limits' fixed window",
            ratio(mp(redis), mp("limits fixed window")),
            0.8,
            "higher",
        )
    )
    cost = result.get("metrics_cost")
    rows.append(
        row(
            "metrics",
            '`METRICS = "prometheus"` adds ≤ 2 µs per decision (µs)',
            cost["added_us"] if cost else None,
            2.0,
            "lower",
        )
    )
    rows.append(
        row(
            "analytics",
            "`ANALYTICS` on adds ≤ 2 µs per decision (µs)",
            cost.get("analytics_added_us") if cost else None,
            2.0,
            "lower",
        )
    )
    ours = [name for name, meta in result["adapters"].items() if meta["family"] == "ours" and name in many]
    over = {name: many[name]["over_admitted"] for name in ours}
    rows.append(
        row(
            "exactness",
            "zero over-admission for every adapter of ours (8 processes, hot key)",
            sum(v or 0 for v in over.values()) if over else None,
            0,
            "lower",
        )
    )
    judge(rows)
    for item in rows:
        # "faster than": a tie is not faster.
        if item.pop("strict", False) and item["value"] is not None:
            item["met"] = item["value"] < item["limit"]
    return rows


# --------------------------------------------------------------------------- report


def print_report(result: dict[str, Any]) -> None:
    m = result["machine"]
    print(
        f"\n{m['date']} — {m['cpus']} cores, Python {m['python']}, Django {m['django']}, "
        f"PostgreSQL {m['postgresql']}, Redis {m['redis']}, commit {m['commit']}"
    )
    single, many, trips = result["single"], result["processes"], result["round_trips"]
    procs = result["settings"]["processes"]
    header = (
        f"{'adapter':30} {'process':19} {'RT/dec':>7} "
        f"{'p50 µs':>8} {'p99 µs':>8} {'dec/s':>7} "
        f"{'hot p50':>8} {'hot p99':>8} {'hot/s':>7} {'allow%':>6} {'new p50':>8} "
        f"{f'{procs}p hot/s':>9} {'admitted':>9} {'allowed':>8} {'over':>5}"
    )
    print(header)
    print("-" * len(header))
    for name, meta in result["adapters"].items():
        d, h, mp, rt = single["fresh"][name], single["hot"][name], many.get(name, {}), trips.get(name, {})
        new = single["new"][name]
        trip = rt.get("sql", 0) + rt.get("redis", 0)
        allowed = mp.get("allowed")
        print(
            f"{name:30} {meta['config'] + ' #' + str(meta['pid']):19} {trip:7.2f} "
            f"{d['p50_us']:8.0f} {d['p99_us']:8.0f} {d['per_second']:7,} "
            f"{h['p50_us']:8.0f} {h['p99_us']:8.0f} {h['per_second']:7,} "
            f"{100 * h['allowed_share']:6.1f} {new['p50_us']:8.0f} "
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
                f"{part['bytes_per_row']} bytes/row, {part['rows_added']} rows added"
            )
    if result.get("memory"):
        print("\nRedis memory for one key after 10 allowed decisions (MEMORY USAGE):")
        for name, mem in result["memory"].items():
            print(f"  {name:22} {mem['bytes']:5} bytes in {mem['keys']} key(s)")
    for label, profile in result.get("profiles", {}).items():
        print(f"\nProfile of {label}: {profile['calls']:,} decisions in {profile['seconds']} s")
        print(profile["stats"].strip())
    print_targets(result["targets"])


def print_targets(rows: list[dict[str, Any]]) -> None:
    print("\nTargets (issues 19 and 35), ratios from this run:")
    for row in rows:
        mark = {True: "met", False: "MISSED", None: "n/a"}[row["met"]]
        print(f"  {mark:6} {row['value']!s:>6}  (target {row['limit']})  {row['group']}: {row['target']}")


# --------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="short phases and 10^5 rows: about a minute")
    parser.add_argument("--rounds", type=int, help="interleaved rounds of the single-process phase (default 10)")
    parser.add_argument("--seconds", type=float, help="seconds per adapter and round, single process (default 0.25)")
    parser.add_argument("--processes", type=int, default=8, help="processes on the hot key (default 8)")
    parser.add_argument("--mp-rounds", type=int, help="rounds of the multi-process phase (default 3)")
    parser.add_argument("--mp-seconds", type=float, help="seconds per multi-process run (default 2.5)")
    parser.add_argument("--rows", type=int, help="stored rows for the key-scale phase (default 10^6; 0 skips)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--run-id", help="an identifier of the run, recorded in the JSON (make bench gives one)")
    parser.add_argument(
        "--profile",
        metavar="NAMES",
        help="comma-separated adapters to profile (cProfile, 2 s per scenario) after the timed phases",
    )
    parser.add_argument(
        "--only", metavar="NAMES", help="comma-separated adapter names to run (default: all but the sharded ones)"
    )
    args = parser.parse_args()
    quick = args.quick
    # Many short rounds rather than a few long ones: a burst of load elsewhere on the
    # machine then falls on every adapter alike.
    rounds = args.rounds or (4 if quick else 10)
    seconds = args.seconds or (0.15 if quick else 0.25)
    mp_rounds = args.mp_rounds or (1 if quick else 3)
    mp_seconds = args.mp_seconds or (1.5 if quick else 2.5)
    rows = args.rows if args.rows is not None else (10**5 if quick else 10**6)
    distinct = 1000

    chosen = [cls for cls in ADAPTERS if (cls.name in args.only.split(",") if args.only else cls.default)]
    if args.only and len(chosen) != len(set(args.only.split(","))):
        known = ", ".join(cls.name for cls in ADAPTERS)
        raise SystemExit(f"--only names an unknown adapter; the adapters are: {known}")
    # The workers inherit the selection.
    os.environ[SELECTED_ENV] = ",".join(cls.name for cls in chosen)
    configs = list(dict.fromkeys(cls.config for cls in chosen))

    setup_django()
    from benchmarks.suite.stores import bench_stores, machine

    started = time.perf_counter()
    # Other work on the machine shows in every figure: the load is recorded with them.
    load_before = os.getloadavg()
    with bench_stores():
        print(f"starting {len(configs)} worker processes ({', '.join(configs)}) ...", flush=True)
        with harness.workers(SETTINGS, configs, FACTORY) as workers:
            described: dict[str, dict[str, Any]] = {}
            for worker in workers.values():
                described |= worker.call("describe", "bench")
            adapters = {cls.name: described[cls.name] for cls in chosen}
            where = {name: workers[meta["config"]] for name, meta in adapters.items()}

            print("sanity: a limit of 5 allows 5 calls ...", flush=True)
            failures = [f for worker in workers.values() for f in worker.call("sanity", "sanity")]
            if failures:
                raise SystemExit(
                    "sanity check failed (a limit of 5 must allow exactly 5 calls):\n  " + "\n  ".join(failures)
                )
            print("round trips per decision ...", flush=True)
            trips: dict[str, Any] = {}
            for worker in workers.values():
                trips |= worker.call("round_trips", "bench")
            for name, worker in where.items():  # rows and keys exist: the steady state
                worker.call("warm", "bench", name, "fresh", distinct, distinct)
            print(f"one process: {rounds} rounds × {len(adapters)} adapters × 3 modes × {seconds} s ...", flush=True)
            single = harness.interleaved(
                where, "bench", rounds, seconds, {"fresh": distinct, "hot": 0, "new": harness.NEW_KEYS}
            )

            scale = None
            if rows and {"tokenbucket db", "SELECT 1"} <= set(where):
                print(f"key scale: 10^3 then {rows:,} rows ...", flush=True)
                scale = key_scale({n: where[n] for n in ("tokenbucket db", "SELECT 1")}, rows, seconds, rounds)

            profiles: dict[str, Any] = {}
            for name in args.profile.split(",") if args.profile else []:
                if name not in where:
                    raise SystemExit(f"--profile {name!r}: not an adapter of this run")
                for mode, param in (("fresh", distinct), ("hot", 0), ("new", harness.NEW_KEYS)):
                    profiles[f"{name}, {mode}"] = where[name].call("profile", "bench", name, mode, param, 2.0)

            memory: dict[str, Any] = {}
            for worker in workers.values():
                memory |= worker.call("memory", "memory")
            memory = {name: memory[name] for name in adapters if name in memory}

            print("metrics cost, in memory ...", flush=True)
            cost = metrics_cost(rounds * 10, 500 if args.quick else 2000)

        print(f"{args.processes} processes on a hot key: {mp_rounds} rounds × {mp_seconds} s ...", flush=True)
        many = harness.many_processes(SETTINGS, FACTORY, "bench", adapters, args.processes, mp_rounds, mp_seconds)
        result: dict[str, Any] = {
            "kind": "peers",
            "run_id": args.run_id,
            "machine": machine(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "settings": {
                "limit": "token bucket 100/s, burst 100 (peers: 100 per second)",
                "quick": bool(args.quick),
                "rounds": rounds,
                "seconds": seconds,
                "fresh_keys": distinct,
                "processes": args.processes,
                "mp_rounds": mp_rounds,
                "mp_seconds": mp_seconds,
                "rows": rows,
            },
            "adapters": adapters,
            "round_trips": trips,
            "single": single,
            "processes": many,
            "scale": scale,
            "memory": memory,
            "profiles": profiles,
            "metrics_cost": cost,
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
