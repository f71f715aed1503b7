#!/usr/bin/env python
"""An async view's ``@ratelimit`` overhead next to a sync view's, under a real ASGI server.

uvicorn serves a small Django project (this module, ``--serve``) on a free loopback
port, one worker; a load client in another process sends a fixed number of HTTP/1.1
requests per view over keep-alive connections. The views, all decided on the same Redis:

    sync  plain          a sync view, no decorator (baseline of the sync views)
    sync  @ratelimit     the same with @ratelimit(key="ip") on the Redis backend
    async plain          an ``async def`` view, no decorator (baseline of the async views)
    async @ratelimit     the same with @ratelimit: redis-py's asyncio client, no thread
    async thread hop     the same on a Redis backend that this harness forces onto the
                         thread path (``ThreadedRedisBackend``: the blocking client in
                         ``sync_to_async``, which is what every async view paid before)

A sync view under ASGI runs in asgiref's thread anyway; an async view did too as soon as
it was decorated, and no longer does. Phases, interleaved in rounds that rotate the views'
order: sequential requests (one connection: latency p50/p99), then ``--connections``
connections at once (requests/s, and the server process's CPU time per request, read
from /proc: on a shared machine the steadier figure). OVERHEAD is a view's p50 minus its
baseline's p50, +CPU its CPU per request minus the baseline's, in the same rounds. The
limit allows every request (10^6 per second, one bucket).

    python benchmarks/probes/asgi_async.py                 # about a minute
    python benchmarks/probes/asgi_async.py --quick         # about 15 s
    python benchmarks/probes/asgi_async.py --json out.json

Needs uvicorn (``pip install uvicorn``) and Redis on REDIS_HOST/REDIS_PORT (127.0.0.1:6379);
it uses Redis database 13 and only keys under ``tbasgi``. Not a test: it asserts nothing
about speed; the first round checks that every limited view answers 429 when its limit
says so.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.probes import timing  # noqa: E402

REDIS_HOST = os.environ.get("REDIS_HOST", "127.0.0.1")
REDIS_PORT = int(os.environ.get("REDIS_PORT", "6379"))
REDIS_URL = f"redis://{REDIS_HOST}:{REDIS_PORT}/13"
PREFIX = "tbasgi"
RATE = "1000000/s"

#: path -> (label, baseline path)
VIEWS = {
    "/sync/plain/": ("sync  plain", None),
    "/sync/limited/": ("sync  @ratelimit", "/sync/plain/"),
    "/async/plain/": ("async plain", None),
    "/async/native/": ("async @ratelimit (asyncio)", "/async/plain/"),
    "/async/thread/": ("async @ratelimit (thread hop)", "/async/plain/"),
}
#: Views allowing 2 requests an hour, for the sanity check (the 3rd answers 429).
SANITY = ["/sanity/sync/", "/sanity/native/", "/sanity/thread/"]


# -- the served project (``--serve``) ------------------------------------------------------


def _configure() -> None:
    import django
    from django.conf import settings

    settings.configure(
        DEBUG=False,
        SECRET_KEY="benchmark",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        INSTALLED_APPS=["django.contrib.contenttypes", "django.contrib.auth", "django_tokenbucket"],
        MIDDLEWARE=["django.middleware.common.CommonMiddleware"],
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        CACHES={
            "default": {
                "BACKEND": "django_redis.cache.RedisCache",
                "LOCATION": REDIS_URL,
                "KEY_PREFIX": PREFIX,
                "OPTIONS": {"SOCKET_CONNECT_TIMEOUT": 2, "SOCKET_TIMEOUT": 5},
            }
        },
        TOKENBUCKET={
            # The store path is what is measured: denials from memory would never reach Redis.
            "DENY_CACHE": False,
            "BACKENDS": {
                "default": {"BACKEND": "django_tokenbucket.backends.redis.RedisBackend"},
                # The old async path, on the same cache: see ThreadedRedisBackend.
                "threaded": {"BACKEND": f"{__name__}.ThreadedRedisBackend"},
            },
        },
        LOGGING_CONFIG=None,
        USE_TZ=True,
    )
    django.setup()
    # The sanity check's 429s are expected: no "Too Many Requests" lines.
    logging.getLogger("django.request").setLevel(logging.ERROR)


if os.environ.get("TB_ASGI_BENCH_SERVE") == "1":
    _configure()
    from django.core.asgi import get_asgi_application
    from django.http import HttpResponse
    from django.urls import path

    from django_tokenbucket.backends.base import BaseBackend
    from django_tokenbucket.backends.redis import RedisBackend
    from django_tokenbucket.decorators import ratelimit

    class ThreadedRedisBackend(RedisBackend):
        """The Redis backend as async views had it before: the blocking client in a thread.

        Harness only: with ``asyncio_native`` false the decorator plans and decides in
        one ``sync_to_async``, and the async twins are BaseBackend's thread path.
        """

        asyncio_native = False
        adecide = BaseBackend.adecide
        areset = BaseBackend.areset
        arefund = BaseBackend.arefund

    def sync_plain(request: Any) -> HttpResponse:
        return HttpResponse(b"ok")

    async def async_plain(request: Any) -> HttpResponse:
        return HttpResponse(b"ok")

    def limited(view: Any, name: str, rate: str = RATE, backend: str | None = None) -> Any:
        return ratelimit(name, key="ip", rate=rate, backend=backend)(view)

    urlpatterns = [
        path("sync/plain/", sync_plain),
        path("sync/limited/", limited(sync_plain, "bench.sync")),
        path("async/plain/", async_plain),
        path("async/native/", limited(async_plain, "bench.native")),
        path("async/thread/", limited(async_plain, "bench.thread", backend="threaded")),
        path("sanity/sync/", limited(sync_plain, "sanity.sync", "2/h")),
        path("sanity/native/", limited(async_plain, "sanity.native", "2/h")),
        path("sanity/thread/", limited(async_plain, "sanity.thread", "2/h", backend="threaded")),
    ]
    application = get_asgi_application()


# -- the load client ---------------------------------------------------------------------


async def _request(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str) -> int:
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    if length:
        await reader.readexactly(length)
    return status


async def _sequential(port: int, path: str, count: int) -> list[float]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    times = []
    try:
        for _ in range(count):
            start = time.perf_counter()
            status = await _request(reader, writer, path)
            times.append(time.perf_counter() - start)
            if status != 200:
                raise RuntimeError(f"{path} answered {status}")
    finally:
        writer.close()
    return times


def _cpu_seconds(pid: int) -> float:
    """The CPU time (user + system, every thread) the process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _concurrent(port: int, path: str, count: int, connections: int, pid: int) -> tuple[float, float]:
    """Return requests/s and the server's CPU seconds per request."""
    remaining = count

    async def worker() -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while remaining > 0:
                remaining -= 1
                status = await _request(reader, writer, path)
                if status != 200:
                    raise RuntimeError(f"{path} answered {status}")
        finally:
            writer.close()

    cpu = _cpu_seconds(pid)
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(connections)))
    elapsed = time.perf_counter() - start
    return count / elapsed, (_cpu_seconds(pid) - cpu) / count


