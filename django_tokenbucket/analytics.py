"""Who is being limited: per limit, calls allowed and denied per minute, and the most denied keys.

Off by default. ``TOKENBUCKET["ANALYTICS"] = {"FLUSH": 10}`` turns it on: each process
counts its decisions in memory and adds them to the store of each limit at most once
per ``FLUSH`` seconds, from a thread of its own — never a write per decision, and never
one on the request path. The store keeps the per-minute counts for ``MINUTES_KEPT``
minutes (24 hours) and the denied keys of each minute for ``KEY_MINUTES_KEPT`` (the last
hour): Redis keys expire by themselves, database rows are trimmed by the cleanup command.

What counts: ``allowed`` is a call this limit let through (admitted, exempt by an
override, failed open, or a shadow limit's would-be denial); ``denied`` is a call this
limit refused (denied by the store or from the deny cache, or blocked by an override).
A limit of an all-or-nothing call that another limit refused took nothing and is not
counted; nor is a call refused because the store failed (``FAIL_OPEN`` off), which the
metrics count as ``failed_closed``.

Memory is bounded whatever an attacker sends: at most ``MAX_KEYS`` distinct denied keys
are counted per limit and minute (past that, the less denied half is dropped, so a key
denied often keeps its count while a rotation of one-off keys is forgotten), and only
``TOP_KEYS`` of them per limit and minute are written. Counts that a failing store could
not take are kept for the next flush, those of the last ``UNWRITTEN_MINUTES`` (an hour).

``flush()`` writes this process' counts now (tests, a worker's shutdown); ``minutes()``
and ``denied_keys()`` read what every process wrote, for the admin and the command.
"""

from __future__ import annotations

import atexit
import heapq
import logging
import threading
import time
from typing import Any

from django.db import connections

from .backends import get_backend
from .backends.base import KEY_MINUTES_KEPT, MINUTES_KEPT, BackendError, BaseBackend, DeniedKeyCount, MinuteCounts
from .logs import throttled_logger
from .registry import interpret
from .settings import ANALYTICS_MAX_KEYS, ANALYTICS_TOP_KEYS, tokenbucket_settings
from .settings import AnalyticsSettings as Settings

__all__ = [
    "KEY_MINUTES_KEPT",
    "MINUTES_KEPT",
    "DeniedKeyCount",
    "MinuteCounts",
    "Settings",
    "active",
    "after_fork_in_child",
    "current_minute",
    "denied_keys",
    "discard",
    "flush",
    "minutes",
    "pending",
    "record_allowed",
    "record_denied",
    "settings_changed",
]

logger = logging.getLogger("django_tokenbucket")

#: More limit names than this counted between two flushes and the rest are not: inline
#: limits may have names made at run time.
MAX_NAMES = 1000
#: Minutes of counts a failing store leaves in memory for the next flush; older ones go.
UNWRITTEN_MINUTES = KEY_MINUTES_KEPT


def active() -> Settings | None:
    """Return the setting in force (None: analytics are off); raise ImproperlyConfigured if malformed."""
    return tokenbucket_settings.analytics


