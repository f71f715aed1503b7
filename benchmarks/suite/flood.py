#!/usr/bin/env python
"""``make bench-flood``: a flood of denied requests, with the deny cache on and off (issue 35).

Per backend (the database backend on PostgreSQL, the Redis backend on a private
redis-server), each with ``TOKENBUCKET["DENY_CACHE"]`` on and off, each configuration in
8 processes of its own (``TOKENBUCKET`` is process-wide; benchmarks/suite/flood_settings.py):

(a) one key: the 8 processes call ``limiter.limit("flood", "victim")`` (100 burst, 10/s)
    in a closed loop for ``--seconds`` on a key exhausted just before;
(b) rotating keys: the 8 processes walk ``--keys`` keys of a limit of 1 per hour, each
    from its own offset, all exhausted beforehand by a warm-up pass spread over 8 other
    processes (timed; once per backend, since the keys stay exhausted for the whole run).

Store operations are counted on the server: PostgreSQL transactions of the benchmark's own
database (``pg_stat_database``, read once every worker has closed its connection, since a
backend reports its counts lazily), Redis ``total_commands_processed`` of a server nobody
else uses, less the benchmark's own INFO calls (Redis counts the commands a Lua script
runs too: a script's decision counts 3). Both include each worker's connection setup. A
ninth process runs a primary-key SELECT on a small table of its own database every 2 ms
during each flood: its p99 is what the rest of the application sees.

Then, in one process per configuration, sequentially and in interleaved rounds: a denial
through ``limiter.limit`` (from memory when the cache is on), a Redis PING, and a denied
request through a ``@ratelimit`` function view and a DRF view with our throttle, next to
the same views without limiting and the same views refusing every request themselves
(the framework's own 429: what a denial costs at the least), all through Django's
WSGIHandler with a RequestFactory environ. And item 7: ``FAIL_OPEN`` with the database backend's ``TIMEOUT`` at 20 ms, 8
processes on one fresh key of 100 + 10/s for ``--seconds``: what the store admitted and what
failing open let through, against the bound 100 + 10 x seconds.

And issue 48's login phase (benchmarks/suite/flood_login.py), per backend in a process
of its own: an account locked out by login protection takes wrong passwords through
``authenticate()`` and through DRF's ``obtain_auth_token`` (Django's WSGIHandler, with
``RateLimitMiddleware``), each next to the same login unprotected: µs per login, password
hashes per login (Django's PBKDF2, counted) and store operations per login (counted on
the server around each measurement).

Prints issue 35's targets, met or MISSED, with the figures they come from; ``--docs``
rewrites the region between ``<!-- bench-flood:begin -->`` and ``<!-- bench-flood:end -->``
of that page. Not a test: it asserts nothing about speed, and every figure is from this run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.suite.report import save  # noqa: E402

BEGIN, END = "<!-- bench-flood:begin -->", "<!-- bench-flood:end -->"
SETTINGS = "benchmarks.suite.flood_settings"
CONFIG_ENV, PORT_ENV = "TOKENBUCKET_FLOOD_CONFIG", "TOKENBUCKET_FLOOD_REDIS_PORT"
BACKENDS = {"db": "database (PostgreSQL)", "redis": "Redis"}
#: Seconds to wait, once the workers have closed their connections, before reading
#: pg_stat_database: a backend's counts reach it when it exits, not at once.
PG_STATS_SETTLE = 1.5
PROBE_INTERVAL = 0.002
#: The warm-up opens a new database connection every this many keys. A connection's plans
#: of the database backend's statements, made while the table was nearly empty, can
#: walk every row of the limit (the (name, ts) index) on each call as the table grows:
#: a warm-up in one connection each took 351 s for 100,000 keys, two of its eight
#: processes at about 30 admissions a second. The floods start on fresh connections.
WARMUP_CHUNK = 2000
PROBE_ROWS = 1000
#: Issue 35's targets.
OPS_PER_DENIAL = 0.01
THROUGHPUT_RATIO = 10.0
PING_RATIO = 0.1
FAIL_OPEN_SLACK = 1.1
#: The server counts every transaction or command of the flood's processes, the overrides'
#: refresh (one per process and second: their MAX_AGE) and connection set-up included: a
#: few dozen per flood, on or off alike, whatever the number of decisions. Divided by
#: fewer decisions (a slower run) they read as more per decision, so "no higher than
#: without the cache" allows that many operations beyond off's rate: per process, one a
#: second and this many for set-up.
SETUP_OPS_PER_PROCESS = 2
#: The views of the sequential phase (benchmarks/suite/flood_views.py) and what each answers.
VIEW_STATUSES = {
    "/fn/plain/": 200,
    "/fn/refused/": 429,
    "/fn/limited/": 429,
    "/drf/plain/": 200,
    "/drf/refused/": 429,
    "/drf/limited/": 429,
}
#: Item 4's comparisons: a denial from memory through a view, against the same view
#: refusing by itself and against it answering 200 with no limiting.
VIEW_DENIALS = {
    "function view": (
        "function view + @ratelimit, denied",
        "function view answering 429 itself",
        "function view, no limiting",
    ),
    "DRF view": ("DRF view + our throttle, denied", "DRF view raising Throttled itself", "DRF view, no throttle"),
}


def _p(values: list[float], q: float) -> float:
    """The ``q`` quantile of ``values`` (nearest rank)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --------------------------------------------------------------------------- worker side