async def _sanity(port: int) -> None:
    for path in SANITY:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        codes = [await _request(reader, writer, path) for _ in range(3)]
        writer.close()
        if codes != [200, 200, 429]:
            raise RuntimeError(f"sanity: {path} answered {codes}, expected [200, 200, 429]")


async def _drive(
    port: int, pid: int, rounds: int, sequential: int, concurrent: int, connections: int
) -> dict[str, Any]:
    await _sanity(port)
    paths = list(VIEWS)
    # Untimed first requests, as timing.warm_up would make them if it could await: connections,
    # the script, the asyncio client.
    for path in paths:
        await _sequential(port, path, 50)
    latencies: dict[str, list[float]] = {path: [] for path in paths}
    rates: dict[str, list[float]] = {path: [] for path in paths}
    cpu: dict[str, list[float]] = {path: [] for path in paths}
    for round_ in range(rounds):
        order = timing.rotate(paths, round_)
        for path in order:
            latencies[path] += await _sequential(port, path, sequential)
        for path in order:
            rate, cpu_per_request = await _concurrent(port, path, concurrent, connections, pid)
            rates[path].append(rate)
            cpu[path].append(cpu_per_request)
    return {"latencies": latencies, "rates": rates, "cpu": cpu}


# -- the run -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _clear_keys() -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"{PREFIX}:*", count=1000))
    if keys:
        client.unlink(*keys)
    client.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and requests")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sequential", type=int, default=400, help="sequential requests per view and round")
    parser.add_argument("--concurrent", type=int, default=1000, help="concurrent requests per view and round")
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument("--json", type=Path, help="write the figures there")
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)  # the load client's: the server's port
    parser.add_argument("--server-pid", type=int, help=argparse.SUPPRESS)  # and its process
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.sequential, args.concurrent = 2, 200, 400

    if args.client:
        figures = asyncio.run(
            _drive(args.client, args.server_pid, args.rounds, args.sequential, args.concurrent, args.connections)
        )
        json.dump(figures, sys.stdout)
        return

    _clear_keys()
    port = _free_port()
    env = {**os.environ, "TB_ASGI_BENCH_SERVE": "1", "PYTHONPATH": str(ROOT)}
    server = subprocess.Popen(
        [
            sys.executable, "-m", "uvicorn", "benchmarks.probes.asgi_async:application",
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
            "--loop", "asyncio", "--http", "h11", "--no-access-log", "--log-level", "warning",
        ],
        cwd=ROOT,
        env=env,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("uvicorn did not start") from None
                time.sleep(0.1)
        client = subprocess.run(
            [sys.executable, __file__, "--client", str(port), "--server-pid", str(server.pid),
             "--rounds", str(args.rounds),
             "--sequential", str(args.sequential), "--concurrent", str(args.concurrent),
             "--connections", str(args.connections)],
            check=True, capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
    finally:
        server.terminate()
        server.wait(10)
        _clear_keys()
    figures = json.loads(client.stdout)
    report = _report(figures, args)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


def _rounded(value: float | None, digits: int | None = None) -> float | None:
    """``round(value, digits)``, or None for a baseline's overhead."""
    return None if value is None else round(value, digits)


def _report(figures: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    p50 = {path: statistics.median(times) * 1e3 for path, times in figures["latencies"].items()}
    cpu = {path: statistics.median(values) * 1e6 for path, values in figures["cpu"].items()}
    baseline_of = {path: baseline for path, (_, baseline) in VIEWS.items()}
    overhead_ms, extra_cpu_us = timing.overheads(p50, baseline_of), timing.overheads(cpu, baseline_of)
    rows = []
    print(
        f"uvicorn (1 worker, asyncio loop, h11), Redis {REDIS_HOST}:{REDIS_PORT}; {args.rounds} rounds of "
        f"{args.sequential} sequential and {args.concurrent} concurrent requests "
        f"({args.connections} connections) per view"
    )
    print(f"{'view':32} {'p50 ms':>8} {'p99 ms':>8} {'OVERHEAD ms':>12} {'req/s':>8} {'CPU µs/req':>11} {'+CPU µs':>8}")
    for path, (label, _) in VIEWS.items():
        times = figures["latencies"][path]
        row = {
            "view": label,
            "p50_ms": round(p50[path], 3),
            "p99_ms": round(timing.percentile(times, 0.99) * 1e3, 3),
            "overhead_ms": _rounded(overhead_ms[path], 3),
            "requests_per_s": round(statistics.median(figures["rates"][path])),
            "server_cpu_us_per_request": round(cpu[path]),
            "extra_cpu_us": _rounded(extra_cpu_us[path]),
        }
        rows.append(row)
        overhead = "" if row["overhead_ms"] is None else f"{row['overhead_ms']:.3f}"
        extra = "" if row["extra_cpu_us"] is None else str(row["extra_cpu_us"])
        print(
            f"{label:32} {row['p50_ms']:8.3f} {row['p99_ms']:8.3f} {overhead:>12} {row['requests_per_s']:8} "
            f"{row['server_cpu_us_per_request']:11} {extra:>8}"
        )
    return {"rounds": args.rounds, "sequential": args.sequential, "concurrent": args.concurrent, "rows": rows}


if __name__ == "__main__":
    main()
