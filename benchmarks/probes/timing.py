"""How every probe times what it measures: one way to warm up, take turns, summarise, compare.

A probe asks what something costs on a machine shared with other work, where a figure on
its own says little: so each one measures its subject next to a floor or a baseline of
the same run (Django's ``SELECT 1``, a durable ``UPDATE``, ``PING``, a raw ``EVALSHA``,
a view without a decorator, decisions while no cleanup runs) and reads the ratio or the
difference. What that takes is the same in every probe, and lives here:

- ``warm_up``: untimed calls first (connections, prepared statements, script caches,
  first-call imports), so that no figure includes a set-up;
- ``take_turns``, ``in_rounds``, ``rotate``: what is compared takes turns, call by call
  or round by round, in a rotating order where the probe asks for one, so that a burst
  of load elsewhere on the machine falls on all of it alike;
- ``timed``, ``rate``, ``latencies_until``: latencies of single calls, calls per second
  in a closed loop, and latencies of traffic running until it is told to stop;
- ``percentile``, ``summarise``, ``ratio``, ``overheads``: the figures read from them;
- ``in_processes``, ``alongside``: a process of its own per configuration, for what is
  set once per process (``settings.configure``, ``TOKENBUCKET``), and traffic in a
  process of its own next to the work being measured.

Latencies are in seconds, from ``time.perf_counter_ns``; a probe prints them in its unit.
The ``make bench`` suite has its own harness (benchmarks/suite/harness.py): worker
processes that run timed batches on request, for figures that go into the docs' tables.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

T = TypeVar("T")
W = TypeVar("W")


class Flag(Protocol):
    """What ``latencies_until`` waits for: a threading or multiprocessing Event."""

    def is_set(self) -> bool: ...


# --------------------------------------------------------------------------- taking turns


def rotate(items: Sequence[T], shift: int) -> list[T]:
    """``items`` starting from the one at ``shift`` (modulo their number), the rest wrapping round."""
    if not items:
        return []
    shift %= len(items)
    return [*items[shift:], *items[:shift]]


def warm_up(calls: Iterable[Callable[..., object]], arguments: Iterable[tuple[Any, ...]]) -> None:
    """Call each of ``calls`` with each of ``arguments`` (tuples of positional arguments), untimed."""
    arguments = list(arguments)
    for call in calls:
        for args in arguments:
            call(*args)


def take_turns(
    calls: Mapping[str, Callable[[Any], object]],
    arguments: Iterable[Any],
    *,
    by_call: bool = True,
    rotating: bool = False,
) -> dict[str, list[float]]:
    """The latency (s) of each of ``calls`` on each of ``arguments``, the calls taking turns.

    By call, every call takes an argument before the next argument is taken, so that a
    burst of other work lands on all of them alike; ``rotating`` also changes which call
    goes first with each argument, so that none always follows the same one. Otherwise
    in blocks: each call takes every argument, one call after the other.
    """
    names = list(calls)
    arguments = list(arguments)
    latencies: dict[str, list[float]] = {name: [] for name in names}
    if by_call:
        order = [
            (name, argument) for i, argument in enumerate(arguments) for name in rotate(names, i if rotating else 0)
        ]
    else:
        order = [(name, argument) for name in names for argument in arguments]
    clock = time.perf_counter_ns
    for name, argument in order:
        call, kept = calls[name], latencies[name]
        started = clock()
        call(argument)
        ended = clock()
        kept.append((ended - started) / 1e9)
    return latencies


def in_rounds(
    names: Sequence[str], rounds: int, measure: Callable[[str, int], T], *, rotating: bool = False
) -> dict[str, list[T]]:
    """``measure(name, round)`` for each name in each of ``rounds`` rounds: each name's figures, a round each.

    In a round the names take turns in their order, or (``rotating``) from a first that
    changes with the round: a slow moment of the machine then falls on all of them.
    """
    figures: dict[str, list[T]] = {name: [] for name in names}
    for number in range(rounds):
        for name in rotate(names, number) if rotating else names:
            figures[name].append(measure(name, number))
    return figures


# --------------------------------------------------------------------------- measuring


def timed(call: Callable[[], object], repeat: int) -> list[float]:
    """The latencies (s) of ``repeat`` calls of ``call``, after one untimed call."""
    warm_up([call], [()])
    clock = time.perf_counter_ns
    latencies = []
    for _ in range(repeat):
        started = clock()
        call()
        latencies.append((clock() - started) / 1e9)
    return latencies


def rate(call: Callable[[], object], seconds: float, chunk: int = 100) -> float:
    """Calls per second of ``call`` in a closed loop for about ``seconds``.

    The clock is read every ``chunk`` calls only, so that reading it is no part of the figure.
    """
    calls = 0
    deadline = time.perf_counter() + seconds
    started = time.perf_counter()
    while time.perf_counter() < deadline:
        for _ in range(chunk):
            call()
        calls += chunk
    return calls / (time.perf_counter() - started)


def latencies_until(stop: Flag, call: Callable[[int], object]) -> list[float]:
    """Call ``call(0)``, ``call(1)``, ... in a closed loop until ``stop`` is set; each call's latency (s)."""
    clock = time.perf_counter_ns
    latencies = []
    i = 0
    while not stop.is_set():
        started = clock()
        call(i)
        latencies.append((clock() - started) / 1e9)
        i += 1
    return latencies


