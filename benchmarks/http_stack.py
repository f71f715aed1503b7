#!/usr/bin/env python
"""Our DRF throttle and ``@ratelimit`` through Django's whole request handler, next to DRF's
throttle and django-ratelimit's decorator (issue 8: "HTTP overhead of our DRF throttle ≤
DRF's own throttle").

Every request goes through a ``WSGIHandler`` in this process (middleware, URL
resolution, the view, its throttle or decorator, rendering, ``request_finished``), with a
``RequestFactory`` environ: no server and no socket between client and Django, so the
figures are the stack's and not a server's. The views (benchmarks/http_views.py):

    DRF APIView        no throttle (baseline)
                       + django_tokenbucket.throttling.UserRateThrottle, on Redis / on PostgreSQL
                       + rest_framework.throttling.UserRateThrottle, django-redis cache
    function view      no decorator (baseline)
                       + django_tokenbucket.decorators.ratelimit(key="ip"), on Redis / on PostgreSQL
                       + django_ratelimit's ratelimit(key="ip", block=True), django-redis cache

all with peers.py's limit, 100 per second with a burst of 100, on the same PostgreSQL and
Redis. Phases (views interleaved in rounds that rotate their order, as in peers.py):

1. sanity: on variants allowing 5 per hour, each limited view answers 200 five times,
   then 429; otherwise the run stops.
2. round trips per request, counted on the wire (libpq's trace, redis-py's sends).
3. p50/p99 latency per request and requests/s: clients rotating over ``--keys`` distinct
   users (DRF) and addresses (function views), so every request is allowed; then one hot
   client, denied (429) after its first 100 requests but for the refill.

OVERHEAD is a view's p50 minus its baseline's p50 (DRF or function view) in the same
rounds and mode. The users come from an authentication class that makes no query, the
same for every DRF view, so that sessions are no part of any figure.

    make bench-http
    .venv-bench/bin/python benchmarks/http_stack.py --json benchmarks/results/http.json
    .venv-bench/bin/python benchmarks/http_stack.py --quick     # about 20 s

Not a test: it asserts nothing about speed. PostgreSQL: database
``tokenbucket_bench_http``, created and dropped here. Redis: database 14, keys under
``tbhttp`` only (see benchmarks/http_settings.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import peers  # noqa: E402

# Importing peers points Django at its settings: ours are the same on other stores.
os.environ["DJANGO_SETTINGS_MODULE"] = "benchmarks.http_settings"

DRF, FUNCTION = "DRF view", "function view"


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
    (``family == "ours"``) runs on our backend for ``store``.
    """

    def __init__(self, spec: str, name: str, group: str, family: str, store: str, algorithm: str, path: str) -> None:
        super().__init__(spec)
        from django.core.handlers.wsgi import WSGIHandler
        from django.test import RequestFactory

        from benchmarks.http_views import USER_HEADER
        from django_tokenbucket import backends

        self.name, self.group, self.family, self.store, self.algorithm = name, group, family, store, algorithm
        self.path = path
        self.handler = WSGIHandler()
        self.environ = RequestFactory().get(path).environ
        self.user_header = USER_HEADER
        self.backends = backends
        self.backend = make_backend(store) if family == "ours" else None

    def decide(self, key: str) -> bool:
        """GET the view as client ``key`` through the whole handler; True if it answered 200."""
        if self.backend is not None:
            # Both of our backends serve views in this one process: put this view's in
            # place, as peers.py's adapters do (a module attribute; overriding TOKENBUCKET
            # per batch would re-create the backend instead).
            self.backends._backends["default"] = self.backend
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


def make_backend(store: str) -> Any:
    """Our backend for ``store`` (``redis`` or ``postgresql``), as ``TOKENBUCKET`` would configure it."""
    from django.utils.module_loading import import_string

    path, options = {
        "redis": ("django_tokenbucket.backends.redis.RedisBackend", {"CACHE": "default"}),
        "postgresql": ("django_tokenbucket.backends.database.DatabaseBackend", {}),
    }[store]
    return import_string(path)(options)


def make_views(sanity: bool = False) -> dict[str, View]:
    """The views of the timed phases, or with ``sanity`` their 5-per-hour variants (no baselines)."""
    spec, suffix = ("sanity", "-sanity") if sanity else ("bench", "")
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
    views = {}
    for group, label, family, store, algorithm, path in table:
        if sanity and family == "baseline":
            continue
        name = f"{group}, {label}" if family == "baseline" else f"{group} + {label}"
        views[name] = View(spec, name, group, family, store, algorithm, path)
    return views


