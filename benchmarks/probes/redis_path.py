#!/usr/bin/env python
"""The Redis backend's decision path next to the cheapest Redis rate limiters (issue 19, item 2).

Four implementations of the same limit (100 per second, burst 100), on one Redis:

    raw EVALSHA       a ~20-line token-bucket Lua script of this file, called with
                      ``client.evalsha`` on the django-redis client: the floor for a
                      script-based limiter from Python
    limits            ``limits``' FixedWindowRateLimiter on its RedisStorage
    django-ratelimit  ``is_ratelimited`` (cache.add + cache.incr on django-redis)
    ours              ``limiter.limit(name, key=...)`` through the Redis backend

Phases (the implementations take turns, in a rotating order, so that all see the same
load on a shared machine; the ratios are what to read):

1. latency on fresh keys (every call a key never used: an admission and a write), and
   on one hot key (after its burst, denials), single process, the implementations
   taking turns call by call: p50 and p99 in µs;
2. ``--processes`` (8) processes on one hot key, started together: decisions/s, and
   admissions against what the algorithm allows in that time (over-admission must be 0).

    python benchmarks/probes/redis_path.py                       # about a minute
    python benchmarks/probes/redis_path.py --rounds 9 --json out.json

Not a test: it asserts nothing. Redis database 13 (``--db``), keys under ``tbpath`` only,
deleted before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.probes import timing

PREFIX = "tbpath"
RATE, PERIOD = 100, 1  # 100 per second, burst 100

#: A plain token bucket, as a user would write one for EVALSHA: floats, the server's
#: clock, one key holding "tokens ts", a TTL until full.
RAW_SCRIPT = """
local rate, capacity = tonumber(ARGV[1]), tonumber(ARGV[2])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local tokens, ts = capacity, now
local stored = redis.call('GET', KEYS[1])
if stored then
  local space = string.find(stored, ' ', 1, true)
  tokens = tonumber(string.sub(stored, 1, space - 1))
  ts = tonumber(string.sub(stored, space + 1))
  tokens = math.min(capacity, tokens + (now - ts) * rate / 1000000)
end
if tokens < 1 then
  return 0