# --------------------------------------------------------------------------- reading the figures


def percentile(values: Iterable[float], share: float) -> float:
    """The value at ``share`` (0.99 for p99) of ``values`` in order: the nearest rank, not interpolated."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * share))]


def summarise(latencies: Sequence[float]) -> dict[str, float]:
    """The median, p95, p99 and slowest of ``latencies`` (s), in milliseconds to 0.1 ms."""

    def ms(seconds: float) -> float:
        return round(seconds * 1000, 1)

    return {
        "median_ms": ms(statistics.median(latencies)),
        "p95_ms": ms(percentile(latencies, 0.95)),
        "p99_ms": ms(percentile(latencies, 0.99)),
        "max_ms": ms(max(latencies)),
    }


def ratio(value: float, baseline: float) -> float:
    """``value`` as a multiple of ``baseline``, which must come from the same run.

    Both then saw the same machine and the same load: the ratio holds where either
    figure alone would not, on a shared machine or another one.
    """
    return value / baseline


def overheads(figures: Mapping[str, float], baseline_of: Mapping[str, str | None]) -> dict[str, float | None]:
    """Each figure minus its baseline's (``baseline_of`` names it; None for a baseline itself).

    What a wrapper adds to what it wraps (a decorator to its view, say), both measured in
    the same rounds.
    """
    differences: dict[str, float | None] = {}
    for name, value in figures.items():
        baseline = baseline_of[name]
        differences[name] = None if baseline is None else value - figures[baseline]
    return differences


# --------------------------------------------------------------------------- processes


def _put_result(queue: Any, target: Callable[..., Any], args: tuple[Any, ...]) -> None:
    queue.put(target(*args))


def in_processes(target: Callable[..., T], arguments: Sequence[tuple[Any, ...]], timeout: float) -> list[T]:
    """``target(*args)`` for each of ``arguments``, each in a process of its own, all at once.

    Returns what they returned, in the order they finished. Spawned, not forked: each
    process sets Django up itself, with the configuration its arguments name, since
    ``settings.configure()`` and ``TOKENBUCKET`` hold for a whole process. ``target``
    must be a module-level function. ``timeout`` bounds the wait for each result.
    """
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    processes = [context.Process(target=_put_result, args=(queue, target, args)) for args in arguments]
    for process in processes:
        process.start()
    results = [queue.get(timeout=timeout) for _ in processes]
    for process in processes:
        process.join()
    return results


def alongside(
    background: Callable[[Flag], T], work: Callable[[], W], *, settle: float = 0.5, timeout: float = 60
) -> tuple[W, T]:
    """Run ``work()`` here while ``background(stop)`` runs in a forked process; both results.

    The background process starts ``settle`` seconds before the work (to connect and warm
    up) and is told to stop when the work returns. Forked, not spawned: it inherits this
    process's set-up, a test database made at run time included; close database
    connections before, so that the two processes share none.
    """
    context = multiprocessing.get_context("fork")
    stop, queue = context.Event(), context.Queue()
    process = context.Process(target=_put_result, args=(queue, background, (stop,)))
    process.start()
    time.sleep(settle)
    result = work()
    stop.set()
    figures = queue.get(timeout=timeout)
    process.join(timeout=10)
    return result, figures
