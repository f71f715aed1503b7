"""What does a process' first decision cost after an override changed, with many in force? (issue 47)

With N overrides in force (blocks of addresses, as a ``rate_limit_denied`` receiver
that keeps a penalty box writes them), one change is made by another process, and a
process that held all N makes its next decision: before the incremental refresh it read
the whole table again, now only the rows changed since its snapshot. Measured for each
N of ``--sizes`` on the code of ``--before`` (a git ref, main by default: exported to a
temporary directory) and on this tree, in one run, each in a process of its own on a
throwaway database of its own:

    TOKENBUCKET_TEST_DB=postgres .venv/bin/python benchmarks/probes/overrides_refresh.py
    TOKENBUCKET_TEST_DB=postgres .venv/bin/python benchmarks/probes/overrides_refresh.py --sizes 1000,20000

For each code and N, in a reader process of its own: the CPU time (``process_time``: the
reader's own, the database server's is not in it) and the wall time of

- ``first``: a decision that reads every override, as a process' first one does (the
  cost that remains; median of ``--repeat``);
- ``after_change``: the first decision after another process blocked one more key
  (median of ``--repeat`` changes);
- ``after_clear``: the same after another process cleared that override;
- ``steady``: a decision with nothing changed (median of 20), for scale;

and the memory that snapshot of N takes (``tracemalloc``, in a read of its own). Prints
one JSON object and a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="1000,20000,100000", help="overrides in force, comma separated")
    parser.add_argument("--before", default="main", help="the git ref of the code before (default: main)")
    parser.add_argument("--repeat", type=int, default=3, help="changes measured per size (the median is shown)")
    parser.add_argument("--json", help="also write the figures to this file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # the code's directory, in a worker
    parser.add_argument("--label", help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    if args.worker:
        print(json.dumps(worker(Path(args.worker), args.label, sizes, args.repeat)))
        return
    results = {"database": os.environ.get("TOKENBUCKET_TEST_DB", "sqlite"), "sizes": sizes, "codes": {}}
    with tempfile.TemporaryDirectory(prefix="overrides-refresh-") as exported:
        archive = subprocess.run(
            ["git", "-C", str(ROOT), "archive", args.before, "django_tokenbucket"], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", exported], input=archive, check=True)
        commit = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", args.before], check=True, capture_output=True, text=True
        ).stdout.strip()
        before = f"before ({commit})" if commit.startswith(args.before[:7]) else f"before ({args.before} {commit})"
        for label, code in ((before, Path(exported)), ("after (this tree)", ROOT)):
            command = [sys.executable, __file__, "--worker", str(code), "--label", label, "--sizes", args.sizes]
            done = subprocess.run(
                [*command, "--repeat", str(args.repeat)], check=True, stdout=subprocess.PIPE, text=True
            )
            results["codes"][label] = json.loads(done.stdout.strip().splitlines()[-1])
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))
    print(table(results))


def table(results: dict[str, Any]) -> str:
    """The figures as a Markdown table: CPU ms (wall ms) per code and size."""
    lines = [
        f"Database: {results['database']}. CPU ms of the reader process (wall ms in brackets).",
        "",
        "| overrides in force | code | first decision (reads all) | first after one change | "
        "first after one clear | steady decision | memory of the snapshot |",
        "|---|---|---|---|---|---|---|",
    ]
    for size in results["sizes"]:
        for label, figures in results["codes"].items():
            row = figures[str(size)]
            cells = [
                f"{row[what]['cpu_ms']:,.1f} ({row[what]['wall_ms']:,.1f})"
                for what in ("first", "after_change", "after_clear", "steady")
            ]
            lines.append(f"| {size:,} | {label} | {' | '.join(cells)} | {row['snapshot_mb']:,.1f} MB |")
    return "\n".join(lines)


# -- the worker: one code, every size, on a database of its own ---------------------


def worker(code: Path, label: str, sizes: list[int], repeat: int) -> dict[str, Any]:
    sys.path[:0] = [str(code), str(ROOT)]
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "tests.settings")
    os.environ.setdefault("TOKENBUCKET_TEST_TMP", tempfile.gettempdir())
    import django

    django.setup()
    from django.conf import settings
    from django.db import connections
    from django.test.utils import setup_databases, setup_test_environment, teardown_databases

    import django_tokenbucket

    assert Path(django_tokenbucket.__file__).resolve().is_relative_to(code.resolve()), django_tokenbucket.__file__
    settings.TOKENBUCKET = {**settings.TOKENBUCKET, "OVERRIDES": {"MAX_AGE": 3600}}
    default = settings.DATABASES["default"]
    who = os.environ.get("PGDATABASE") or os.environ.get("USER") or "probe"
    suffix = "before" if label.startswith("before") else "after"
    if settings.DB == "sqlite":
        default.setdefault("TEST", {})["NAME"] = str(
            Path(tempfile.gettempdir()) / f"overrides-refresh-{os.getpid()}.db"
        )
    else:
        default.setdefault("TEST", {})["NAME"] = f"overrides_refresh_{who}_{suffix}"
    setup_test_environment()
    old = setup_databases(verbosity=0, interactive=False, aliases={"default"}, serialized_aliases=set())
    figures = {}
    try:
        loaded = 0
        for size in sizes:
            load(loaded, size)
            loaded = size
            figures[str(size)] = measure(size, repeat)
    finally:
        connections.close_all()
        teardown_databases(old, verbosity=0)
    return figures


def load(first: int, last: int) -> None:
    """Blocks of addresses ``first..last`` for an hour, written as one change (one revision)."""
    from datetime import timedelta

    from django.db import connection, transaction
    from django.utils import timezone

    from django_tokenbucket import overrides
    from django_tokenbucket.keys import encode_key
    from django_tokenbucket.models import LimitOverride

    counted = "revision" in {field.name for field in LimitOverride._meta.get_fields()}
    until = timezone.now() + timedelta(hours=1)
    with transaction.atomic():
        revision = overrides._bump(overrides.database_alias())
        extra = {"revision": revision} if counted else {}
        batch = []
        for i in range(first, last):
            encoded = encode_key(("ip", address(i)))
            batch.append(
                LimitOverride(
                    name="login",
                    key=encoded.digest,
                    label=encoded.label,
                    action="block",
                    expires_at=until,
                    reason="penalty box: denied 20 times in a minute",
                    created_by="rate_limit_denied receiver",
                    **extra,
                )
            )
            if len(batch) == 5000:
                LimitOverride.objects.bulk_create(batch)
                batch = []
        LimitOverride.objects.bulk_create(batch)
    # Statistics, as autovacuum (PostgreSQL) and InnoDB's own (MariaDB) keep them: without,
    # PostgreSQL scans a table it has never seen rather than use the index of revisions.
    if connection.vendor in ("postgresql", "mysql"):
        with connection.cursor() as cursor:
            table = LimitOverride._meta.db_table
            cursor.execute(f"ANALYZE TABLE {table}" if connection.vendor == "mysql" else f"ANALYZE {table}")
            if connection.vendor == "mysql":
                cursor.fetchall()


def address(i: int) -> str:
    return f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"


def measure(size: int, repeat: int) -> dict[str, Any]:
    """The reader's figures for ``size`` overrides: changes made by this process, decisions by the reader."""
    from django.db import connections

    from django_tokenbucket import limiter

    connections.close_all()
    context = multiprocessing.get_context("fork")
    ours, theirs = context.Pipe()
    reader = context.Process(target=read, args=(theirs,))
    reader.start()
    try:
        warm = ask(ours, "decide")  # the reader's first decision: connections, first-call imports
        assert warm["in_force"] == size, warm
        full = [ask(ours, "full") for _ in range(repeat)]
        changes, clears = [], []
        for turn in range(repeat):
            one_more = ("ip", address(2**23 + turn))  # beyond every size's addresses
            limiter.block("login", one_more, reason="one more")
            changes.append(ask(ours, "decide"))
            limiter.clear_override("login", one_more)
            clears.append(ask(ours, "decide"))
        # Seen by the reader: one more, then one less, each turn.
        assert changes[-1]["in_force"] == size + 1 and clears[-1]["in_force"] == size, (changes, clears)
        steady = [ask(ours, "steady") for _ in range(20)]
        memory = ask(ours, "memory")
        ask(ours, "stop")
    finally:
        reader.join(10)
        if reader.is_alive():  # an error here: the reader still waits for orders
            reader.kill()
        connections.close_all()
    return {
        "first": median(full),
        "after_change": median(changes),
        "after_clear": median(clears),
        "steady": median(steady),
        "snapshot_mb": round(memory["traced_mb"], 2),
    }