def _setup_django() -> None:
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    import django

    django.setup()


def _close() -> None:
    from django.db import connections

    connections.close_all()


def _exhaust_rotating(start: int, stop: int) -> dict[str, Any]:
    from django_tokenbucket.api import limiter

    began = time.perf_counter()
    admitted = 0
    for i in range(start, stop):
        admitted += limiter.limit("rotating", f"k{i}").ok
        if i % WARMUP_CHUNK == WARMUP_CHUNK - 1:
            _close()
    _close()
    return {"seconds": time.perf_counter() - began, "admitted": admitted}


def _exhaust(name: str, key: str) -> dict[str, Any]:
    from django_tokenbucket.api import limiter

    taken = 0
    while limiter.limit(name, key).ok:
        taken += 1
    _close()
    return {"taken": taken}


def _flood(
    name: str, key: str | None, keys: int, offset: int, start: float, end: float, warm_key: str | None = None
) -> dict[str, Any]:
    """Decide as fast as one process can from wall time ``start`` to ``end``; count outcomes.

    With ``warm_key``, one decision on that key first: a web worker has served requests
    before a flood comes, so its store has answered it (what tells a busy store from a
    dead one under ``FAIL_OPEN``).
    """
    from django_tokenbucket import deny_cache
    from django_tokenbucket.api import limiter
    from django_tokenbucket.exceptions import BackendUnavailable

    names = [f"k{i}" for i in range(keys)] if key is None else [key]
    deadline = time.monotonic() + (end - time.time())
    if warm_key is not None:
        while time.time() < start - 0.1:
            time.sleep(0.005)
        limiter.limit(name, warm_key)
    while time.time() < start:
        time.sleep(0.0005)
    decisions = admitted = cached = failed_open = busy = 0
    i = offset
    limit = limiter.limit
    count = len(names)
    # The clock is read once every 16 calls: a cached denial takes a few µs.
    while True:
        for _ in range(16):
            try:
                status = limit(name, names[i % count])
            except BackendUnavailable:  # the store was busy: refused, even under FAIL_OPEN
                busy += 1
                continue
            finally:
                i += 1
            if status.ok:
                if status.failed_open:
                    failed_open += 1
                else:
                    admitted += 1
            elif status.cached:
                cached += 1
        decisions += 16
        if time.monotonic() >= deadline:
            break
    size = deny_cache.size()
    _close()
    return {
        "decisions": decisions,
        "admitted": admitted,
        "failed_open": failed_open,
        "denied": decisions - admitted - failed_open - busy,
        "refused_busy": busy,
        "cached": cached,
        "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
        "deny_cache_size": size,
    }