end
tokens = tokens - 1
local ttl = math.ceil((capacity - tokens) / rate * 1000)
redis.call('SET', KEYS[1], string.format('%.17g %d', tokens, now), 'PX', ttl)
return 1
"""


def configure(db: int) -> None:
    import django
    from django.conf import settings

    url = f"redis://{os.environ.get('REDIS_HOST', '127.0.0.1')}:{os.environ.get('REDIS_PORT', '6379')}/{db}"
    settings.configure(
        SECRET_KEY="benchmark-only",
        INSTALLED_APPS=["django_tokenbucket"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        CACHES={
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": url,
                "KEY_PREFIX": PREFIX,
                "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 10},
            }
        },
        TOKENBUCKET={
            "BACKEND": "django_tokenbucket.backends.redis.RedisBackend",
            # The store path is what is measured: denials from memory would never reach Redis.
            "DENY_CACHE": False,
            "LIMITS": {"bench": {"rate": RATE, "period": PERIOD}},
        },
        REDIS_URL=url,
        SILENCED_SYSTEM_CHECKS=["django_ratelimit.E003", "django_ratelimit.W001"],
    )
    django.setup()


def adapters() -> dict[str, Callable[[str], bool]]:
    """Return ``decide(key) -> allowed`` of each implementation."""
    import limits
    from django.conf import settings
    from django.test import RequestFactory
    from django_ratelimit.core import is_ratelimited
    from django_redis import get_redis_connection
    from limits.storage import RedisStorage

    from django_tokenbucket import limiter

    client = get_redis_connection("default")
    sha = client.script_load(RAW_SCRIPT)
    rate, capacity = str(RATE / PERIOD), str(RATE)

    def raw(key: str) -> bool:
        return client.evalsha(sha, 1, f"{PREFIX}:raw:{key}", rate, capacity) == 1

    storage = RedisStorage(settings.REDIS_URL, key_prefix=f"{PREFIX}-limits")
    fixed = limits.strategies.FixedWindowRateLimiter(storage)
    item = limits.parse(f"{RATE} per {PERIOD} second")

    def limits_fixed(key: str) -> bool:
        return bool(fixed.hit(item, "bench", key))

    request = RequestFactory().get("/")
    current = [""]

    def ratelimit_key(group: str, request: object) -> str:
        return current[0]

    def django_ratelimit(key: str) -> bool:
        current[0] = key
        return not is_ratelimited(request, group="bench", key=ratelimit_key, rate=f"{RATE}/s", increment=True)

    def ours(key: str) -> bool:
        return limiter.limit("bench", key=key).ok

    return {"raw EVALSHA": raw, "limits fixed window": limits_fixed, "django-ratelimit": django_ratelimit, "ours": ours}


def cleanup() -> None:
    from django_redis import get_redis_connection

    client = get_redis_connection("default")
    for pattern in (f"{PREFIX}:*", f"{PREFIX}-limits*", f":*:{PREFIX}*"):
        keys = list(client.scan_iter(match=pattern, count=1000))
        for start in range(0, len(keys), 500):
            client.delete(*keys[start : start + 500])


def latencies(rounds: int, calls: int) -> dict[str, dict[str, list[float]]]:
    """Per-call latencies (µs) by scenario and implementation.

    The implementations take turns call by call (in a rotating order), so that a burst
    of load from another process on the machine hits all of them alike.
    """
    impls = adapters()
    samples: dict[str, dict[str, list[float]]] = {s: {n: [] for n in impls} for s in ("fresh", "hot")}
    timing.warm_up(impls.values(), [(f"warm-{i}",) for i in range(200)])
    for r in range(rounds):
        for scenario in ("fresh", "hot"):
            keys = [f"{scenario}-{r}-{i}" if scenario == "fresh" else f"hot-{r}" for i in range(calls)]
            for name, taken in timing.take_turns(impls, keys, by_call=True, rotating=True).items():
                samples[scenario][name] += [latency * 1e6 for latency in taken]
    return samples


def _hammer(db: int, name: str, key: str, start_at: float, seconds: float) -> tuple[int, int, float, float]:
    """One of the processes on the hot key: calls and admissions from ``start_at`` for ``seconds``."""
    configure(db)
    decide = adapters()[name]
    decide("warm-up-" + str(os.getpid()))
    while time.time() < start_at:
        time.sleep(0.001)
    admitted = calls = 0
    started = time.time()
    deadline = start_at + seconds
    while True:
        for _ in range(50):
            admitted += decide(key)
        calls += 50
        if time.time() >= deadline:
            break
    # Wall-clock times: the span of the run is from the first start to the last end.
    return calls, admitted, started, time.time()


def processes(
    db: int, processes: int, seconds: float, repeats: int, names: list[str]
) -> dict[str, list[dict[str, Any]]]:
    def run(name: str, r: int) -> dict[str, Any]:
        """``processes`` processes of ``name`` on a hot key of this run, started together."""
        key = f"mp-{r}-{name.replace(' ', '-')}"
        start_at = time.time() + 6.0  # spawning 8 interpreters on 2 cores takes a while
        pool = [(db, name, key, start_at, seconds)] * processes
        figures = timing.in_processes(_hammer, pool, timeout=seconds + 120)
        calls = sum(f[0] for f in figures)
        admitted = sum(f[1] for f in figures)
        elapsed = max(f[3] for f in figures) - min(f[2] for f in figures)
        windows = elapsed / PERIOD
        # A token bucket admits its burst plus its refill; a fixed window at most
        # floor(Δ/W) + 2 windows' worth.
        bound = (
            RATE + RATE * windows
            if name != "limits fixed window" and name != "django-ratelimit"
            else RATE * (math.floor(windows) + 2)
        )
        return {
            "per_s": calls / elapsed,
            "admitted": admitted,
            "bound": bound,
            "over": max(0, admitted - math.floor(bound)),
        }

    return timing.in_rounds(names, repeats, run, rotating=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", type=int, default=13, help="Redis database (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved latency rounds (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=2000, help="calls per implementation per round and scenario")
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0, help="hot-key run per implementation (default: 3)")
    parser.add_argument("--repeats", type=int, default=2, help="multi-process runs of each implementation")
    parser.add_argument("--skip-processes", action="store_true")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    if args.db == 15:
        parser.error("Redis database 15 belongs to the test suite")

    configure(args.db)
    cleanup()
    try:
        samples = latencies(args.rounds, args.calls)
        names = list(samples["fresh"])
        mp = {} if args.skip_processes else processes(args.db, args.processes, args.seconds, args.repeats, names)
    finally:
        cleanup()

    report: dict[str, Any] = {"latency_us": {}, "processes": {}}
    print(f"latency, µs ({args.rounds} interleaved rounds of {args.calls} calls each)")
    print(f"{'':22} {'fresh p50':>10} {'p99':>8} {'hot p50':>10} {'p99':>8}")
    for name in names:
        row = {}
        for scenario in ("fresh", "hot"):
            values = samples[scenario][name]
            row[scenario] = {"p50": statistics.median(values), "p99": timing.percentile(values, 0.99)}
        report["latency_us"][name] = row
        print(
            f"{name:22} {row['fresh']['p50']:10.1f} {row['fresh']['p99']:8.1f} "
            f"{row['hot']['p50']:10.1f} {row['hot']['p99']:8.1f}"
        )
    lat = report["latency_us"]
    for scenario in ("fresh", "hot"):
        p50 = {name: row[scenario]["p50"] for name, row in lat.items()}
        print(
            f"{scenario}: ours / raw EVALSHA {timing.ratio(p50['ours'], p50['raw EVALSHA']):.3f} (target <= 1.15), "
            f"ours / limits {timing.ratio(p50['ours'], p50['limits fixed window']):.3f} (<= 1.1), "
            f"ours / django-ratelimit {timing.ratio(p50['ours'], p50['django-ratelimit']):.3f} (< 1)"
        )
    if mp:
        print(f"\n{args.processes} processes on one hot key, {args.seconds:g} s each, {args.repeats} runs")
        for name, runs in mp.items():
            rates = [run["per_s"] for run in runs]
            report["processes"][name] = {"per_s": statistics.median(rates), "runs": runs}
            overs = [run["over"] for run in runs]
            print(
                f"{name:22} {statistics.median(rates):10,.0f} dec/s   "
                f"runs {[round(x) for x in rates]}   over-admitted {overs}"
            )
        throughput = timing.ratio(
            report["processes"]["ours"]["per_s"], report["processes"]["limits fixed window"]["per_s"]
        )
        print(f"ours / limits throughput {throughput:.3f} (>= 0.8)")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