def read(pipe: Any) -> None:
    """The reader: decides when told, after ``invalidate`` (what MAX_AGE's passing does)."""
    from django.db import connections

    from django_tokenbucket import limiter, overrides

    while True:
        what = pipe.recv()
        if what == "stop":
            pipe.send({})
            break
        if what in ("full", "memory"):
            # What a new TOKENBUCKET setting does, on either code: the snapshot forgotten,
            # the next decision reads every override, as a process' first one does.
            overrides._settings_changed(setting="TOKENBUCKET")
        if what != "steady":
            overrides.invalidate()
        if what == "memory":
            gc.collect()
            tracemalloc.start()
            limiter.check("login", "probe")
            gc.collect()
            traced = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            pipe.send({"traced_mb": traced / 2**20})
            continue
        cpu, wall = time.process_time(), time.perf_counter()
        limiter.check("login", "probe")
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        pipe.send({"cpu_ms": cpu * 1000, "wall_ms": wall * 1000, "in_force": len(overrides._snapshot.keyed)})
    connections.close_all()


def ask(pipe: Any, what: str) -> dict[str, Any]:
    pipe.send(what)
    if not pipe.poll(600):
        raise RuntimeError(f"the reader did not answer {what!r}")
    return pipe.recv()


def median(runs: list[dict[str, Any]]) -> dict[str, float]:
    return {
        "cpu_ms": round(statistics.median(run["cpu_ms"] for run in runs), 2),
        "wall_ms": round(statistics.median(run["wall_ms"] for run in runs), 2),
    }


if __name__ == "__main__":
    main()