def _sequential(rounds: int, calls: int, requests: int) -> dict[str, Any]:
    """p50s of a denial through limiter.limit, a PING and four views, in interleaved rounds."""
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import RequestFactory
    from django_redis import get_redis_connection

    from django_tokenbucket.api import limiter

    handler = WSGIHandler()
    factory = RequestFactory()
    environs = {path: factory.get(path).environ for path in VIEW_STATUSES}
    statuses: dict[str, set[int]] = {path: set() for path in environs}

    def get(path: str) -> None:
        response = handler(dict(environs[path]), lambda status, headers, exc_info=None: None)
        try:
            statuses[path].add(response.status_code)
            b"".join(response)
        finally:
            response.close()

    for path in ("/fn/limited/", "/drf/limited/"):
        get(path)  # the address's one request of the hour: every later one is denied
        statuses[path].clear()
    while limiter.limit("flood", "sequential").ok:
        pass
    ping = get_redis_connection("default").ping
    ping()
    cached = denied = 0

    def deny() -> None:
        nonlocal cached, denied
        status = limiter.limit("flood", "sequential")
        if not status.ok:
            denied += 1
            cached += status.cached

    timed: dict[str, tuple[Any, int]] = {
        "limiter.limit denial": (deny, calls),
        "Redis PING": (ping, calls),
        "function view, no limiting": (lambda: get("/fn/plain/"), requests),
        "function view answering 429 itself": (lambda: get("/fn/refused/"), requests),
        "function view + @ratelimit, denied": (lambda: get("/fn/limited/"), requests),
        "DRF view, no throttle": (lambda: get("/drf/plain/"), requests),
        "DRF view raising Throttled itself": (lambda: get("/drf/refused/"), requests),
        "DRF view + our throttle, denied": (lambda: get("/drf/limited/"), requests),
    }
    samples: dict[str, list[float]] = {name: [] for name in timed}
    clock = time.perf_counter_ns
    for _ in range(rounds):
        for name, (call, n) in timed.items():
            out = samples[name]
            for _ in range(n):
                began = clock()
                call()
                out.append((clock() - began) / 1000)
    _close()
    return {
        "p50_us": {name: round(statistics.median(values), 2) for name, values in samples.items()},
        "limiter_cached_share": cached / denied if denied else 0.0,
        "statuses": {path: sorted(codes) for path, codes in statuses.items()},
    }


def _login_prepare() -> dict[str, Any]:
    from benchmarks.suite import flood_login

    try:
        return flood_login.prepare()
    finally:
        _close()


def _login_measure(path: str, protected: bool, attempts: int) -> dict[str, Any]:
    from benchmarks.suite import flood_login

    try:
        return flood_login.measure(path, protected, attempts)
    finally:
        _close()


def worker_main() -> None:
    """Answer the coordinator's commands, one JSON line in and one out, until ``quit``."""
    _setup_django()
    sys.stdout.write(json.dumps({"ready": True}) + "\n")
    sys.stdout.flush()
    commands = {
        "exhaust_rotating": _exhaust_rotating,
        "exhaust": _exhaust,
        "flood": _flood,
        "sequential": _sequential,
        "login_prepare": _login_prepare,
        "login_measure": _login_measure,
    }
    for line in sys.stdin:
        command = json.loads(line)
        if command["do"] == "quit":
            return
        result = commands[command["do"]](**command["args"])
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()


def probe_main(start: float, end: float) -> None:
    """The ninth process: a primary-key SELECT every PROBE_INTERVAL from ``start`` to ``end``."""
    import random

    import psycopg

    from benchmarks.suite import flood_settings as settings

    with psycopg.connect(
        host=settings.PG_HOST, port=settings.PG_PORT, user=settings.PG_USER, dbname=settings.PROBE_DATABASE,
        autocommit=True,
    ) as conn:  # fmt: skip
        conn.execute("SELECT v FROM flood_probe WHERE id = %s", [0]).fetchone()
        while time.time() < start:
            time.sleep(0.0005)
        samples = []
        while time.time() < end:
            began = time.perf_counter_ns()
            conn.execute("SELECT v FROM flood_probe WHERE id = %s", [random.randrange(PROBE_ROWS)]).fetchone()
            samples.append((time.perf_counter_ns() - began) / 1000)
            time.sleep(PROBE_INTERVAL)
    print(json.dumps({"selects": len(samples), "p50_us": _p(samples, 0.5), "p99_us": _p(samples, 0.99)}))


# --------------------------------------------------------------------------- coordinator


class Group:
    """``n`` worker processes of one configuration."""

    def __init__(self, config: str, n: int, port: int) -> None:
        env = {**os.environ, CONFIG_ENV: config, PORT_ENV: str(port), "PYTHONPATH": str(ROOT)}
        self.config = config
        self.workers = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(n)
        ]
        for worker in self.workers:  # started and set up, so that no phase times a start
            self.receive(worker)

    def send(self, worker: subprocess.Popen, do: str, **args: Any) -> None:
        assert worker.stdin is not None
        worker.stdin.write(json.dumps({"do": do, "args": args}) + "\n")
        worker.stdin.flush()

    def receive(self, worker: subprocess.Popen) -> Any:
        assert worker.stdout is not None
        line = worker.stdout.readline()
        if not line:
            raise SystemExit(f"a worker of {self.config} died (exit {worker.wait()})")
        return json.loads(line)

    def all(self, do: str, args: list[dict[str, Any]]) -> list[Any]:
        """Send each worker its command (``args[i]`` to worker i) and gather the answers."""
        for worker, one in zip(self.workers, args, strict=True):
            self.send(worker, do, **one)
        return [self.receive(worker) for worker in self.workers]

    def one(self, do: str, **args: Any) -> Any:
        self.send(self.workers[0], do, **args)
        return self.receive(self.workers[0])

    def close(self) -> None:
        for worker in self.workers:
            if worker.poll() is None:
                self.send(worker, "quit")
        for worker in self.workers:
            worker.wait(timeout=30)


