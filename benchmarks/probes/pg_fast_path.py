"""The PostgreSQL fast path against its floors, interleaved in one run.

    TOKENBUCKET_TEST_DB=postgres python benchmarks/probes/pg_fast_path.py [--rounds 7] [--calls 300]
        [--database tb_pg_fast_path] [--option PREPARE=False] [--port 6432] [--turns call]

Each round times ``--calls`` calls of each of these, one after the other (``--turns
call``: taking turns call by call, so that a burst of other work on a shared machine
lands on all of them alike; every figure is then higher, SELECT 1's most): Django's
``SELECT 1``, a raw durable one-row ``UPDATE`` through a Django cursor in autocommit (the
floor for a decision that writes), ``limiter.limit()`` on fresh keys (each an admission,
a write), ``limiter.limit()`` on one hot key (after its first 10, denials, which write
nothing: they read first, the key being recently denied), and the same on another hot
key with the backend's memory of it cleared before each call (so each
denial calls the single-decision function: the path before reading first).
It prints each round's p50s and the median over rounds of the ratios that issue 19
targets: hot key <= 1.5x SELECT 1, fresh keys <= 1.3x the UPDATE. Ratios of one run,
not absolute figures: the machine may be shared. The database (created and dropped
around the run) is ``--database``'s test database; ``--port`` reaches the server
through something else on 127.0.0.1 (a PgBouncer, say).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
os.environ.setdefault("TOKENBUCKET_TEST_DB", "postgres")

from benchmarks.probes import timing  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--database", default="tb_pg_fast_path")
    parser.add_argument("--port", default=None)
    parser.add_argument("--turns", choices=["block", "call"], default="block")
    parser.add_argument("--option", action="append", default=[], help="a database backend OPTION, NAME=python-literal")
    args = parser.parse_args()

    import ast

    import django

    django.setup()
    from django.conf import settings
    from django.db import connection, connections
    from django.test.utils import override_settings, setup_databases, setup_test_environment, teardown_databases

    from django_tokenbucket import limiter

    if settings.DB != "postgres":
        sys.exit("TOKENBUCKET_TEST_DB must be postgres")
    settings.DATABASES["default"].setdefault("TEST", {})["NAME"] = args.database
    options = {name: ast.literal_eval(value) for name, value in (option.split("=", 1) for option in args.option)}
    setup_test_environment()
    old = setup_databases(verbosity=0, interactive=False, aliases={"default"}, serialized_aliases=set())
    direct_port = connection.settings_dict["PORT"]
    try:
        if args.port:
            connections.close_all()
            connection.settings_dict["PORT"] = args.port
        with connection.cursor() as cursor:
            cursor.execute("CREATE TABLE IF NOT EXISTS bench_row (id int PRIMARY KEY, n bigint NOT NULL)")
            cursor.execute("INSERT INTO bench_row VALUES (1, 0) ON CONFLICT DO NOTHING")
        tokenbucket = {**settings.TOKENBUCKET, "OPTIONS": {**settings.TOKENBUCKET.get("OPTIONS", {}), **options}}
        with override_settings(TOKENBUCKET=tokenbucket):
            run(args.rounds, args.calls, limiter, connection, by_call=args.turns == "call")
    finally:
        connections.close_all()
        if args.port:
            # The pooler keeps its server connections open: end them, or the test
            # database cannot be dropped.
            connection.settings_dict["PORT"] = direct_port
            with connection.cursor() as cursor:
                cursor.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            connections.close_all()
        teardown_databases(old, verbosity=0)


def run(rounds: int, calls: int, limiter: object, connection: object, *, by_call: bool) -> None:
    from django_tokenbucket.backends import get_backend
    from django_tokenbucket.keys import encode_key

    recent = get_backend()._recent_denials  # type: ignore[attr-defined]
    function_key = encode_key("hot-function").digest

    def select_1(i: int) -> None:
        with connection.cursor() as cursor:  # type: ignore[attr-defined]
            cursor.execute("SELECT 1")
            cursor.fetchone()

    def update(i: int) -> None:
        with connection.cursor() as cursor:  # type: ignore[attr-defined]
            cursor.execute("UPDATE bench_row SET n = n + 1 WHERE id = 1")

    config = {"rate": 10, "period": 60}

    def fresh(i: int) -> None:
        assert limiter.limit("bench", f"fresh-{i}", config=config).ok  # type: ignore[attr-defined]

    def hot(i: int) -> None:
        limiter.limit("bench", "hot", config=config)  # type: ignore[attr-defined]

    def hot_function(i: int) -> None:
        recent.forget("default", "bench", function_key)
        limiter.limit("bench", "hot-function", config=config)  # type: ignore[attr-defined]

    kinds = {"SELECT 1": select_1, "UPDATE": update, "fresh": fresh, "hot": hot, "hot (fn)": hot_function}
    # Arguments of their own: the fresh keys of the warm-up are none of the rounds'.
    timing.warm_up(kinds.values(), [(10**9 + i,) for i in range(50)])
    # Each ratio's figure and its floor, both from the same round.
    compared = {
        "hot / SELECT 1": ("hot", "SELECT 1"),
        "hot (fn) / SELECT 1": ("hot (fn)", "SELECT 1"),
        "fresh / UPDATE": ("fresh", "UPDATE"),
    }
    ratios: dict[str, list[float]] = {name: [] for name in compared}
    print("round  " + "  ".join(f"{name:>9}" for name in kinds) + "   (p50, µs)")
    for number in range(rounds):
        times = timing.take_turns(kinds, range(number * calls, (number + 1) * calls), by_call=by_call)
        figures = {name: statistics.median(values) * 1e6 for name, values in times.items()}
        print(f"{number:5}  " + "  ".join(f"{figures[name]:9.0f}" for name in kinds))
        for name, (figure, floor) in compared.items():
            ratios[name].append(timing.ratio(figures[figure], figures[floor]))
    for name, values in ratios.items():
        print(f"{name}: median {statistics.median(values):.2f}x (rounds: {', '.join(f'{v:.2f}' for v in values)})")


if __name__ == "__main__":
    main()
