#!/usr/bin/env python
"""What the Redis backend's default deadline costs a healthy call (issue 46).

A decision with the defaults (no ``TIMEOUT``: the default deadline and the per-node
breaker, and, on a cache that sets no socket timeout, the backend's own client) next to
the same decision with ``TIMEOUT: None`` (each call left to redis-py), sync and asyncio,
in rounds that alternate so that both see the same machine load. Each round times
``--calls`` decisions one by one (a limit that never runs dry: every one runs the
script) and keeps their median; the table gives the median of the rounds and of the
rounds' ratios.

    .venv/bin/python benchmarks/probes/redis_deadline_cost.py                  # 127.0.0.1:6379, db 14
    .venv/bin/python benchmarks/probes/redis_deadline_cost.py --rounds 12 --calls 3000
    .venv/bin/python benchmarks/probes/redis_deadline_cost.py --cache-options '{"SOCKET_TIMEOUT": 0.2}'

Not a test: it asserts nothing and prints a table (and, with --json, one JSON line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

LIMIT = {"rate": 10**9, "period": 1}
KEYS = [f"k{i}" for i in range(50)]


def configure(url: str, cache_options: dict[str, Any]) -> None:
    import django
    from django.conf import settings

    settings.configure(
        # Keys are HMACs under SECRET_KEY: without one no decision can be made.
        SECRET_KEY="benchmark-only",
        INSTALLED_APPS=["django_tokenbucket"],
        CACHES={
            "default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"},
            "redis": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": url,
                "KEY_PREFIX": f"tbbench-{os.getpid()}",
                "OPTIONS": cache_options,
            },
        },
        TOKENBUCKET={"BACKEND": "django_tokenbucket.backends.redis.RedisBackend", "OPTIONS": {"CACHE": "redis"}},
    )
    django.setup()


def tokenbucket(options: dict[str, Any]) -> dict[str, Any]:
    # No deny cache and no overrides: the store path is what is measured.
    return {
        "BACKEND": "django_tokenbucket.backends.redis.RedisBackend",
        "OPTIONS": options,
        "DENY_CACHE": False,
        "OVERRIDES": False,
    }


def sync_round(options: dict[str, Any], calls: int) -> float:
    from django.test import override_settings

    from django_tokenbucket import limiter

    with override_settings(TOKENBUCKET=tokenbucket(options)):
        for i in range(200):  # warm: connections made, script loaded
            limiter.limit("cost", KEYS[i % len(KEYS)], config=LIMIT)
        times = []
        for i in range(calls):
            started = time.perf_counter()
            limiter.limit("cost", KEYS[i % len(KEYS)], config=LIMIT)
            times.append(time.perf_counter() - started)
    return statistics.median(times)


def asyncio_round(options: dict[str, Any], calls: int) -> float:
    from django.test import override_settings

    from django_tokenbucket import limiter

    async def run() -> float:
        for i in range(200):
            await limiter.alimit("cost", KEYS[i % len(KEYS)], config=LIMIT)
        times = []
        for i in range(calls):
            started = time.perf_counter()
            await limiter.alimit("cost", KEYS[i % len(KEYS)], config=LIMIT)
            times.append(time.perf_counter() - started)
        return statistics.median(times)

    with override_settings(TOKENBUCKET=tokenbucket(options)):
        return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--cache-options", default="{}", help="the cache's OPTIONS, as JSON (default: none)")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--calls", type=int, default=3000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configure(args.url, json.loads(args.cache_options))

    configs = {"TIMEOUT None": {"CACHE": "redis", "TIMEOUT": None}, "defaults": {"CACHE": "redis"}}
    medians: dict[tuple[str, str], list[float]] = {(api, name): [] for api in ("sync", "asyncio") for name in configs}
    for number in range(args.rounds):
        order = list(configs.items()) if number % 2 == 0 else list(reversed(configs.items()))
        for api, run_round in (("sync", sync_round), ("asyncio", asyncio_round)):
            for name, options in order:
                medians[(api, name)].append(run_round(options, args.calls))

    rows = []
    print(f"{'API':8} {'TIMEOUT None µs':>16} {'defaults µs':>12} {'ratio (median of rounds)':>26}")
    for api in ("sync", "asyncio"):
        unbounded, bounded = medians[(api, "TIMEOUT None")], medians[(api, "defaults")]
        ratio = statistics.median(b / u for u, b in zip(unbounded, bounded, strict=True))
        row = {
            "api": api,
            "timeout_none_us": round(statistics.median(unbounded) * 1e6, 1),
            "defaults_us": round(statistics.median(bounded) * 1e6, 1),
            "ratio": round(ratio, 3),
        }
        rows.append(row)
        print(f"{api:8} {row['timeout_none_us']:>16} {row['defaults_us']:>12} {row['ratio']:>26}")
    if args.json:
        figures = {"rounds": args.rounds, "calls": args.calls, "cache_options": args.cache_options, "rows": rows}
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
