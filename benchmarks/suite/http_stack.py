#!/usr/bin/env python
"""Our DRF throttle and ``@ratelimit`` through Django's whole request handler, next to DRF's
throttle and django-ratelimit's decorator (issue 8: "HTTP overhead of our DRF throttle ≤
DRF's own throttle").

Every request goes through a ``WSGIHandler`` in this process (middleware, URL
resolution, the view, its throttle or decorator, rendering, ``request_finished``), with a
``RequestFactory`` environ: no server and no socket between client and Django, so the
figures are the stack's and not a server's. The views (benchmarks/suite/http_views.py):

    DRF APIView        no throttle (baseline)
                       + django_tokenbucket.throttling.UserRateThrottle, on Redis / on PostgreSQL
                       + rest_framework.throttling.UserRateThrottle, django-redis cache
    function view      no decorator (baseline)
                       + django_tokenbucket.decorators.ratelimit(key="ip"), on Redis / on PostgreSQL
                       + django_ratelimit's ratelimit(key="ip", block=True), django-redis cache

all with peers.py's limit, 100 per second with a burst of 100, on the same PostgreSQL and
Redis. ``TOKENBUCKET`` is process-wide, so the views of ours on Redis and those on
PostgreSQL each run in a worker process of their own configuration. Each also serves the
baselines, and the Redis one the peers (on Redis), which ``TOKENBUCKET`` does not touch.
The main process runs the rounds across them, one worker at a time in rotating order
(benchmarks/suite/harness.py). Phases:

1. sanity: on variants allowing 5 per hour, each limited view answers 200 five times,
   then 429; otherwise the run stops.
2. round trips per request, counted on the wire (libpq's trace, redis-py's sends).
3. p50/p99 latency per request and requests/s: clients rotating over ``--keys`` distinct
   users (DRF) and addresses (function views), so every request is allowed; then one hot
   client, emptied before each batch, so mostly denied (429) but for the refill.

OVERHEAD is a view's p50 minus its baseline's p50 (DRF or function view) in the same
rounds and mode, and in the same worker process, where our Redis views also meet their
peers. Two processes serve the same request at speeds of their own (their hash seeds,
where their memory lies): across processes, that difference would be counted as the
throttle's. The users come from an authentication class that makes no query, the
same for every DRF view, so that sessions are no part of any figure.

    make bench-http
    .venv-bench/bin/python benchmarks/suite/http_stack.py --json benchmarks/results/http.json
    .venv-bench/bin/python benchmarks/suite/http_stack.py --quick     # about 30 s

Not a test: it asserts nothing about speed. PostgreSQL: database
``tokenbucket_bench_http``, created and dropped here. Redis: database 14, keys under
``tbhttp`` only (see benchmarks/suite/http_settings.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.suite import harness, peers  # noqa: E402

# Importing peers points Django at its settings: ours are the same on other stores.
os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.suite.http_settings"

DRF, FUNCTION = "DRF view", "function view"
SETTINGS = "benchmarks.suite.http_settings"
FACTORY = "benchmarks.suite.http_stack:make_views"


def _start_response(status: str, headers: list[tuple[str, str]], exc_info: object = None) -> None:
    return None


_addresses: dict[str, str] = {}


def address(key: str) -> str:
    """The client address of ``key``: one IPv4 address per key, the same in every view."""
    found = _addresses.get(key)
    if found is None:
        i = len(_addresses) + 1
        found = _addresses[key] = f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"
    return found


class View(peers.Adapter):
    """One view behind peers.py's ``decide(key) -> allowed``, requested as client ``key``.

    ``decide`` returns True on 200 and False on 429, and stops the run on any other status:
    a 403 or a 500 would otherwise be timed as if it were a decision. A view of ours
    (``family == "ours"``) runs in the worker configured for our backend on ``store``.
    """

    def __init__(self, spec: str, name: str, group: str, family: str, store: str, algorithm: str, path: str) -> None:
        super().__init__(spec)
        from django.core.handlers.wsgi import WSGIHandler
        from django.test import RequestFactory

        from benchmarks.suite.http_views import USER_HEADER

        self.name, self.group, self.family, self.store, self.algorithm = name, group, family, store, algorithm
        self.path = path
        self.extra = {"group": group, "path": path}
        self.handler = WSGIHandler()
        self.environ = RequestFactory().get(path).environ
        self.user_header = USER_HEADER

    def decide(self, key: str) -> bool:
        """GET the view as client ``key`` through the whole handler; True if it answered 200."""
        environ = {**self.environ, "REMOTE_ADDR": address(key), self.user_header: key}
        response = self.handler(environ, _start_response)
        try:
            status = response.status_code
            b"".join(response)
        finally:
            response.close()  # request_finished, as a WSGI server would send it
        if status == 200:
            return True
        if status == 429:
            return False
        raise SystemExit(f"{self.name}: GET {self.path} as {key!r} answered {status}, not 200 or 429")


#: The worker configuration of each store's views of ours (peers_settings.BENCH_CONFIGS).
CONFIG_OF_STORE = {"redis": "redis", "postgresql": "db"}


def view_table(spec: str) -> list[tuple[str, str, str, str, str, str, str]]:
    """(name, group, family, store, algorithm, path, worker configuration) of every view, in order."""
    suffix = "-sanity" if spec == "sanity" else ""
    bucket, db = "token bucket", "postgresql"
    table = [  # group, what limits it, family, store, algorithm, path
        (DRF, "no throttle", "baseline", "-", "-", "/drf/plain/"),
        (DRF, "our throttle, redis", "ours", "redis", bucket, f"/drf/ours{suffix}/"),
        (DRF, "our throttle, db", "ours", db, bucket, f"/drf/ours{suffix}/"),
        (DRF, "DRF throttle", "peer", "redis", "sliding log", f"/drf/drf{suffix}/"),
        (FUNCTION, "no decorator", "baseline", "-", "-", "/fn/plain/"),
        (FUNCTION, "our @ratelimit, redis", "ours", "redis", bucket, f"/fn/ours{suffix}/"),
        (FUNCTION, "our @ratelimit, db", "ours", db, bucket, f"/fn/ours{suffix}/"),
        (FUNCTION, "django-ratelimit", "peer", "redis", "fixed window", f"/fn/peer{suffix}/"),
    ]
    rows = []
    for group, label, family, store, algorithm, path in table:
        if spec == "sanity" and family == "baseline":
            continue
        if family == "ours":
            rows.append((f"{group} + {label}", group, family, store, algorithm, path, CONFIG_OF_STORE[store]))
            continue
        if family == "peer":
            # Beside ours on the same store, in that worker (TOKENBUCKET does not touch it):
            # once, since two copies would share their keys in Redis.
            rows.append((f"{group} + {label}", group, family, store, algorithm, path, CONFIG_OF_STORE[store]))
            continue
        # A baseline in each worker, so that every overhead is taken within one process.
        for config in CONFIG_OF_STORE.values():
            rows.append((f"{group}, {label} ({config} worker)", group, family, store, algorithm, path, config))
    return rows


def make_views(spec: str, config: str) -> dict[str, View]:
    """The views a worker of ``config`` serves: timed (``bench``) or their 5-per-hour variants (``sanity``)."""
    return {
        name: View(spec, name, group, family, store, algorithm, path)
        for name, group, family, store, algorithm, path, view_config in view_table(spec)
        if view_config == config
    }


# --------------------------------------------------------------------------- report


def overheads(views: dict[str, dict[str, Any]], single: dict[str, dict[str, dict[str, float]]]) -> None:
    """Add ``overhead_us`` to every figure: its p50 minus its baseline's p50, same mode,
    rounds and worker process."""
    for figures in single.values():
        baselines = {
            (views[name]["group"], views[name]["config"]): fig["p50_us"]
            for name, fig in figures.items()
            if views[name]["family"] == "baseline"
        }
        for name, fig in figures.items():
            fig["overhead_us"] = round(fig["p50_us"] - baselines[views[name]["group"], views[name]["config"]], 1)


def comparisons(
    views: dict[str, dict[str, Any]], single: dict[str, dict[str, dict[str, float]]]
) -> list[dict[str, Any]]:
    """Each of ours against its peer: the ratio of their overheads, per mode."""
    rows = []
    for group in (DRF, FUNCTION):
        for name in (name for name, view in views.items() if view["group"] == group and view["family"] == "ours"):
            (peer,) = (
                other for other, view in views.items() if view["group"] == group and view["family"] == "peer"
            )
            row: dict[str, Any] = {"ours": name, "peer": peer}
            for mode, figures in single.items():
                ours_us, peer_us = figures[name]["overhead_us"], figures[peer]["overhead_us"]
                # An overhead at or below zero is noise: no ratio can be taken from it.
                row[mode] = round(ours_us / peer_us, 2) if ours_us > 0 and peer_us > 0 else None
            rows.append(row)
    return rows


def targets(views: dict[str, dict[str, Any]], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 19's target for the HTTP stack: our DRF throttle's overhead ≤ DRF's own, allowed and hot.

    The same store on both sides: our Redis backend, and DRF's throttle on the django-redis cache.
    """
    out = []
    for row in rows:
        if views[row["ours"]]["group"] == DRF and views[row["ours"]]["store"] == "redis":
            for mode, label in (("fresh", "allowed"), ("hot", "hot key")):
                out.append(
                    {
                        "group": "HTTP",
                        "target": f"{label}: our DRF throttle's overhead ≤ DRF's own (Redis)",
                        "value": row[mode],
                        "limit": 1.0,
                        "better": "lower",
                    }
                )
    return peers.judge(out)


