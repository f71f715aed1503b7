#!/usr/bin/env python
"""Decisions per second of the Redis backend next to a bare PING, measured in the same run.

PING is the floor for any Redis call (one round trip, no work); the difference is what
the decision costs: building the arguments, the Lua script, and parsing the reply.
Rounds of each kind alternate, so that both see the same machine load.

    .venv/bin/python benchmarks/probes/redis_vs_ping.py                      # 127.0.0.1:6379, db 14
    .venv/bin/python benchmarks/probes/redis_vs_ping.py --url redis://host:6379/3 --seconds 5
    .venv/bin/python benchmarks/probes/redis_vs_ping.py --cluster redis://127.0.0.1:7000
    .venv/bin/python benchmarks/probes/redis_vs_ping.py --processes 4       # aggregate throughput

Not a test: it asserts nothing and prints a table (and, with --json, one JSON line).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.probes import timing


def configure(url: str, cluster: bool) -> None:
    import django
    from django.conf import settings

    options: dict[str, object] = {"SOCKET_TIMEOUT": 5}
    if cluster:
        options["CONNECTION_FACTORY"] = "django_tokenbucket.backends.redis.ClusterConnectionFactory"
    settings.configure(
        # Keys are HMACs under SECRET_KEY: without one no decision can be made.
        SECRET_KEY="benchmark-only",
        INSTALLED_APPS=["django_tokenbucket"],
        CACHES={
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": url,
                "KEY_PREFIX": f"tbbench-{os.getpid()}",
                "OPTIONS": options,
            }
        },
        TOKENBUCKET={
            "BACKEND": "django_tokenbucket.backends.redis.RedisBackend",
            # The store path is what is measured: denials from memory would never reach Redis.
            "DENY_CACHE": False,
            "LIMITS": {
                # Never runs dry: every decision is allowed and writes its key.
                "allowed": {"rate": 10**9, "period": 1},
                # Always dry: every decision is a denial, which writes nothing.
                "denied": {"rate": 1, "period": 86_400, "capacity": 1},
            },
        },
    )
    django.setup()


def measure(seconds: float, rounds: int, worker: int = 0) -> dict[str, float]:
    from django_tokenbucket import limiter
    from django_tokenbucket.backends import get_backend
    from django_tokenbucket.backends.base import Request
    from django_tokenbucket.keys import encode_key

    backend = get_backend()
    client = backend.client()
    key = f"bench-{worker}"
    limiter.limit("denied", key)  # empty it
    allowed = limiter.resolve("allowed")
    one = [Request(allowed, encode_key(key), 1_000_000)]
    kinds: dict[str, Callable[[], object]] = {
        "PING": client.ping,
        "decision (script only, allowed)": lambda: backend.decide(one, apply=True),
        "limiter.limit() allowed": lambda: limiter.limit("allowed", key),
        "limiter.limit() denied": lambda: limiter.limit("denied", key),
    }
    timing.warm_up(kinds.values(), [()])  # connections, script cache
    turn = seconds / rounds / len(kinds)
    samples = timing.in_rounds(list(kinds), rounds, lambda name, _: timing.rate(kinds[name], turn))
    return {name: statistics.median(values) for name, values in samples.items()}


def _worker(url: str, cluster: bool, seconds: float, rounds: int, index: int) -> dict[str, float]:
    """One client process of ``--processes``: its own Django, then its figures."""
    configure(url, cluster)
    figures = measure(seconds, rounds, index)
    # Its keys are under a prefix of its own (its process id): the main process's cleanup misses them.
    cleanup()
    return figures


def cleanup() -> None:
    from django.core.cache import caches
    from django_redis import get_redis_connection

    client = get_redis_connection("default")
    pattern = f"{caches['default'].key_prefix}:*"
    keys = list(client.scan_iter(match=pattern))
    for key in keys:
        client.delete(key)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--url", default="redis://127.0.0.1:6379/14", help="Redis URL (default: %(default)s; 15 is the tests')"
    )
    parser.add_argument("--cluster", metavar="URL", help="a Redis Cluster node's URL, instead of --url")
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per process (default: 4)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default: 5)")
    parser.add_argument("--processes", type=int, default=1, help="concurrent client processes (default: 1)")
    parser.add_argument("--json", action="store_true", help="also print the figures as one JSON line")
    args = parser.parse_args()

    url, cluster = (args.cluster, True) if args.cluster else (args.url, False)
    if args.processes == 1:
        configure(url, cluster)
        results = [measure(args.seconds, args.rounds)]
    else:
        clients = [(url, cluster, args.seconds, args.rounds, i) for i in range(args.processes)]
        results = timing.in_processes(_worker, clients, timeout=args.seconds * 10 + 60)
        configure(url, cluster)
    cleanup()

    totals = {name: sum(r[name] for r in results) for name in results[0]}
    ping = totals["PING"]
    print(f"Redis {'cluster ' if cluster else ''}{url}, {args.processes} process(es), medians of {args.rounds} rounds")
    print(f"{'':34} {'calls/s':>10} {'µs/call':>9} {'vs PING':>8}")
    for name, per_second in totals.items():
        micros = 1e6 * args.processes / per_second
        print(f"{name:34} {per_second:10,.0f} {micros:9.1f} {timing.ratio(per_second, ping):8.2f}")
    if args.json:
        print(json.dumps({"url": url, "cluster": cluster, "processes": args.processes, "per_second": totals}))


if __name__ == "__main__":
    main()