def current_minute() -> int:
    """Return the minute now, in whole minutes since the epoch (UTC), as analytics count them."""
    return int(time.time() // 60)


class _Keys:
    """Denied keys of one limit in one minute: digest -> [count, label], at most ``max_keys``."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[str, list[Any]] = {}

    def add(self, digest: str, label: str, count: int, max_keys: int) -> None:
        entry = self.counts.get(digest)
        if entry is not None:
            entry[0] += count
            return
        if len(self.counts) >= max_keys:
            # Keep the more denied half: amortised over the insertions that refill it,
            # a rotation of one-off keys costs O(log n) each, and a key denied often
            # outlives it with its count.
            kept = heapq.nlargest(max_keys // 2, self.counts.items(), key=lambda item: item[1][0])
            self.counts = dict(kept)
        self.counts[digest] = [count, label]

    def top(self, n: int) -> list[tuple[str, str, int]]:
        best = heapq.nsmallest(n, self.counts.items(), key=lambda item: (-item[1][0], item[0]))
        return [(digest, entry[1], entry[0]) for digest, entry in best]


# What this process counted since its last flush, per store: backend -> (name, minute) -> ...
_lock = threading.Lock()
_minutes: dict[BaseBackend, dict[tuple[str, int], list[int]]] = {}
_keys: dict[BaseBackend, dict[tuple[str, int], _Keys]] = {}
_names: set[str] = set()
#: The flusher thread, and the event that stops it (each thread has its own: a stopped
#: one's must not cut short its successor's first wait).
_flusher: threading.Thread | None = None
_stop = threading.Event()
_flush_lock = threading.Lock()


def _counts(backend: BaseBackend, name: str, minute: int) -> list[int] | None:
    """The [allowed, denied] of ``name`` in ``minute``; None past ``MAX_NAMES`` (caller holds the lock)."""
    if name not in _names:
        if len(_names) >= MAX_NAMES:
            return None
        _names.add(name)
    per_minute = _minutes.get(backend)
    if per_minute is None:
        per_minute = _minutes[backend] = {}
    counts = per_minute.get((name, minute))
    if counts is None:
        counts = per_minute[name, minute] = [0, 0]
    return counts


def record_allowed(settings: Settings, backend: BaseBackend, name: str) -> None:
    """Count a call that limit ``name`` (stored on ``backend``) let through."""
    with _lock:
        counts = _counts(backend, name, current_minute())
        if counts is not None:
            counts[0] += 1
    _ensure_flusher(settings)


def record_denied(settings: Settings, backend: BaseBackend, name: str, digest: str, label: str) -> None:
    """Count a call of key ``digest`` that limit ``name`` refused (``label``: "" unless the store keeps labels)."""
    minute = current_minute()
    with _lock:
        counts = _counts(backend, name, minute)
        if counts is not None:
            counts[1] += 1
            if settings.top_keys:
                keys = _keys.setdefault(backend, {}).setdefault((name, minute), _Keys())
                keys.add(digest, label, 1, settings.max_keys)
    _ensure_flusher(settings)


def pending() -> dict[str, dict[str, int]]:
    """Return what this process counted and has not written yet: name -> allowed and denied."""
    totals: dict[str, dict[str, int]] = {}
    with _lock:
        for per_minute in _minutes.values():
            for (name, _), (allowed, denied) in per_minute.items():
                counts = totals.setdefault(name, {"allowed": 0, "denied": 0})
                counts["allowed"] += allowed
                counts["denied"] += denied
    return totals


def flush() -> int:
    """Write this process' counts to their stores now; return how many stores were written.

    Counts a store failed to take are kept for the next flush (those of the last
    ``UNWRITTEN_MINUTES``) and the failure is logged, at most once per ``LOG_INTERVAL``.
    """
    settings = active()
    top_keys = settings.top_keys if settings is not None else ANALYTICS_TOP_KEYS
    max_keys = settings.max_keys if settings is not None else ANALYTICS_MAX_KEYS
    with _flush_lock:
        global _minutes, _keys
        with _lock:
            taken_minutes, taken_keys = _minutes, _keys
            _minutes, _keys = {}, {}
            _names.clear()
        written = 0
        for backend in set(taken_minutes) | set(taken_keys):
            rows = taken_minutes.get(backend, {})
            keys = taken_keys.get(backend, {})
            minute_counts = [
                MinuteCounts(name, minute, allowed, denied) for (name, minute), (allowed, denied) in rows.items()
            ]
            key_counts = [
                DeniedKeyCount(name, digest, label, denied, minute)
                for (name, minute), counted in keys.items()
                for digest, label, denied in counted.top(top_keys)
            ]
            try:
                backend.write_analytics(minute_counts, key_counts)
            except BackendError as exc:
                throttled_logger.warning(
                    "analytics",
                    "rate-limit analytics could not be written to %s; kept for the next flush: %s",
                    backend.setting,
                    exc,
                )
                _restore(backend, minute_counts, key_counts, max_keys)
                continue
            written += 1
        return written


def discard() -> None:
    """Forget what this process counted and has not written (tests; a store that is gone)."""
    with _lock:
        _minutes.clear()
        _keys.clear()
        _names.clear()


def _restore(backend: BaseBackend, minutes: list[MinuteCounts], keys: list[DeniedKeyCount], max_keys: int) -> None:
    """Put back what a store did not take: the counts of the last ``UNWRITTEN_MINUTES``
    minutes (older ones are dropped, so a store down for hours costs bounded memory), and
    of the keys only those the flush would have written."""
    oldest = current_minute() - UNWRITTEN_MINUTES
    with _lock:
        per_minute = _minutes.setdefault(backend, {})
        for row in minutes:
            if row.minute > oldest:
                counts = per_minute.setdefault((row.name, row.minute), [0, 0])
                counts[0] += row.allowed
                counts[1] += row.denied
        per_minute_keys = _keys.setdefault(backend, {})
        for key in keys:
            if key.minute > oldest:
                per_minute_keys.setdefault((key.name, key.minute), _Keys()).add(
                    key.digest, key.label, key.denied, max_keys
                )


def _ensure_flusher(settings: Settings) -> None:
    global _flusher, _stop
    if _flusher is not None:
        return
    with _lock:
        if _flusher is not None:
            return
        _stop = threading.Event()
        _flusher = threading.Thread(
            target=_flush_every, args=(settings.flush, _stop), name="tokenbucket-analytics", daemon=True
        )
        _flusher.start()


def _flush_every(seconds: float, stop: threading.Event) -> None:
    """The flusher thread: write every ``seconds`` until ``stop`` is set, and close the connections it opened."""
    while not stop.wait(seconds):
        try:
            flush()
        except Exception:  # a flusher that dies would silently stop all analytics
            logger.exception("rate-limit analytics: the flush failed")
        finally:
            # Django opens a connection per thread: this one's must not outlive its write
            # (a database would count it idle in transaction pooling, or run out of slots).
            connections.close_all()


def _stop_flusher() -> None:
    """Stop the flusher thread (at once, if it is waiting); a later count starts a new one."""
    global _flusher
    _flusher = None
    _stop.set()


def _flush_at_exit() -> None:
    # A worker that stops (a deploy, max-requests) writes what it counted since its last flush.
    if _minutes or _keys:
        try:
            flush()
        except Exception:  # at exit, a store already gone must not turn into a traceback
            pass


atexit.register(_flush_at_exit)


def minutes(name: str, *, since: int = 60, backend: BaseBackend | None = None) -> list[MinuteCounts]:
    """Return the allowed and denied counts of limit ``name`` for each of the last ``since``
    minutes (the current one last), summed over every process; minutes with no call are zeros.

    Reads the limit's store (``backend`` to name another); what processes counted but
    have not flushed yet (up to ``FLUSH`` seconds) is not there.
    """
    _check_span(name, since, MINUTES_KEPT)
    until = current_minute() + 1
    store = backend if backend is not None else _backend_of(name)
    stored = {row.minute: row for row in store.read_minutes([name], until - since, until)}
    return [stored.get(minute, MinuteCounts(name, minute, 0, 0)) for minute in range(until - since, until)]


def denied_keys(
    name: str, *, since: int = 60, limit: int = 20, backend: BaseBackend | None = None
) -> list[DeniedKeyCount]:
    """Return the ``limit`` keys of limit ``name`` most denied in the last ``since`` minutes
    (at most ``KEY_MINUTES_KEPT``), with their counts, most denied first."""
    _check_span(name, since, KEY_MINUTES_KEPT)
    if type(limit) is not int or limit < 1:
        raise ValueError(f"rate limit {name!r}: the number of keys to show must be a whole number >= 1, not {limit!r}")
    until = current_minute() + 1
    store = backend if backend is not None else _backend_of(name)
    return store.read_denied_keys(name, until - since, until, limit)


def _check_span(name: str, since: object, most: int) -> None:
    if type(since) is not int or not 1 <= since <= most:
        raise ValueError(f"rate limit {name!r}: analytics span the last 1 to {most} minutes, not {since!r}")


def _backend_of(name: str) -> BaseBackend:
    known = interpret(name, as_rows=False)
    if known is None:
        raise ValueError(f"unknown rate limit {name!r}: no analytics to read (pass backend= for a limit of config=)")
    backend = get_backend(known.config.backend)
    if not backend.keeps_analytics:
        raise ValueError(f"rate limit {name!r}: its store ({backend.setting}) keeps no analytics")
    return backend


def after_fork_in_child() -> None:
    """Start a forked child with nothing counted and no flusher (``django_tokenbucket.lifecycle``)."""
    global _lock, _flush_lock, _flusher, _minutes, _keys
    # The parent's counts are the parent's to write; the child counts its own, with a
    # thread of its own (threads do not survive a fork) and fresh locks.
    _lock, _flush_lock = threading.Lock(), threading.Lock()
    _minutes, _keys = {}, {}
    _names.clear()
    _flusher = None


def settings_changed() -> None:
    """Stop the flusher, which runs at the old interval: a new one starts with the next count."""
    _stop_flusher()