def _cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def markdown_table(header: Iterable[str], rows: Iterable[Iterable[str]], right_from: int = 1) -> str:
    """A markdown table, its columns from ``right_from`` on aligned right."""
    header = list(header)
    align = ["---" if i < right_from else "--:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def print_report(result: dict[str, Any]) -> None:
    """Print the per-view table and the overhead ratios as markdown."""
    m, s = result["machine"], result["settings"]
    print(
        f"\n{m['date']} — {m['cpus']} cores, Python {m['python']}, Django {m['django']}, "
        f"DRF {m['packages']['djangorestframework']}, django-ratelimit {m['packages']['django-ratelimit']}, "
        f"PostgreSQL {m['postgresql']}, Redis {m['redis']}"
    )
    print(
        f"Every request through WSGIHandler in-process; limit {s['limit']}; {s['rounds']} rounds × "
        f"{s['seconds']} s per view and mode. Allowed: clients rotating over {s['keys']:,} distinct "
        f"users / addresses. Hot: one client. Overhead: p50 − the baseline's p50, same rounds "
        f"and worker process.\n"
    )
    single, trips = result["single"], result["round_trips"]
    rows = []
    for name, view in result["views"].items():
        d, h, rt = single["fresh"][name], single["hot"][name], trips[name]
        base = view["family"] == "baseline"
        rows.append(
            [
                name,
                view["store"],
                f"{rt['sql']:.0f} + {rt['redis']:.0f}",
                _cell(d["p50_us"]),
                _cell(d["p99_us"]),
                _cell(d["per_second"]),
                "—" if base else _cell(d["overhead_us"]),
                f"{100 * d['allowed_share']:.0f} %",
                _cell(h["p50_us"]),
                _cell(h["p99_us"]),
                _cell(h["per_second"]),
                "—" if base else _cell(h["overhead_us"]),
                f"{100 * h['allowed_share']:.0f} %",
            ]
        )
    header = [
        "view",
        "store",
        "round trips (SQL + Redis)",
        "p50 µs",
        "p99 µs",
        "requests/s",
        "overhead µs",
        "allowed",
        "hot p50 µs",
        "hot p99 µs",
        "hot requests/s",
        "hot overhead µs",
        "hot allowed",
    ]
    print(markdown_table(header, rows, right_from=2))
    print()
    ratio_rows = []
    for row in result["comparisons"]:
        ratio_rows.append([row["ours"], row["peer"], _cell(row["fresh"], 2), _cell(row["hot"], 2)])
    header = ["ours", "against", "overhead ratio (ours / theirs)", "hot overhead ratio"]
    print(markdown_table(header, ratio_rows, right_from=2))
    peers.print_targets(result["targets"])


# --------------------------------------------------------------------------- main


def main() -> None:
    """Run the phases and print the report (``--help`` for the knobs)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds: about 30 s")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 10; quick 4)")
    parser.add_argument("--seconds", type=float, help="seconds per view, mode and round (default 0.3; quick 0.2)")
    parser.add_argument("--keys", type=int, help="distinct clients of the allowed mode (default 1000; quick 300)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--run-id", help="an identifier of the run, recorded in the JSON (make bench gives one)")
    args = parser.parse_args()
    rounds = args.rounds or (4 if args.quick else 10)
    seconds = args.seconds or (0.2 if args.quick else 0.3)
    keys = args.keys or (300 if args.quick else 1000)

    # The workers and the coordinator read these settings, each with its own configuration.
    os.environ["DJANGO_SETTINGS_MODULE"] = SETTINGS
    peers.setup_django()
    from benchmarks.suite.stores import bench_stores, machine

    started = time.perf_counter()
    # Other work on the machine shows in every figure: the load is recorded with them.
    load_before = os.getloadavg()
    table = view_table("bench")
    configs = list(dict.fromkeys(row[-1] for row in table))
    with bench_stores():
        print(f"starting {len(configs)} worker processes ({', '.join(configs)}) ...", flush=True)
        with harness.workers(SETTINGS, configs, FACTORY) as workers:
            described: dict[str, dict[str, Any]] = {}
            for worker in workers.values():
                described |= worker.call("describe", "bench")
            views = {row[0]: described[row[0]] for row in table}
            where = {name: workers[meta["config"]] for name, meta in views.items()}
            print("sanity: 5 per hour allows 5 requests, then 429 ...", flush=True)
            failures = [f for worker in workers.values() for f in worker.call("sanity", "sanity")]
            if failures:
                raise SystemExit(
                    "sanity check failed (5 per hour must allow exactly 5 requests):\n  " + "\n  ".join(failures)
                )
            print("round trips per request ...", flush=True)
            trips: dict[str, Any] = {}
            for worker in workers.values():
                trips |= worker.call("round_trips", "bench")
            for name, worker in where.items():  # rows, keys and connections exist: the steady state
                worker.call("warm", "bench", name, "fresh", keys, keys)
            print(f"{rounds} rounds × {len(views)} views × 2 modes × {seconds} s ...", flush=True)
            single = harness.interleaved(where, "bench", rounds, seconds, {"fresh": keys, "hot": 0})
        overheads(views, single)
        compared = comparisons(views, single)
        result: dict[str, Any] = {
            "kind": "http",
            "run_id": args.run_id,
            "machine": machine(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "settings": {
                "limit": "100 per second, burst 100",
                "quick": bool(args.quick),
                "rounds": rounds,
                "seconds": seconds,
                "keys": keys,
                "handler": "django.core.handlers.wsgi.WSGIHandler, in-process, RequestFactory environ",
            },
            "views": views,
            "round_trips": trips,
            "single": single,
            "comparisons": compared,
            "targets": targets(views, compared),
        }
    peers.finish(result, print_report, started, load_before, args.json)


if __name__ == "__main__":
    main()
