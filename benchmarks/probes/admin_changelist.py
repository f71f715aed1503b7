"""How fast is the RateLimit changelist with many rows? (RELIABILITY-PLAN S7)

Times the admin pages on an empty table, with 100 rows (one page to render), then
with ``--rows`` rows, in one run on a throwaway database:

    TOKENBUCKET_TEST_DB=postgres .venv/bin/python benchmarks/probes/admin_changelist.py --rows 100000

Prints one JSON object: per page, median / p95 / max milliseconds of ``--repeat``
requests through Django's test client (a logged-in superuser): empty, 100 rows, loaded.
"""

from __future__ import annotations

import argparse
import json
import time

from _setup import DB, bench_database, load_rows, table_size  # configures Django: first

# isort: split

from django.contrib.auth.models import User
from django.test import Client

from benchmarks.probes.timing import summarise, timed

CHANGELIST = "/admin/django_tokenbucket/ratelimit/"
PAGES = {
    "changelist": "",
    "filter name": "?name=login",
    "filter limited now": "?state=limited",
    "filter full now": "?state=full",
    "name + limited": "?name=ten_per_minute&state=limited",
    "search key": "?q=12345",
    "page 50": "?p=50",
    "limits overview": "limits/",
}


def measure(client: Client, repeat: int) -> dict[str, dict[str, float]]:
    results = {}
    for label, query in PAGES.items():
        url = CHANGELIST + query

        def get(url: str = url) -> None:
            response = client.get(url)
            assert response.status_code in (200, 404), (url, response.status_code)

        results[label] = summarise(timed(get, repeat))
    return results


def explain(rows: int) -> None:
    """Print the plans of the default page and of the "limited now" filter's count."""
    from django_tokenbucket.backends.database import database_now as store_now
    from django_tokenbucket.backends.database.filters import state_q
    from django_tokenbucket.live import LIMITED
    from django_tokenbucket.models import RateLimit
    from django_tokenbucket.registry import known_limits

    options = {"analyze": True} if DB != "sqlite" else {}
    page = RateLimit.objects.order_by("name", "-ts", "-id")[:100]
    print(f"-- default page ({rows} rows)\n{page.explain(**options)}")
    limits = [known.config for known in known_limits().values()]
    limited = RateLimit.objects.filter(state_q(limits, LIMITED, store_now("default"))).values("pk")[:10_001]
    print(f"-- rows limited now (the paginator's capped count)\n{limited.explain(**options)}")
    from django.db.models import F, Value
    from django.db.models.functions import Coalesce

    page = RateLimit.objects.filter(state_q(limits, LIMITED, store_now("default"))).order_by(
        Coalesce(F("name"), Value("")).asc(), (F("ts") + 0).desc(), "-id"
    )
    print(f"-- rows limited now (the page)\n{page[:100].explain(**options)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--explain", action="store_true", help="print the plan of the default page's query")
    args = parser.parse_args()

    with bench_database():
        user = User.objects.create_superuser("bench", "bench@example.com", "bench")
        client = Client()
        client.force_login(user)
        empty = measure(client, args.repeat)
        # A page of rows costs the same to render whatever the table's size: 100 rows
        # separate that cost from the cost of the table's size.
        load_rows(100, now=time.time_ns() // 1000)
        small = measure(client, args.repeat)

        started = time.perf_counter()
        load_rows(args.rows - 100, now=time.time_ns() // 1000, first=100)
        load_seconds = time.perf_counter() - started
        loaded = measure(client, args.repeat)

        if args.explain:
            explain(args.rows)

        print(
            json.dumps(
                {
                    "database": DB,
                    "rows": args.rows,
                    "load_seconds": round(load_seconds, 1),
                    "table_mb": table_size(),
                    "repeat": args.repeat,
                    "pages": {
                        label: {"empty": empty[label], "100 rows": small[label], "loaded": loaded[label]}
                        for label in PAGES
                    },
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
