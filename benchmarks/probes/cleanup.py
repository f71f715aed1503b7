"""How fast does cleanup delete idle rows, and does it slow live decisions? (RELIABILITY-PLAN S6)

Loads ``--rows`` rows (``--idle`` of them idle) into a throwaway database, measures the
decision latency of live traffic (a separate process calling ``limiter.limit`` in a
closed loop) without and then during a cleanup run, and reports the cleanup figures:

    TOKENBUCKET_TEST_DB=postgres .venv/bin/python benchmarks/probes/cleanup.py --rows 100000
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import time

from _setup import DB, bench_database, load_rows, summarise, table_size  # configures Django: first

# isort: split

from django.db import connections

from django_tokenbucket import limiter
from django_tokenbucket.cleanup import cleanup
from django_tokenbucket.models import RateLimit


def traffic(stop, out) -> None:  # type: ignore[no-untyped-def]
    """Decide on 1,000 live keys in a closed loop until told to stop; report latencies (ms)."""
    latencies = []
    i = 0
    while not stop.is_set():
        started = time.perf_counter()
        limiter.limit("login", ("live", i % 1000))
        latencies.append((time.perf_counter() - started) * 1000)
        i += 1
    connections.close_all()
    out.put(latencies)


def with_traffic(work):  # type: ignore[no-untyped-def]
    connections.close_all()
    context = multiprocessing.get_context("fork")
    stop, out = context.Event(), context.Queue()
    process = context.Process(target=traffic, args=(stop, out))
    process.start()
    time.sleep(0.5)  # let it connect and warm up
    result = work()
    stop.set()
    latencies = out.get(timeout=60)
    process.join(timeout=10)
    return result, latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--idle", type=float, default=0.9, help="share of the rows that are idle")
    parser.add_argument("--baseline-seconds", type=float, default=3.0)
    args = parser.parse_args()

    with bench_database():
        load_rows(args.rows, now=time.time_ns() // 1000, idle_share=args.idle)
        before_rows, before_mb = RateLimit.objects.count(), table_size()
        _, baseline = with_traffic(lambda: time.sleep(args.baseline_seconds))
        report, during = with_traffic(cleanup)
        print(
            json.dumps(
                {
                    "database": DB,
                    "rows_before": before_rows,
                    "rows_after": RateLimit.objects.count(),
                    "table_mb_before": before_mb,
                    "table_mb_after": table_size(),
                    "cleanup": report.as_dict() | {"unknown": report.unknown},
                    "decisions_baseline": summarise(baseline) | {"count": len(baseline)},
                    "decisions_during_cleanup": summarise(during) | {"count": len(during)},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
