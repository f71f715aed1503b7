"""Interleaved rounds across worker processes, one process per configuration.

``TOKENBUCKET`` is a process-wide setting: a backend configured in one process applies to
every adapter in it. So each configuration (our database backend, our Redis backend, the
peers and baselines, ...) lives in a *worker* process of its own, started with
``TOKENBUCKET_BENCH_CONFIG`` naming it, and a *coordinator* (the script's main process)
runs the rounds: in each round it asks one worker at a time, in an order that rotates
from round to round, to run one adapter's timed batch, and collects the raw latencies.
Only one worker works at a time and all of them run in every round, so every adapter
sees the same machine load.

For the multi-process phase each configuration gets a *pool* of ``N`` workers sharing a
barrier: the coordinator asks all ``N`` to run the same adapter on the same hot key,
and they start together.

A worker hosts the adapters ``factory(spec, config)`` returns (``decide(key) -> allowed``,
see peers.Adapter); the coordinator calls the methods of ``Host`` by name.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import random
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

#: The environment variable naming a worker's configuration (read by the settings modules).
CONFIG_ENV = "TOKENBUCKET_BENCH_CONFIG"

#: The modes of the single-process phase: key of call ``i`` from the batch's parameter.
#: fresh: ``param`` keys in turn, each full again by its next turn (every decision admits:
#: a write); hot: one key (mostly denials); new: a key never decided before in every call
#: (on the database, an INSERT; ``param`` bounds the batch's random offset, which keeps
#: batches apart); stored: random keys among ``k1..k{param}``.
MODES = ("fresh", "hot", "new")

#: The ``param`` of the new-keys mode: offsets drawn from 2^62 never meet.
NEW_KEYS = 2**62


def keys_for(mode: str, param: int, offset: int) -> Callable[[int], str]:
    if mode == "fresh":
        return lambda i: f"d:{(i + offset) % param}"
    if mode == "hot":
        return lambda i: "hot"
    if mode == "new":
        return lambda i: f"n:{offset}:{i}"
    if mode == "stored":
        pick = random.Random(offset)
        return lambda i: f"k{pick.randint(1, param)}"
    raise ValueError(f"unknown mode {mode!r}")


def timed_batch(decide: Callable[[str], bool], keys: Callable[[int], str], seconds: float) -> tuple[list[float], int]:
    """Call ``decide`` for ``seconds``; return each call's latency (µs) and how many were allowed."""
    clock = time.perf_counter_ns
    latencies: list[float] = []
    allowed = 0
    deadline = clock() + int(seconds * 1e9)
    i = 0
    while True:
        key = keys(i)
        started = clock()
        ok = decide(key)
        ended = clock()
        latencies.append((ended - started) / 1000)
        allowed += ok
        i += 1
        if ended > deadline:
            return latencies, allowed


def percentile(ordered: list[float], share: float) -> float:
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def summary(latencies: list[float], allowed: int) -> dict[str, float]:
    ordered = sorted(latencies)
    return {
        "calls": len(ordered),
        "p50_us": round(statistics.median(ordered), 1),
        "p99_us": round(percentile(ordered, 0.99), 1),
        # Decisions per second of one process, from the time spent inside decide().
        "per_second": round(len(ordered) / (sum(ordered) / 1e6)),
        "allowed_share": round(allowed / len(ordered), 3),
    }


def bound(algorithm: str, count: int, period: float, elapsed: float) -> float | None:
    """Most admissions ``algorithm`` allows in ``elapsed`` seconds on a fresh key, or None."""
    windows = elapsed / period
    if algorithm == "token bucket":
        return count + count * windows
    if algorithm in {"sliding log", "moving window"}:
        return count * (math.floor(windows) + 1)
    if algorithm == "fixed window":
        # An interval of that length overlaps at most floor(Δ/W) + 2 windows.
        return count * (math.floor(windows) + 2)
    return None


# --------------------------------------------------------------------------- counting round trips


