"""A harness for running the limiter from several OS processes at once.

Workers are forked after the parent closes its database connections, so each opens its
own; a barrier releases them together; each reports what it saw through a queue.
Figures are collected for the end-of-run summary (see conftest.py) and, when
``TOKENBUCKET_REPORT_DIR`` is set, appended there as JSON lines.

Sizes: every run is small enough for CI on 2 cores (the plan's PR tier). With
``TOKENBUCKET_NIGHTLY=1`` (``tox -m nightly``) the same tests take the plan's nightly
sizes instead: more processes, longer runs, more keys (see ``sized``).
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import statistics
import threading
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.db import connections

from django_tokenbucket.backends import get_backend


def in_another_thread(call: Callable[[], Any], meanwhile: Callable[[], None] = lambda: None) -> Any:
    """Run ``call`` on a thread of its own (so on database connections of its own), run
    ``meanwhile`` here, and return ``call``'s result, or raise what it raised."""
    result: list[Any] = []

    def run() -> None:
        try:
            result.append(call())
        except BaseException as exc:  # handed to the caller
            result.append(exc)
        finally:
            connections.close_all()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        meanwhile()
    finally:
        thread.join(30)
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]


#: Figures of every concurrency run in this session, for the terminal summary.
FIGURES: list[dict[str, Any]] = []

#: The plan's nightly tier (RELIABILITY-PLAN §2.0 "Tiers"), not run in CI.
NIGHTLY = os.environ.get("TOKENBUCKET_NIGHTLY", "").lower() in ("1", "true", "yes")


def sized(pr: Any, nightly: Any) -> Any:
    """Return the PR-tier size, or the nightly one under ``TOKENBUCKET_NIGHTLY=1``."""
    return nightly if NIGHTLY else pr


def run_processes(target: Callable[..., dict[str, Any]], processes: int, *args: Any, timeout: float = 120) -> list[dict[str, Any]]:
    """Run ``target(barrier, index, *args)`` in ``processes`` forked processes; return their results."""
    connections.close_all()
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(processes)
    queue = context.Queue()
    workers = [
        context.Process(target=_entry, args=(target, barrier, queue, index, args), daemon=True)
        for index in range(processes)
    ]
    # The workers inherit this process's heap, millions of objects once the suite has run
    # for a while: the first full collection in a worker walks them all, and writing to
    # each one's header copies every page of it. That stalled a worker 0.4-0.6 s mid-run
    # (the crash test's latency bounds, in CI's full runs only). Frozen, they are never
    # collected in the workers, as gc.freeze's documentation advises before a fork.
    gc.collect()
    gc.freeze()
    try:
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a threaded process; these workers only
            # use their own connections, opened after the fork.
            warnings.simplefilter("ignore", DeprecationWarning)
            for worker in workers:
                worker.start()
    finally:
        gc.unfreeze()
    results = [queue.get(timeout=timeout) for _ in workers]
    for worker in workers:
        worker.join(timeout=10)
    crashes = [r["crash"] for r in results if "crash" in r]
    assert not crashes, "worker crashed:\n" + "\n".join(crashes)
    return results


def _entry(target: Callable[..., dict[str, Any]], barrier: Any, queue: Any, index: int, args: tuple) -> None:
    try:
        result = target(barrier, index, *args)
    except BaseException:
        result = {"crash": traceback.format_exc()}
    finally:
        connections.close_all()
    queue.put(result)


def hammer(
    barrier: Any,
    index: int,
    call: Callable[[], Any],
    attempts: int | None,
    duration: float | None,
) -> dict[str, Any]:
    """Call ``call()`` in a closed loop, for ``attempts`` calls or ``duration`` seconds."""
    backend = get_backend()
    retried = getattr(backend, "retried", None)
    gave_up = getattr(backend, "gave_up", None)
    for counter in (retried, gave_up):
        if counter is not None:
            counter.clear()
    admitted = denied = 0
    timestamps: list[float] = []
    admitted_at: list[float] = []
    latencies: list[float] = []
    retries_per_call: list[int] = []
    errors: list[str] = []
    barrier.wait()
    deadline = time.monotonic() + duration if duration else None
    made = 0
    while (attempts is None or made < attempts) and (deadline is None or time.monotonic() < deadline):
        made += 1
        retries_before = sum(retried.values()) if retried is not None else 0
        started = time.perf_counter()
        try:
            status = call()
        except Exception as exc:  # surfaced to the caller: counted, never expected
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        latencies.append(time.perf_counter() - started)
        retries_per_call.append((sum(retried.values()) if retried is not None else 0) - retries_before)
        timestamps.append(status.timestamp)
        if status.ok:
            admitted += 1
            admitted_at.append(status.timestamp)
        else:
            denied += 1
    return {
        "admitted": admitted,
        "denied": denied,
        "attempts": made,
        "timestamps": timestamps,
        "admitted_at": admitted_at,
        "latencies": latencies,
        "retries_per_call": retries_per_call,
        "retried": dict(retried or {}),
        "gave_up": sum((gave_up or {}).values()),
        "errors": errors,
    }


def summarise(results: list[dict[str, Any]], **run: Any) -> dict[str, Any]:
    """Combine worker results into the report fields of RELIABILITY-PLAN §2.0."""
    latencies = sorted(x for r in results for x in r["latencies"])
    retries = sorted(x for r in results for x in r["retries_per_call"])
    timestamps = [t for r in results for t in r["timestamps"] if t is not None]
    errors_by_code: dict[str, int] = {}
    for r in results:
        for code, n in r["retried"].items():
            errors_by_code[code] = errors_by_code.get(code, 0) + n

    def pct(values: list[float], q: float) -> float:
        return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0

    span = (max(timestamps) - min(timestamps)) if timestamps else 0.0
    figures = {
        **run,
        "N": len(results),
        "attempts": sum(r["attempts"] for r in results),
        "admitted": sum(r["admitted"] for r in results),
        "denied": sum(r["denied"] for r in results),
        "surfaced_errors": sum(len(r["errors"]) for r in results),
        "error_samples": sorted({e for r in results for e in r["errors"]})[:3],
        "errors_by_sqlstate": errors_by_code,
        "retry_giveups": sum(r["gave_up"] for r in results),
        "retries_per_decision": {"p50": pct(retries, 0.5), "p99": pct(retries, 0.99), "max": retries[-1] if retries else 0},
        "decision_latency_ms": {"p50": round(pct(latencies, 0.5) * 1000, 2), "p99": round(pct(latencies, 0.99) * 1000, 2)},
        "store_clock_span_s": round(span, 6),
        "decisions_per_s": round(len(latencies) / span, 1) if span else None,
        "mean_latency_ms": round(statistics.fmean(latencies) * 1000, 2) if latencies else None,
    }
    FIGURES.append(figures)
    report_dir = os.environ.get("TOKENBUCKET_REPORT_DIR")
    if report_dir:
        Path(report_dir).mkdir(parents=True, exist_ok=True)
        with open(Path(report_dir) / "concurrency.jsonl", "a") as out:
            out.write(json.dumps(figures) + "\n")
    return figures
