"""How fast does cleanup delete idle rows, and does it slow live decisions? (RELIABILITY-PLAN S6)

Loads ``--rows`` rows (``--idle`` of them idle) into a throwaway database, measures the
decision latency of live traffic (a separate process calling ``limiter.limit`` in a
closed loop) without and then during a cleanup run, and reports the cleanup figures:

    TOKENBUCKET_TEST_DB=postgres .venv/bin/python benchmarks/probes/cleanup.py --rows 100000
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import TypeVar

from _setup import DB, bench_database, load_rows, table_size  # configures Django: first

# isort: split

from django.db import connections

from benchmarks.probes import timing
from django_tokenbucket import limiter
from django_tokenbucket.cleanup import cleanup
from django_tokenbucket.models import RateLimit

W = TypeVar("W")


def traffic(stop: timing.Flag) -> list[float]:
    """Decide on 1,000 live keys in a closed loop until told to stop; the latencies (s)."""
    latencies = timing.latencies_until(stop, lambda i: limiter.limit("login", ("live", i % 1000)))
    connections.close_all()
    return latencies


def with_traffic(work: Callable[[], W]) -> tuple[W, list[float]]:
    """``work()``, with live traffic deciding in a process of its own meanwhile."""
    connections.close_all()  # the traffic's process must not share this one's connection
    return timing.alongside(traffic, work)


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
                    "decisions_baseline": timing.summarise(baseline) | {"count": len(baseline)},
                    "decisions_during_cleanup": timing.summarise(during) | {"count": len(during)},
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