class Counter:
    """Store operations of one backend, counted on its server."""

    def __init__(self, backend: str, redis_server: Any) -> None:
        self.backend = backend
        if backend == "redis":
            # One connection for every read: a new one would add its handshake's commands.
            self.client = redis_server.client()
            first = self.client.info("stats")["total_commands_processed"]
            # What one INFO call adds to the count, so that the benchmark's own are left out.
            self.info_cost = self.client.info("stats")["total_commands_processed"] - first

    def read(self) -> dict[str, int]:
        """The server's counts now (PostgreSQL: once the workers' closed connections reported).

        ``ops`` is what the targets use; the rest (Redis: calls by command; PostgreSQL:
        rows by what was done to them) says what the operations were.
        """
        if self.backend == "redis":
            stats = self.client.info("commandstats")
            counts = {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in stats.items()}
            return {"ops": int(self.client.info("stats")["total_commands_processed"]), **counts}
        from benchmarks.suite import flood_settings as settings
        from benchmarks.suite.stores import admin_connection

        time.sleep(PG_STATS_SETTLE)
        with admin_connection() as admin:
            admin.execute("SELECT pg_stat_clear_snapshot()")
            row = admin.execute(
                "SELECT xact_commit + xact_rollback, xact_rollback, tup_returned, tup_fetched, tup_inserted, "
                "tup_updated, tup_deleted FROM pg_stat_database WHERE datname = %s",
                [settings.PG_DATABASE],
            ).fetchone()
        names = ("ops", "rollbacks", "tup_returned", "tup_fetched", "tup_inserted", "tup_updated", "tup_deleted")
        return dict(zip(names, map(int, row), strict=True))

    def between(self, before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
        """Counts between two reads, less the reads themselves (Redis: the INFO calls)."""
        out = {name: after[name] - before.get(name, 0) for name in after if after[name] != before.get(name, 0)}
        if self.backend == "redis":
            # Two INFO calls a read (commandstats, then stats), and commandstats is read first.
            out["ops"] = out.get("ops", 0) - self.info_cost * 2
            out["info"] = out.get("info", 0) - 2
        return out


def flood(
    group: Group, counter: Counter | None, name: str, key: str | None, keys: int, seconds: float, warm: bool = False
) -> dict[str, Any]:
    """One flood by the group's workers (and the probe, when ``counter``): summed figures."""
    n = len(group.workers)
    before = counter.read() if counter else {}
    start = time.time() + 1.0
    end = start + seconds
    probe = None
    if counter:
        probe = subprocess.Popen(
            [sys.executable, __file__, "--probe", str(start), str(end)],
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
    args = [
        {
            "name": name,
            "key": key,
            "keys": keys,
            "offset": i * keys // n,
            "start": start,
            "end": end,
            "warm_key": f"warm-up-{i}" if warm else None,
        }
        for i in range(n)
    ]
    results = group.all("flood", args)
    out: dict[str, Any] = {
        field: sum(r[field] for r in results)
        for field in ("decisions", "admitted", "failed_open", "refused_busy", "denied", "cached")
    }
    out["per_second"] = round(out["decisions"] / seconds)
    out["cached_share"] = out["cached"] / out["denied"] if out["denied"] else 0.0
    out["maxrss_mib"] = [round(r["maxrss_kib"] / 1024, 1) for r in results]
    out["deny_cache_size"] = [r["deny_cache_size"] for r in results]
    if counter and probe:
        stdout, _ = probe.communicate(timeout=60)
        out["probe"] = json.loads(stdout)
        out["store_counts"] = counts = counter.between(before, counter.read())
        out["store_ops"] = counts["ops"]
        out["ops_per_denial"] = out["store_ops"] / out["denied"] if out["denied"] else None
    return out


def run_backend(backend: str, redis_server: Any, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The warm-up of one backend's rotating keys, then its phases with the cache off and on."""
    counter = Counter(backend, redis_server)
    # Processes of their own: a process that exhausted a key remembers it as likely denied
    # (the backends' RecentDenials) and reads it first; the flood's must start alike.
    print(f"{backend}: warm-up, {args.keys:,} keys exhausted by {args.processes} processes ...", flush=True)
    group = Group(f"{backend}-off", args.processes, redis_server.port)
    try:
        n = args.processes
        began = time.perf_counter()
        spread = [{"start": i * args.keys // n, "stop": (i + 1) * args.keys // n} for i in range(n)]
        exhausted = group.all("exhaust_rotating", spread)
        result["warmup"][backend] = {
            "keys": args.keys,
            "seconds": round(time.perf_counter() - began, 2),
            "admitted": sum(r["admitted"] for r in exhausted),
        }
    finally:
        group.close()
    print(f"  in {result['warmup'][backend]['seconds']} s", flush=True)
    for cache in ("off", "on"):
        config = f"{backend}-{cache}"
        print(f"{config}: starting {args.processes} processes ...", flush=True)
        group = Group(config, args.processes, redis_server.port)
        try:
            row: dict[str, Any] = {"backend": backend, "cache": cache}
            group.one("exhaust", name="flood", key="victim")
            row["one_key"] = flood(group, counter, "flood", "victim", 1, args.seconds)
            print(f"  (a) one key: {json.dumps(row['one_key'])}", flush=True)
            row["rotating"] = flood(group, counter, "rotating", None, args.keys, args.seconds)
            print(f"  (b) rotating keys: {json.dumps(row['rotating'])}", flush=True)
            row["sequential"] = group.one("sequential", rounds=args.rounds, calls=args.calls, requests=args.requests)
            expected = {path: [code] for path, code in VIEW_STATUSES.items()}
            if row["sequential"]["statuses"] != expected:
                raise SystemExit(f"{config}: the views answered {row['sequential']['statuses']}, not {expected}")
            print(f"  sequential: {json.dumps(row['sequential'])}", flush=True)
        finally:
            group.close()
        result["configs"][config] = row


def run_fail_open(redis_server: Any, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Item 7: 8 processes on one fresh key under FAIL_OPEN and a 20 ms TIMEOUT, cache off and on."""
    from benchmarks.suite import flood_settings as settings

    bound = settings.FLOOD_LIMIT["capacity"] + settings.FLOOD_LIMIT["rate"] * args.seconds
    for cache in ("off", "on"):
        config = f"failopen-{cache}"
        print(f"{config}: starting {args.processes} processes ...", flush=True)
        group = Group(config, args.processes, redis_server.port)
        try:
            row = flood(group, None, "flood", f"fresh-{cache}", 1, args.seconds, warm=True)
        finally:
            group.close()
        row["bound"] = bound
        row["let_through"] = row["admitted"] + row["failed_open"]
        print(f"  {json.dumps(row)}", flush=True)
        result["fail_open"][cache] = row


#: Issue 48's login phase: (path, protected, attempts). An unprotected login runs Django's
#: PBKDF2 (about a second each on 2 cores): a few are enough for its median.
LOGIN_RUNS = (
    ("direct", True, 2000),
    ("direct", False, 5),
    ("view", True, 1000),
    ("view", False, 5),
)


def run_login(redis_server: Any, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Issue 48: a locked-out account's wrong passwords, protected and not, per backend."""
    for backend in BACKENDS:
        config = f"login-{backend}"
        print(f"{config}: starting 1 process ...", flush=True)
        counter = Counter(backend, redis_server)
        group = Group(config, 1, redis_server.port)
        try:
            row: dict[str, Any] = {"prepare": group.one("login_prepare")}
            for path, protected, attempts in LOGIN_RUNS:
                before = counter.read()
                measured = group.one("login_measure", path=path, protected=protected, attempts=attempts)
                ops = counter.between(before, counter.read()).get("ops", 0)
                measured["store_ops"] = ops
                measured["store_ops_per_attempt"] = ops / attempts
                row[f"{path}-{'protected' if protected else 'unprotected'}"] = measured
                print(f"  {path}, {'protected' if protected else 'unprotected'}: {json.dumps(measured)}", flush=True)
        finally:
            group.close()
        result["login"][backend] = row


# --------------------------------------------------------------------------- report


def verdicts(result: dict[str, Any]) -> list[str]:
    """Issue 35's targets, met or MISSED, each with the figures it comes from."""
    configs, lines = result["configs"], []

    def say(ok: bool, text: str) -> None:
        lines.append(f"{'met' if ok else 'MISSED'}: {text}")

    for backend, label in BACKENDS.items():
        on, off = configs[f"{backend}-on"], configs[f"{backend}-off"]
        a_on, a_off = on["one_key"], off["one_key"]
        ops = a_on["ops_per_denial"]
        say(
            ops is not None and ops <= OPS_PER_DENIAL,
            f"{label}, one key, cache on: store operations per denied decision ≤ {OPS_PER_DENIAL:g}: "
            f"{ops:.5f} ({a_on['store_ops']:,} over {a_on['denied']:,} denials; "
            f"cache off {a_off['ops_per_denial']:.3f})",
        )
        ratio = a_on["per_second"] / a_off["per_second"]
        say(
            ratio >= THROUGHPUT_RATIO,
            f"{label}, one key: throughput cache on ≥ {THROUGHPUT_RATIO:g}× off: {ratio:.1f}× "
            f"({a_on['per_second']:,} vs {a_off['per_second']:,} decisions/s)",
        )
        seq = on["sequential"]["p50_us"]
        ratio = seq["limiter.limit denial"] / seq["Redis PING"]
        say(
            ratio <= PING_RATIO,
            f"{label}, cache on: cached denial p50 ≤ {PING_RATIO:g}× a Redis PING: {ratio:.3f}× "
            f"({seq['limiter.limit denial']:g} vs {seq['Redis PING']:g} µs; "
            f"{100 * on['sequential']['limiter_cached_share']:.2f} % from memory)",
        )
        b_on, b_off = on["rotating"], off["rotating"]
        max_keys = result["settings"]["deny_cache"]["MAX_KEYS"]
        biggest = max(b_on["deny_cache_size"])
        processes, seconds = result["settings"]["processes"], result["settings"]["seconds"]
        background = processes * (math.ceil(seconds) + SETUP_OPS_PER_PROCESS)
        at_off_rate = b_off["ops_per_denial"] * b_on["denied"]
        say(
            biggest <= max_keys and b_on["store_ops"] <= at_off_rate + background,
            f"{label}, {result['settings']['keys']:,} rotating keys: deny cache ≤ MAX_KEYS ({max_keys:,}) and store "
            f"operations per decision no higher than without it: largest cache {biggest:,} keys, "
            f"RSS {max(b_on['maxrss_mib']):g} vs {max(b_off['maxrss_mib']):g} MiB (on vs off, largest process); "
            f"{b_on['ops_per_denial']:.4f} vs {b_off['ops_per_denial']:.4f} operations per denial "
            f"({b_on['store_ops']:,} operations on, {at_off_rate:,.0f} at off's rate, background allowed {background})",
        )
    for cache in ("off", "on"):
        row = result["fail_open"][cache]
        ratio = row["let_through"] / row["bound"]
        say(
            ratio <= FAIL_OPEN_SLACK,
            f"item 7, FAIL_OPEN with TIMEOUT 20 ms, cache {cache}: let through ≤ {FAIL_OPEN_SLACK:g}× the bound: "
            f"{ratio:.2f}× ({row['admitted']:,} admitted by the store + {row['failed_open']:,} failed open, "
            f"bound {row['bound']:g})",
        )
    return lines


def view_denials(result: dict[str, Any]) -> list[str]:
    """Item 4 in figures (not a target): a denial from memory through each view, with the cache on."""
    lines = []
    for backend, label in BACKENDS.items():
        seq = result["configs"][f"{backend}-on"]["sequential"]["p50_us"]
        parts = []
        for view, (denied, refused, plain) in VIEW_DENIALS.items():
            ours, own, bare = seq[denied], seq[refused], seq[plain]
            parts.append(
                f"{view} {ours:g} µs: {ours - own:+.1f} µs ({ours / own:.2f}×) on the view refusing by itself "
                f"({own:g} µs), {ours / bare:.2f}× the view answering 200 ({bare:g} µs)"
            )
        lines.append(f"{label}, cache on, a denial from memory through a view (item 4): " + "; ".join(parts))
    return lines


def login_lines(result: dict[str, Any]) -> list[str]:
    """Issue 48 in figures: a refused login next to an unprotected one (not targets)."""
    lines = [
        "| backend | login | protection | µs per login (p50) | password hashes per login "
        "| store operations per login | answer |",
        "|---|---|---|--:|--:|--:|---|",
    ]
    for backend, row in result.get("login", {}).items():
        for path, label in (("direct", "`authenticate()`"), ("view", "DRF `obtain_auth_token`")):
            for state in ("protected", "unprotected"):
                m = row[f"{path}-{state}"]
                shown = "locked out, refused" if state == "protected" else "none (ModelBackend)"
                statuses = ", ".join(map(str, m["statuses"])) or "returns `None`"
                lines.append(
                    f"| {BACKENDS[backend]} | {label} | {shown} | {m['p50_us']:,.1f} | {m['hashes_per_attempt']:g} "
                    f"| {m['store_ops_per_attempt']:.4f} ({m['store_ops']:,} over {m['attempts']:,}) | {statuses} |"
                )
    return lines


def _n(value: float, digits: int = 0) -> str:
    return f"{value:,.{digits}f}"


def markdown(result: dict[str, Any]) -> str:
    """The docs region: the run's conditions, the targets, and the tables."""
    m, s = result["machine"], result["settings"]
    lines = [
        "<!-- Generated by benchmarks/suite/flood.py (make bench-flood): edit the script, not this section. -->",
        "",
        f"Run {m['date']} ({m['cpus']} cores, load {m['load_before']} before; Python {m['python']}, Django "
        f"{m['django']}, PostgreSQL {m['postgresql']}, Redis {m['redis']} (a private server), commit "
        f"{m['commit']}{' with uncommitted changes' if m['dirty'] else ''}; {s['processes']} processes, "
        f"{s['seconds']:g} s a flood, `DENY_CACHE` {s['deny_cache']}).",
        "",
        *(f"- {line}" for line in verdicts(result)),
        *(f"- {line}" for line in view_denials(result)),
        "",
        "| backend | deny cache | flood | decisions/s | store ops per denial | from memory | admitted "
        "| deny_cache.size() (largest process) | RSS per process (largest) | probe SELECT p50 / p99 |",
        "|---|---|---|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for row in result["configs"].values():
        for flood_name, label in (("one_key", "(a) one key"), ("rotating", f"(b) {s['keys']:,} keys")):
            f = row[flood_name]
            lines.append(
                f"| {BACKENDS[row['backend']]} | {row['cache']} | {label} | {_n(f['per_second'])} "
                f"| {f['ops_per_denial']:.4f} ({_n(f['store_ops'])}) | {100 * f['cached_share']:.1f} % "
                f"| {_n(f['admitted'])} | {_n(max(f['deny_cache_size']))} | {max(f['maxrss_mib']):g} MiB "
                f"| {f['probe']['p50_us']:,.0f} / {f['probe']['p99_us']:,.0f} µs |"
            )
    warm = ", ".join(f"{BACKENDS[b]} {w['seconds']:g} s" for b, w in result["warmup"].items())
    lines += [
        "",
        f"Warm-up of (b), {s['keys']:,} keys exhausted by the {s['processes']} processes: {warm}.",
        "",
        "Sequential, one process per configuration, p50 in µs "
        f"({s['rounds']} interleaved rounds of {s['calls']:,} calls and {s['requests']:,} requests):",
        "",
    ]
    names = list(next(iter(result["configs"].values()))["sequential"]["p50_us"])
    lines += [
        "| backend | deny cache | " + " | ".join(names) + " | limiter denials from memory |",
        "|---|---|" + "--:|" * (len(names) + 1),
    ]
    for row in result["configs"].values():
        seq = row["sequential"]
        lines.append(
            f"| {BACKENDS[row['backend']]} | {row['cache']} | "
            + " | ".join(f"{seq['p50_us'][name]:g}" for name in names)
            + f" | {100 * seq['limiter_cached_share']:.1f} % |"
        )
    lines += [
        "",
        f"Item 7, `FAIL_OPEN` on and the database backend's `TIMEOUT` at 20 ms, {s['processes']} processes on one "
        f"fresh key of 100 + 10/s for {s['seconds']:g} s:",
        "",
        "| deny cache | decisions/s | admitted by the store | let through by failing open "
        "| refused, store busy (503) | bound | let through ÷ bound |",
        "|---|--:|--:|--:|--:|--:|--:|",
    ]
    for cache, row in result["fail_open"].items():
        lines.append(
            f"| {cache} | {_n(row['per_second'])} | {_n(row['admitted'])} | {_n(row['failed_open'])} "
            f"| {_n(row['refused_busy'])} | {row['bound']:g} | {row['let_through'] / row['bound']:.2f}× |"
        )
    if result.get("login"):
        lines += [
            "",
            "Issue 48, login protection: an account locked out (`LOGIN` keys username and address, a limit of 5 "
            "failures per 15 minutes, deny cache on) takes wrong passwords, one process, next to the same login "
            "with `ModelBackend` alone (Django's PBKDF2 at its default iterations; hashes counted by a counting "
            "hasher, store operations on the server around each measurement):",
            "",
            *login_lines(result),
        ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- main


def _prepare_databases() -> None:
    from django.core.management import call_command
    from django.db import connections

    from benchmarks.suite import flood_settings as settings
    from benchmarks.suite.stores import admin_connection

    with admin_connection() as admin:
        for name in (settings.PG_DATABASE, settings.PROBE_DATABASE):
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
            admin.execute(f"CREATE DATABASE {name}")
    import psycopg

    with psycopg.connect(
        host=settings.PG_HOST, port=settings.PG_PORT, user=settings.PG_USER, dbname=settings.PROBE_DATABASE,
        autocommit=True,
    ) as conn:  # fmt: skip
        conn.execute("CREATE TABLE flood_probe (id int PRIMARY KEY, v int NOT NULL)")
        conn.execute(f"INSERT INTO flood_probe SELECT i, i FROM generate_series(0, {PROBE_ROWS - 1}) i")
        conn.execute("VACUUM ANALYZE flood_probe")
    call_command("migrate", verbosity=0)
    connections.close_all()


def _drop_databases() -> None:
    from django.db import connections

    from benchmarks.suite import flood_settings as settings
    from benchmarks.suite.stores import admin_connection

    connections.close_all()
    with admin_connection() as admin:
        for name in (settings.PG_DATABASE, settings.PROBE_DATABASE):
            admin.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def main() -> None:
    """Run every configuration and print the targets (``--help`` for the knobs)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds a flood (default 5)")
    parser.add_argument("--keys", type=int, default=100_000, help="rotating keys of (b) (default 100,000)")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds of the sequential phase")
    parser.add_argument("--calls", type=int, default=1000, help="limiter calls and PINGs a round")
    parser.add_argument("--requests", type=int, default=300, help="requests a view and round")
    parser.add_argument(
        "--only",
        choices=[*BACKENDS, "fail-open", "login"],
        help="one part alone, for a look: prints its figures, no report",
    )
    parser.add_argument("--json", type=Path)
    parser.add_argument("--docs", type=Path, help="rewrite the bench-flood region of this page")
    args = parser.parse_args()

    from tests.redis_servers import RedisServer

    load_before = os.getloadavg()
    with RedisServer() as redis_server:
        os.environ[PORT_ENV] = str(redis_server.port)
        os.environ[CONFIG_ENV] = "db-on"
        _setup_django()
        from benchmarks.suite import flood_settings as settings
        from benchmarks.suite.stores import machine

        result: dict[str, Any] = {
            "kind": "flood",
            "settings": {
                "seconds": args.seconds,
                "keys": args.keys,
                "processes": args.processes,
                "rounds": args.rounds,
                "calls": args.calls,
                "requests": args.requests,
                "deny_cache": settings.DENY_CACHE,
                "flood_limit": settings.FLOOD_LIMIT,
            },
            "warmup": {},
            "configs": {},
            "fail_open": {},
            "login": {},
        }
        started = time.perf_counter()
        _prepare_databases()
        try:
            for backend in BACKENDS:
                if args.only in (None, backend):
                    run_backend(backend, redis_server, args, result)
            if args.only in (None, "fail-open"):
                run_fail_open(redis_server, args, result)
            if args.only in (None, "login"):
                run_login(redis_server, args, result)
            result["machine"] = machine()
        finally:
            _drop_databases()
        if args.only == "login":
            print("\n".join(login_lines(result)))
        if args.only:
            return
        result["machine"]["load_before"] = " ".join(f"{x:.2f}" for x in load_before)
        result["seconds"] = round(time.perf_counter() - started, 1)
    content = markdown(result)
    print()
    print(content)
    print(f"({result['seconds']} s)")
    save(result, content, args.json, args.docs, BEGIN, END)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        worker_main()
    elif sys.argv[1:2] == ["--probe"]:
        probe_main(float(sys.argv[2]), float(sys.argv[3]))
    else:
        main()