@contextmanager
def count_round_trips() -> Iterator[dict[str, int]]:
    """Count what goes over the wire: PostgreSQL round trips (libpq trace) and Redis sends/replies."""
    from django.db import connections
    from redis.connection import AbstractConnection

    counts = {"sql": 0, "redis": 0, "redis_replies": 0}
    pgconns = []
    for alias in connections:
        connections[alias].ensure_connection()
        pgconns.append(connections[alias].connection.pgconn)
    trace = tempfile.TemporaryFile("w+")
    send, read = AbstractConnection.send_packed_command, AbstractConnection.read_response

    def counting_send(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["redis"] += 1
        return send(self, *args, **kwargs)

    def counting_read(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["redis_replies"] += 1
        return read(self, *args, **kwargs)

    AbstractConnection.send_packed_command = counting_send  # type: ignore[method-assign]
    AbstractConnection.read_response = counting_read  # type: ignore[method-assign]
    for pgconn in pgconns:
        pgconn.trace(trace.fileno())
    try:
        yield counts
    finally:
        for pgconn in pgconns:
            pgconn.untrace()
        AbstractConnection.send_packed_command = send  # type: ignore[method-assign]
        AbstractConnection.read_response = read  # type: ignore[method-assign]
        trace.seek(0)
        # One ReadyForQuery from the server closes every round trip (simple or extended protocol).
        counts["sql"] = sum(1 for line in trace if "\tB\t" in line and "\tReadyForQuery" in line)
        trace.close()


# --------------------------------------------------------------------------- the worker side


class Host:
    """What a worker process does on the coordinator's request: its adapters, by spec and name."""

    def __init__(self, factory: Callable[[str, str], dict[str, Any]], config: str, barrier: Any) -> None:
        self.factory = factory
        self.config = config
        self.barrier = barrier
        self._adapters: dict[str, dict[str, Any]] = {}

    def adapters(self, spec: str) -> dict[str, Any]:
        if spec not in self._adapters:
            self._adapters[spec] = self.factory(spec, self.config)
        return self._adapters[spec]

    def describe(self, spec: str) -> dict[str, dict[str, Any]]:
        return {
            name: {
                "family": a.family,
                "store": a.store,
                "algorithm": a.algorithm,
                "count": a.count,
                "period": a.period,
                "config": self.config,
                "pid": os.getpid(),
                **getattr(a, "extra", {}),
            }
            for name, a in self.adapters(spec).items()
        }

    def sanity(self, spec: str) -> list[str]:
        """A limit of 5 per hour allows exactly 5 sequential calls on a fresh key, then denies."""
        failures = []
        for name, adapter in self.adapters(spec).items():
            if adapter.family == "baseline" and adapter.algorithm == "-":
                continue
            got = [adapter.decide("sanity-key") for _ in range(7)]
            if got != [True] * 5 + [False] * 2:
                failures.append(f"{name}: {got}")
        return failures

    def round_trips(self, spec: str, keys: int = 50) -> dict[str, dict[str, float]]:
        result = {}
        for name, adapter in self.adapters(spec).items():
            names = [f"rt:{i}" for i in range(keys)]
            for key in names:  # rows, keys and connections exist: the steady state
                adapter.decide(key)
            with count_round_trips() as counts:
                allowed = sum(adapter.decide(key) for key in names)
            result[name] = {
                "sql": counts["sql"] / keys,
                "redis": counts["redis"] / keys,
                "redis_replies": counts["redis_replies"] / keys,
                "allowed_share": allowed / keys,
            }
        return result

    def warm(self, spec: str, name: str, mode: str, param: int, calls: int) -> None:
        decide, keys = self.adapters(spec)[name].decide, keys_for(mode, param, 0)
        for i in range(calls):
            decide(keys(i))

    def per_call(self, spec: str, name: str, calls: int) -> float:
        """µs a decision of ``calls`` decisions timed as one block (keys ``d:0``…``d:1023`` in
        turn, as ``fresh`` with 1,024 keys): for costs below what a clock read per call resolves."""
        decide = self.adapters(spec)[name].decide
        keys = [f"d:{i}" for i in range(1024)]
        started = time.perf_counter()
        for i in range(calls):
            decide(keys[i & 1023])
        return (time.perf_counter() - started) / calls * 1e6

    def batch(
        self, spec: str, name: str, mode: str, param: int, offset: int, seconds: float
    ) -> tuple[list[float], int]:
        adapter = self.adapters(spec)[name]
        if mode == "hot":
            self._drain(adapter)
        return timed_batch(adapter.decide, keys_for(mode, param, offset), seconds)

    @staticmethod
    def _drain(adapter: Any) -> None:
        """Empty the hot key (untimed): it has refilled while the other adapters ran, and a
        batch should measure the steady state of a hot key, mostly denials."""
        if adapter.algorithm == "-":
            return
        for _ in range(2 * adapter.count + 10):
            if not adapter.decide("hot"):
                break

    def profile(self, spec: str, name: str, mode: str, param: int, seconds: float, top: int = 25) -> dict[str, Any]:
        """cProfile of ``decide`` for ``seconds`` in ``mode``: where the client's time goes."""
        import cProfile
        import io
        import pstats
        import sys

        adapter = self.adapters(spec)[name]
        keys = keys_for(mode, param, random.randrange(param) if mode == "new" else 0)
        if mode == "hot":
            self._drain(adapter)
        profiler = cProfile.Profile()
        calls = 0
        deadline = time.perf_counter() + seconds
        profiler.enable()
        while time.perf_counter() < deadline:
            adapter.decide(keys(calls))
            calls += 1
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(top)
        text = out.getvalue()
        for prefix in sorted({*sys.path, sys.prefix}, key=len, reverse=True):
            if len(prefix) > 1:
                text = text.replace(prefix.rstrip("/") + "/", "")
        return {"calls": calls, "seconds": seconds, "stats": text}

    def hammer(self, spec: str, name: str, key: str, seconds: float) -> tuple[int, int, float, float]:
        """Wait for the pool at the barrier, then call ``decide(key)`` for ``seconds``."""
        from django.db import connections

        decide = self.adapters(spec)[name].decide
        decide(f"warm-{os.getpid()}")  # connected before the clock starts
        # A timeout, so that a pool whose sibling failed does not wait for ever.
        self.barrier.wait(timeout=300)
        calls = admitted = 0
        started = time.time()
        deadline = started + seconds
        while True:
            admitted += decide(key)
            calls += 1
            if calls % 8 == 0 and time.time() > deadline:
                break
        ended = time.time()
        # Idle pools hold no PostgreSQL connection: the server's are shared with others.
        connections.close_all()
        return calls, admitted, started, ended

    def memory(self, spec: str, decisions: int = 10) -> dict[str, dict[str, int]]:
        """Bytes Redis uses (MEMORY USAGE) for one key's state after ``decisions`` allowed calls."""
        from benchmarks.suite.stores import clear_redis, redis_client

        client = redis_client()
        out = {}
        for name, adapter in self.adapters(spec).items():
            if adapter.redis_pattern is None:
                continue
            clear_redis()
            for _ in range(decisions):
                adapter.decide("memory-key")
            keys = list(client.scan_iter(match=adapter.redis_pattern, count=1000))
            out[name] = {"keys": len(keys), "bytes": sum(client.memory_usage(key, samples=0) or 0 for key in keys)}
        clear_redis()
        return out


def _serve(conn: Any, settings_module: str, config: str, factory_path: str, barrier: Any) -> None:
    """A worker's main loop (in a spawned process): set up Django for ``config``, then obey."""
    os.environ["DJANGO_SETTINGS_MODULE"] = settings_module
    os.environ[CONFIG_ENV] = config
    import importlib

    import django

    django.setup()
    module, _, attribute = factory_path.partition(":")
    host = Host(getattr(importlib.import_module(module), attribute), config, barrier)
    conn.send(("ok", os.getpid()))
    while True:
        command = conn.recv()
        if command is None:
            break
        method, args = command
        try:
            conn.send(("ok", getattr(host, method)(*args)))
        except BaseException:  # a SystemExit from an adapter too: the coordinator reports it
            conn.send(("error", traceback.format_exc()))
    from django.db import connections

    connections.close_all()


# --------------------------------------------------------------------------- the coordinator side


class WorkerError(RuntimeError):
    pass


class Worker:
    """A worker process of one configuration, called through a pipe."""

    def __init__(
        self, context: Any, settings_module: str, config: str, factory: str, barrier: Any = None, label: str = ""
    ) -> None:
        self.config = config
        self.label = label or config
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_serve, args=(child, settings_module, config, factory, barrier), daemon=True, name=self.label
        )
        self.process.start()
        child.close()
        # Process.start() drops its arguments: the barrier must outlive the child's unpickling.
        self.barrier = barrier
        self.pid: int | None = None

    def ready(self, timeout: float = 180) -> None:
        if not self.conn.poll(timeout):
            raise WorkerError(f"worker {self.label} did not start in {timeout} s")
        self.pid = self.receive()

    def send(self, method: str, *args: Any) -> None:
        self.conn.send((method, args))

    def receive(self) -> Any:
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise WorkerError(f"worker {self.label} died (exit code {self.process.exitcode})") from None
        if status == "error":
            raise WorkerError(f"worker {self.label} failed:\n{value}")
        return value

    def call(self, method: str, *args: Any) -> Any:
        self.send(method, *args)
        return self.receive()

    def close(self) -> None:
        try:
            self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.process.join(timeout=30)
        if self.process.is_alive():
            self.process.terminate()


def context() -> Any:
    # Spawned, not forked: every worker sets Django up itself, with its own configuration.
    return multiprocessing.get_context("spawn")


@contextmanager
def workers(settings_module: str, configs: list[str], factory: str) -> Iterator[dict[str, Worker]]:
    """One worker per configuration, started together; closed on the way out."""
    ctx = context()
    started = {config: Worker(ctx, settings_module, config, factory) for config in configs}
    try:
        for worker in started.values():
            worker.ready()
        yield started
    finally:
        for worker in started.values():
            worker.close()


def rotate(items: list[Any], r: int) -> list[Any]:
    return items[r % len(items) :] + items[: r % len(items)] if items else items


def interleaved(
    where: dict[str, Worker],
    spec: str,
    rounds: int,
    seconds: float,
    modes: dict[str, int],
) -> dict[str, dict[str, dict[str, float]]]:
    """Rounds of every adapter (``where`` maps its name to its worker) in every mode.

    ``modes`` maps a mode of ``keys_for`` to its parameter. In each round and mode the
    adapters run one after the other, in an order rotating with the round, each for
    ``seconds``; their latencies are pooled over the rounds.
    """
    names = list(where)
    samples: dict[str, dict[str, tuple[list[float], int]]] = {mode: {n: ([], 0) for n in names} for mode in modes}
    for r in range(rounds):
        for mode, param in modes.items():
            offset = random.randrange(max(param, 1))
            for name in rotate(names, r):
                latencies, allowed = where[name].call("batch", spec, name, mode, param, offset, seconds)
                kept, count = samples[mode][name]
                samples[mode][name] = (kept + latencies, count + allowed)
    return {mode: {n: summary(*samples[mode][n]) for n in names} for mode in modes}


def many_processes(
    settings_module: str,
    factory: str,
    spec: str,
    adapters: dict[str, dict[str, Any]],
    processes: int,
    rounds: int,
    seconds: float,
) -> dict[str, dict[str, Any]]:
    """``processes`` workers of each adapter's configuration on one hot key, started by a barrier.

    ``adapters`` maps each adapter's name to its description (``Host.describe``). Every
    round runs every adapter, in rotating order, on a key of its own for that round.
    """
    ctx = context()
    configs = sorted({meta["config"] for meta in adapters.values()})
    pools: dict[str, list[Worker]] = {}
    try:
        for config in configs:
            barrier = ctx.Barrier(processes)
            pools[config] = [
                Worker(ctx, settings_module, config, factory, barrier, label=f"{config}#{i}") for i in range(processes)
            ]
        for pool in pools.values():
            for worker in pool:
                worker.ready()
        names = list(adapters)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for r in range(rounds):
            for name in rotate(names, r):
                pool = pools[adapters[name]["config"]]
                for worker in pool:
                    worker.send("hammer", spec, name, f"mp:{r}", seconds)
                got = [worker.receive() for worker in pool]
                elapsed = max(g[3] for g in got) - min(g[2] for g in got)
                meta = adapters[name]
                limit = bound(meta["algorithm"], meta["count"], meta["period"], elapsed)
                runs[name].append(
                    {
                        "calls": sum(g[0] for g in got),
                        "admitted": sum(g[1] for g in got),
                        "elapsed": elapsed,
                        "bound": limit,
                    }
                )
    finally:
        for pool in pools.values():
            for worker in pool:
                worker.close()
    out = {}
    for name, items in runs.items():
        has_bound = all(item["bound"] is not None for item in items)
        over = [max(0.0, item["admitted"] - math.floor(item["bound"])) for item in items] if has_bound else []
        out[name] = {
            "per_second": round(statistics.median(item["calls"] / item["elapsed"] for item in items)),
            "admitted": sum(int(item["admitted"]) for item in items),
            "allowed": sum(math.floor(item["bound"]) for item in items) if has_bound else None,
            "over_admitted": sum(over) if has_bound else None,
            "worst_run_over": max(over) if has_bound else None,
            "runs": len(items),
        }
    return out
