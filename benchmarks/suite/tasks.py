"""``make bench-tasks``: one global rate for Celery tasks, against Celery's own ``rate_limit``.

4 prefork workers (concurrency 2) on a real Redis broker and a real database run, in one
run and in alternating rounds:

- ``RateLimitedTask``: 200 tasks under one global 10/s limit (capacity 10), then a plain
  task queued behind them. Reported: the most runs ever started beyond capacity + rate x
  elapsed (0 holds the limit), the time the last run started against the ideal
  ((200 - capacity) / rate), runs lost or duplicated, and how long the plain task waited.
- Celery's ``rate_limit="10/s"`` on the same workers and 200 tasks: how far over the
  global rate it goes (Celery counts per worker).

Uses the tests' Celery app and workers (``tests/celery_*.py``) on a database of its own,
created and dropped here. ``--docs docs/benchmarks.md`` rewrites the region between
``<!-- bench-tasks:begin -->`` and ``<!-- bench-tasks:end -->`` there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENBUCKET_TEST_DB", "postgres")
os.environ["DJANGO_SETTINGS_MODULE"] = "tests.settings"
# The workers reuse their database connections, as docs/celery.md advises (inherited by
# the worker processes; both sides of the comparison run on the same workers).
os.environ.setdefault("TOKENBUCKET_CELERY_DB_REUSE_MAX", "1000")

import django  # noqa: E402

django.setup()

from django.db import connection  # noqa: E402

from benchmarks.suite.report import save  # noqa: E402
from django_tokenbucket.models import Reservation  # noqa: E402
from tests.celery_tasks import RUNS, TABLES, TASKS_LIMIT, limited_effect, native_limited, plain_effect  # noqa: E402
from tests.celery_workers import CeleryProcess, purge_broker  # noqa: E402
from tests.settings import TOKENBUCKET  # noqa: E402

BEGIN, END = "<!-- bench-tasks:begin -->", "<!-- bench-tasks:end -->"
RATE, CAPACITY = 10, 10
#: The rate Celery's own rate_limit is given (tests.native_limited): the same 10/s.
NATIVE_RATE = 10


def _runs() -> list[tuple[str, float, str]]:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT tag, started, held FROM {RUNS}")
        return list(cursor.fetchall())


def _clear() -> None:
    with connection.cursor() as cursor:
        cursor.execute(f"DELETE FROM {RUNS}")
        cursor.execute("DELETE FROM django_tokenbucket_reservation")
        cursor.execute("DELETE FROM django_tokenbucket_ratelimit")


def _wait(count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(_runs()) < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out after {timeout} s: {len(_runs())} of {count} runs")
        time.sleep(0.1)
    time.sleep(1.0)  # room for a duplicate to show up


def _over_bound(starts: list[float], since: float) -> float:
    """The most runs started beyond capacity + rate x elapsed, at any instant."""
    return max((i - (CAPACITY + RATE * (t - since)) for i, t in enumerate(sorted(starts), 1)), default=0.0)


def _peak_per_second(starts: list[float]) -> int:
    ordered = sorted(starts)
    peak, low = 0, 0
    for high, t in enumerate(ordered):
        while ordered[low] < t - 1.0:
            low += 1
        peak = max(peak, high - low + 1)
    return peak


def ours(tasks: int) -> dict[str, Any]:
    _clear()
    published = time.time()
    for i in range(tasks):
        limited_effect.delay(f"t{i}")
    queued = time.time()
    plain_effect.delay("plain")
    _wait(tasks + 1, timeout=tasks / RATE + 60)
    rows = _runs()
    limited = [row for row in rows if row[2] != "plain"]
    starts = [row[1] for row in limited]
    tags = [row[0] for row in limited]
    ideal = (tasks - CAPACITY) / RATE
    span = max(starts) - published
    plain = next(row[1] for row in rows if row[2] == "plain")
    last_deferral = max(r.created_at for r in Reservation.objects.all()).timestamp()
    deferred = sum(1 for row in limited if row[2] == "Reservation")
    return {
        "tasks": tasks,
        "ran": len(tags),
        "lost": tasks - len(set(tags)),
        "duplicated": len(tags) - len(set(tags)),
        "deferred": deferred,
        "over_bound": round(max(0.0, _over_bound(starts, published)), 2),
        "peak_per_s": _peak_per_second(starts),
        "ideal_s": ideal,
        "span_s": round(span, 3),
        "span_over_ideal": round(span / ideal, 4),
        "plain_wait_s": round(plain - queued, 3),
        "plain_after_last_deferral_s": round(plain - last_deferral, 3),
        "deferrals_per_s": round(deferred / (last_deferral - published), 1),
    }


def celerys_own(tasks: int) -> dict[str, Any]:
    _clear()
    published = time.time()
    for i in range(tasks):
        native_limited.delay(f"n{i}")
    _wait(tasks, timeout=tasks / NATIVE_RATE + 60)
    starts = [row[1] for row in _runs()]
    span = max(starts) - published
    return {
        "tasks": tasks,
        "ran": len(starts),
        "over_bound": round(max(0.0, _over_bound(starts, published)), 2),
        "peak_per_s": _peak_per_second(starts),
        "span_s": round(span, 3),
        "rate_per_s": round(len(starts) / span, 1),
        "times_the_global_rate": round(len(starts) / span / RATE, 2),
    }


def markdown(result: dict[str, Any]) -> str:
    lines = [
        "<!-- Generated by benchmarks/suite/tasks.py (make bench-tasks): edit the script, not this section. -->",
        "",
        f"Run {result['run']} ({result['database']}, Redis broker, {result['workers']} prefork workers of "
        f"concurrency 2 on {os.cpu_count()} cores; {result['tasks']} tasks a round, {len(result['ours'])} rounds "
        f"of each, alternating; limit {RATE}/s, capacity {CAPACITY}).",
        "",
        "| round | runs started beyond capacity + rate × t (max) | peak runs in 1 s | last run started at "
        "| against the ideal | lost / duplicated | plain task queued behind: waited (after the last deferral) "
        "| deferrals/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(result["ours"], 1):
        lines.append(
            f"| `RateLimitedTask` {i} | {r['over_bound']:g} | {r['peak_per_s']} | {r['span_s']:.2f} s "
            f"(ideal {r['ideal_s']:g} s) | {r['span_over_ideal']:.3f}× | {r['lost']} / {r['duplicated']} "
            f"| {r['plain_wait_s']:.2f} s ({r['plain_after_last_deferral_s']:+.2f} s) | {r['deferrals_per_s']:g} |"
        )
    for i, r in enumerate(result["celery"], 1):
        lines.append(
            f"| Celery `rate_limit=\"{NATIVE_RATE}/s\"` {i} | {r['over_bound']:g} | {r['peak_per_s']} "
            f"| {r['span_s']:.2f} s | {r['times_the_global_rate']:.2f}× the global rate | – | – | – |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each, alternating (default 2)")
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--docs", type=Path, help="rewrite the bench-tasks region of this page")
    args = parser.parse_args()

    limit = {"rate": RATE, "period": 1, "capacity": CAPACITY, "max_reserved": 10 * args.tasks}
    limits = {**TOKENBUCKET["LIMITS"], TASKS_LIMIT: limit}
    database = connection.creation.create_test_db(verbosity=0, autoclobber=True, serialize=False)
    workers: list[CeleryProcess] = []
    try:
        with connection.cursor() as cursor:
            for table, columns in TABLES.items():
                cursor.execute(f"CREATE TABLE {table} ({columns})")
        purge_broker()
        directory = Path(tempfile.mkdtemp(prefix="bench-tasks-"))
        workers = [
            CeleryProcess(directory, concurrency=2, tokenbucket={"LIMITS": limits}, wait=False)
            for _ in range(args.workers)
        ]
        for worker in workers:
            worker.wait_until_ready()
        result: dict[str, Any] = {
            "run": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC"),
            "database": connection.vendor,
            "workers": args.workers,
            "tasks": args.tasks,
            "ours": [],
            "celery": [],
        }
        for i in range(args.rounds):
            # Alternating, so that both see the same machine over the run.
            phases = [("ours", ours), ("celery", celerys_own)]
            for name, phase in phases if i % 2 == 0 else reversed(phases):
                figures = phase(args.tasks)
                print(name, json.dumps(figures), flush=True)
                result[name].append(figures)
    finally:
        for worker in workers:
            worker.stop()
        purge_broker()
        connection.creation.destroy_test_db(database, verbosity=0)
    print(markdown(result))
    save(result, markdown(result), args.json, args.docs, BEGIN, END)


if __name__ == "__main__":
    main()