# --------------------------------------------------------------------------- report


def overheads(views: dict[str, View], single: dict[str, dict[str, dict[str, float]]]) -> None:
    """Add ``overhead_us`` to every figure: its p50 minus its baseline's p50, same mode and rounds."""
    for figures in single.values():
        baselines = {
            views[name].group: fig["p50_us"] for name, fig in figures.items() if views[name].family == "baseline"
        }
        for name, fig in figures.items():
            fig["overhead_us"] = round(fig["p50_us"] - baselines[views[name].group], 1)


def comparisons(views: dict[str, View], single: dict[str, dict[str, dict[str, float]]]) -> list[dict[str, Any]]:
    """Each of ours against its peer: the ratio of their overheads, per mode."""
    rows = []
    for group in (DRF, FUNCTION):
        (peer,) = (name for name, view in views.items() if view.group == group and view.family == "peer")
        for name in (name for name, view in views.items() if view.group == group and view.family == "ours"):
            row: dict[str, Any] = {"ours": name, "peer": peer}
            for mode, figures in single.items():
                ours_us, peer_us = figures[name]["overhead_us"], figures[peer]["overhead_us"]
                # An overhead at or below zero is noise: no ratio can be taken from it.
                row[mode] = round(ours_us / peer_us, 2) if ours_us > 0 and peer_us > 0 else None
            # The target is for the same store: our Redis backend and DRF's cache.
            if group == DRF and views[name].store == "redis":
                row["target"] = "HTTP overhead of our DRF throttle ≤ DRF's own throttle"
                row["met"] = None if row["distinct"] is None else row["distinct"] <= 1.0
            rows.append(row)
    return rows


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
        f"users / addresses. Hot: one client. Overhead: p50 − the baseline's p50, same rounds.\n"
    )
    single, trips = result["single"], result["round_trips"]
    rows = []
    for name, view in result["views"].items():
        d, h, rt = single["distinct"][name], single["hot"][name], trips[name]
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
        met = {True: "met", False: "**missed**", None: "n/a"}[row["met"]] if "met" in row else ""
        ratio_rows.append([row["ours"], row["peer"], _cell(row["distinct"], 2), _cell(row["hot"], 2), met])
    header = ["ours", "against", "overhead ratio (ours / theirs)", "hot overhead ratio", "issue 8: ≤ 1 (allowed)"]
    print(markdown_table(header, ratio_rows, right_from=2))


# --------------------------------------------------------------------------- main


def main() -> None:
    """Run the phases and print the report (``--help`` for the knobs)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter rounds: about 20 s")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default 6; quick 3)")
    parser.add_argument("--seconds", type=float, help="seconds per view, mode and round (default 0.6; quick 0.3)")
    parser.add_argument("--keys", type=int, help="distinct clients of the allowed mode (default 1000; quick 300)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args()
    rounds = args.rounds or (3 if args.quick else 6)
    seconds = args.seconds or (0.3 if args.quick else 0.6)
    keys = args.keys or (300 if args.quick else 1000)

    peers.setup_django()
    started = time.perf_counter()
    # Other work on the machine shows in every figure: the load is recorded with them.
    load_before = os.getloadavg()
    with peers.bench_stores():
        print("sanity: 5 per hour allows 5 requests, then 429 ...", flush=True)
        peers.sanity(make_views(sanity=True))
        views = make_views()
        print("round trips per request ...", flush=True)
        trips = peers.round_trips(views)
        print(f"{rounds} rounds × {len(views)} views × 2 modes × {seconds} s ...", flush=True)
        single = peers.single_process(views, rounds, seconds, distinct=keys)
        overheads(views, single)
        result: dict[str, Any] = {
            "machine": peers.machine(),
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "settings": {
                "limit": "100 per second, burst 100",
                "rounds": rounds,
                "seconds": seconds,
                "keys": keys,
                "handler": "django.core.handlers.wsgi.WSGIHandler, in-process, RequestFactory environ",
            },
            "views": {
                name: {"group": v.group, "family": v.family, "store": v.store, "path": v.path}
                for name, v in views.items()
            },
            "round_trips": trips,
            "single": single,
            "comparisons": comparisons(views, single),
        }
    peers.finish(result, print_report, started, load_before, args.json)


if __name__ == "__main__":
    main()
