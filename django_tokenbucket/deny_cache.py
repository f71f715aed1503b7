"""This process' memory of keys known to be denied, so that a flood costs the store nothing.

A rate limiter exists for the moment someone hammers one endpoint, and without this
every denied request of that flood is a store round trip: a transaction on the
application's own database, or two Redis commands. A denial stays right for as long as
nothing gives the bucket tokens back: other processes' admissions only lower it, and
refill is uniform, so what the store said once can be extrapolated until the moment it
named (``retry_after``). Only a reset, a refund, a set-tokens or a change of the limit's
config make it wrong. In this process each of those forgets the key at once
(``forget``, ``forget_limit``, ``clear``); made by another process, it is seen once the
entry expires, at most ``MAX_AGE`` seconds after the denial was learnt. A denial learnt
inside a transaction is kept only once the transaction commits (a rollback may undo what
the store read, and a test suite empties its stores between rolled-back tests), and a
flush of the tables (``post_migrate``, see apps.py) forgets everything.

Memory never admits: it answers only a call that the store would deny too (the same
limit, config and store, a count at least the one denied, no reservation), and
everything else goes to the store. Bounded by ``MAX_KEYS`` entries (an attacker
rotating keys costs at most that many), guarded by one lock, emptied in a forked
child, and free of I/O (a commit is awaited with ``on_commit``, never a query), so the
asyncio paths call it on the event loop.

Not cached: shadow limits (they never block), sharded limits (the next call picks
other shards, which may admit), reservations, and statuses that failed open.
"""

from __future__ import annotations

import asyncio
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass
from functools import partial

from django.db import DEFAULT_DB_ALIAS, connections, transaction

from . import clock
from .algorithms import Decision
from .backends.base import BaseBackend, Outcome
from .limits import LimitConfig
from .settings import DenyCacheSettings as Settings
from .settings import tokenbucket_settings

__all__ = [
    "Recalled",
    "Settings",
    "active",
    "admitted",
    "after_fork_in_child",
    "cacheable",
    "clear",
    "forget",
    "forget_limit",
    "forget_overridden",
    "forget_plans",
    "lookup",
    "now",
    "remember",
    "size",
]


@dataclass(frozen=True)
class Recalled:
    """A denial answered from memory: the decision the store would make, at store time ``now``."""

    decision: Decision
    now: int


@dataclass(slots=True)
class _Entry:
    """A denial as the store reported it, and when this process learnt it."""

    limit: LimitConfig
    #: The backend that decided: a ``Limiter(backend)`` of its own is another store.
    store: object
    count: int
    value: int
    retry_after: int
    full_after: int
    #: The store's time of the denial (µs since the epoch).
    timestamp: int
    #: This process' clock (µs) taken before the store was asked: elapsed time measured
    #: from it is never more than the store's, so an entry never outlives the denial.
    learnt: int
    #: Whether ``learnt`` is a pinned test clock (``clock.override``) rather than the
    #: monotonic one: the two are never compared.
    pinned: bool
    #: Microseconds after ``learnt`` when the entry stops answering.
    lifetime: int


_lock = threading.Lock()
_entries: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
#: Bumped by every invalidation: a denial decided before one may no longer hold, so it
#: is not remembered when the two race (``remember`` compares it with ``now()``'s).
_epoch = 0
#: The denials learnt inside transactions still open (their ``on_commit`` callbacks),
#: held weakly: a rollback discards the callback, and so its place here.
_awaiting_commit: weakref.WeakSet[Callable[[], None]] = weakref.WeakSet()


def active() -> Settings | None:
    """Return the setting in force (None: the cache is off); raise ImproperlyConfigured if malformed."""
    return tokenbucket_settings.deny_cache


def now() -> tuple[bool, int, int]:
    """Return (pinned, this process' clock in µs, the invalidation epoch), read before a store call."""
    pinned = clock.override()
    if pinned is not None:
        return True, pinned, _epoch
    return False, time.monotonic_ns() // 1000, _epoch


def lookup(limit: LimitConfig, store: object, digest: str, count: int) -> Recalled | None:
    """Return the decision the store would make now for ``count`` micro-tokens, if memory
    knows it is a denial; None sends the call to the store.

    The caller has checked that the call may be cached (``cacheable``).
    """
    entry = _entries.get((limit.name, digest))
    if entry is None or count < entry.count or entry.store is not store:
        return None
    if entry.limit is not limit and entry.limit != limit:
        return None
    pinned, at, _ = now()
    elapsed = at - entry.learnt
    if pinned is not entry.pinned or not 0 <= elapsed < entry.lifetime:
        return None
    # Within an entry's lifetime (a fixed window's ends with the window) nothing but time
    # changes what the store would say. Its error on a real clock (a micro-token) is far
    # below what measuring elapsed time on this process' clock rather than the store's
    # leaves open anyway; on a pinned clock memory answers only what it says exactly.
    later = limit.algorithm.denied_later(
        entry.value,
        entry.retry_after,
        entry.count,
        count,
        elapsed,
        rate=limit.rate,
        period=limit.period,
        capacity=limit.capacity,
        exact=pinned,
    )
    if later is None:
        return None
    value, retry_after = later
    decision = Decision(False, value, retry_after, max(0, entry.full_after - elapsed), None)
    return Recalled(decision, entry.timestamp + elapsed)


def cacheable(limit: LimitConfig, reserve: bool) -> bool:
    """Whether a call on ``limit`` may be answered from, and remembered in, memory."""
    return limit.deny_cache and not limit.shadow and limit.shards == 1 and not reserve


def remember(
    settings: Settings,
    limit: LimitConfig,
    store: BaseBackend,
    digest: str,
    count: int,
    outcome: Outcome,
    before: tuple[bool, int, int],
) -> None:
    """Remember a denial the store just made (``before``: ``now()`` read before asking it).

    An admission forgets the key instead: it lowered the bucket, so a denial remembered
    before it would extrapolate a value, and a wait, that the store no longer holds.
    """
    decision, timestamp = outcome.decisions[0], outcome.now
    row = (limit.name, digest)
    if decision.allowed:
        admitted(limit.name, digest)
        return
    if decision.retry_after is None or decision.retry_after <= 0 or decision.state is not None:
        return  # (a state to write: the clock went back and the store rebased the bucket)
    algorithm = limit.algorithm
    holds = algorithm.denial_holds(
        decision.value,
        decision.retry_after,
        count,
        timestamp,
        rate=limit.rate,
        period=limit.period,
        offset=limit.window_offset(digest) if algorithm.phased else 0,
    )
    if holds is None:
        return
    pinned, learnt, epoch = before
    lifetime = min(holds, settings.max_age)
    entry = _Entry(
        limit,
        store,
        count,
        decision.value,
        decision.retry_after,
        decision.full_after,
        timestamp,
        learnt,
        pinned,
        lifetime,
    )
    alias = _open_transaction(store)
    if alias is None:
        _keep(settings, row, entry, epoch)
    elif len(_awaiting_commit) < settings.max_keys:
        # What the store read inside a transaction may be undone by its rollback (Django's
        # TestCase rolls back every test; a view under ATOMIC_REQUESTS that fails): the
        # denial is remembered only once that is ruled out. A rollback drops the callback,
        # and with it its place among those awaiting a commit (a long transaction that
        # meets many denials holds at most MAX_KEYS of them, as memory does).
        keep = partial(_keep, settings, row, entry, epoch)
        _awaiting_commit.add(keep)
        transaction.on_commit(keep, using=alias)


def _open_transaction(store: BaseBackend) -> str | None:
    """Return the database alias whose open transaction a denial was learnt in, or None.

    The store's own database for the database backend, whose reads join the caller's
    transaction. For another store (Redis), the default database's: a rollback does not
    undo what Redis holds, but the code around it — a test that empties Redis before the
    next one, a view that failed half-way — treats the whole as undone, and a denial
    learnt under it is not worth trusting until the transaction stands. An asyncio task
    has no transaction of its own (the ORM's transactions are blocking).
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        return None
    alias = store.database_alias() or DEFAULT_DB_ALIAS
    return alias if connections[alias].in_atomic_block else None


def _keep(settings: Settings, row: tuple[str, str], entry: _Entry, epoch: int) -> None:
    """Remember ``entry`` unless an invalidation came after the denial was asked (``epoch``)."""
    with _lock:
        if epoch != _epoch:
            return  # something was reset meanwhile: this denial may predate it
        _entries.pop(row, None)
        while len(_entries) >= settings.max_keys:
            _entries.popitem(last=False)
        _entries[row] = entry


def admitted(name: str, digest: str) -> None:
    """Forget a key the store just admitted on (a reservation too): the bucket is lower
    than a remembered denial would extrapolate."""
    row = (name, digest)
    if row in _entries:
        with _lock:
            _entries.pop(row, None)


def forget(name: str, digest: str) -> None:
    """Forget what memory knows of key ``digest`` of limit ``name`` (reset, refunded or set here)."""
    global _epoch
    with _lock:
        _epoch += 1
        _entries.pop((name, digest), None)


def forget_limit(name: str) -> None:
    """Forget every key of limit ``name`` (all of its buckets reset at once)."""
    global _epoch
    with _lock:
        _epoch += 1
        for row in [row for row in _entries if row[0] == name]:
            del _entries[row]


def forget_plans(base: str, digest: str | None = None) -> None:
    """Forget key ``digest`` (None: every key) of every plan's bucket of the
    ``@ratelimit(rate=callable)`` named ``base`` (``base[plan …]``), which an override
    of ``base`` reaches. Walks every entry: for override changes, not for each decision."""
    global _epoch
    prefix = f"{base}[plan "
    with _lock:
        _epoch += 1
        for row in [row for row in _entries if row[0].startswith(prefix) and digest in (None, row[1])]:
            del _entries[row]


def forget_overridden(keys: Collection[tuple[str, str]], limits: Collection[str]) -> None:
    """Forget in one walk what ``forget`` and ``forget_plans`` of each ``(name, digest)`` of
    ``keys``, and ``forget_limit`` and ``forget_plans`` of each name of ``limits``, would:
    the denials that a refresh of the overrides which changed them may contradict,
    however many (one walk rather than one per key)."""
    global _epoch
    with _lock:
        _epoch += 1
        doomed = []
        for row in _entries:
            name = row[0]
            if name in limits or row in keys:
                doomed.append(row)
                continue
            cut = name.find("[plan ") if name.endswith("]") else -1
            if cut > 0 and (name[:cut] in limits or (name[:cut], row[1]) in keys):
                doomed.append(row)
        for row in doomed:
            del _entries[row]


def clear() -> None:
    """Forget every denial this process remembers.

    For code (and tests) that changes stored buckets behind the limiter's back: raw SQL,
    ``redis-cli``, another process when it must be seen before ``MAX_AGE``.
    """
    global _epoch
    with _lock:
        _epoch += 1
        _entries.clear()


def size() -> int:
    """Return how many keys this process remembers as denied."""
    return len(_entries)


def after_fork_in_child() -> None:
    """Start a forked child with nothing remembered (``django_tokenbucket.lifecycle``)."""
    global _lock
    # The parent's lock may have been held by another thread at the fork; the child has
    # only this thread and starts with nothing remembered.
    _lock = threading.Lock()
    _entries.clear()
