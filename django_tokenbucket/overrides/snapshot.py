"""This process' snapshot of the overrides in force, and its refresh.

An operator who gives a tenant ten times its quota, exempts a partner or blocks an
account writes a ``LimitOverride`` row; every process must then apply it to its next
decisions without a deploy, yet a decision must not pay a query for it: most sites have
no override at all, and the decision path is one store round trip. So each process
holds a snapshot, a dict from ``(name, key digest)`` (and from ``name``, for overrides of
every key) to the override in force, and a decision looks it up without I/O. The
snapshot is refreshed once ``OVERRIDES["MAX_AGE"]`` seconds passed on the monotonic
clock, by one query of a one-row version stamp (``OverridesVersion``), and rows are read
only when its revision moved on: every write increments it in its own transaction and
gives its row (a deletion, its ``OverrideTombstone``) that revision, so a process reads
the rows changed since its snapshot, not the table, and forgets the remembered denials
of those keys alone. The whole table is read at a process' first decision, and when the
snapshot cannot be brought up to date (the table was flushed: another epoch; the count
went back; cleanup deleted rows it had not read): its cost per override is in
docs/settings.md#overrides. A change made by this process applies to its next decision;
one made by another process within ``MAX_AGE``. An override past its ``expires_at``
stops applying at once, without waiting for a refresh, and leaves memory at the next.

The refresh runs in the decision's driver (``api``), never in a plan, so that the
asyncio paths run it through ``sync_to_async`` rather than on the event loop. A refresh
that fails (the database down, the table not migrated) keeps the snapshot it had, logs,
and tries again after ``MAX_AGE``: overrides must not turn a database outage into a
rate-limiter outage for limits on Redis.

Thread-safe (one refresh at a time; readers take the snapshot as one reference),
re-read in a forked child, and forgotten when ``TOKENBUCKET`` changes.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from asgiref.sync import SyncToAsync, sync_to_async
from django.db import connections, transaction
from django.db.models import Q
from django.utils import timezone

from .. import clock, deny_cache
from ..logs import throttled_logger
from ..plans import plan_base
from ..settings import tokenbucket_settings
from .rows import EPOCH, FIELDS, MICROSECOND, database_alias, from_row, models
from .rules import Override, Settings

if TYPE_CHECKING:
    from ..models import LimitOverride, OverrideTombstone

__all__ = [
    "WARN_IN_FORCE",
    "active",
    "after_fork_in_child",
    "arefresh_if_due",
    "changed",
    "current",
    "invalidate",
    "lookup",
    "refresh_if_due",
    "settings_changed",
]


class _Snapshot:
    """This process' overrides: changed in place by one refresh at a time (under ``_lock``),
    read without a lock by decisions, which see each key's override before or after a
    refresh, never half of one."""

    __slots__ = ("every_key", "expiring", "keyed", "names", "read_at", "revision")

    def __init__(self) -> None:
        #: ``(epoch, revision, stamp)`` of the version row at the last read; None before it.
        self.read_at: tuple[int, int, int] | None = None
        #: Every change up to this revision is here (some later ones may be too): the next
        #: read asks for the changes above it.
        self.revision = 0
        self.keyed: dict[tuple[str, str], Override] = {}
        self.every_key: dict[str, Override] = {}
        #: The limits with any override, and how many: the one test a decision on any
        #: other makes.
        self.names: dict[str, int] = {}
        #: A heap of ``(expires, name, digest)``: the overrides to drop once they end, so
        #: that memory holds those in force, not every block of the past month.
        self.expiring: list[tuple[int, str, str]] = []

    def size(self) -> int:
        return len(self.keyed) + len(self.every_key)

    def get(self, row: tuple[str, str]) -> Override | None:
        return self.every_key.get(row[0]) if not row[1] else self.keyed.get(row)

    def put(self, row: tuple[str, str], found: Override | None) -> None:
        """Make ``found`` the override of ``row`` (None: it has none)."""
        name, digest = row
        table: dict[Any, Override] = self.keyed if digest else self.every_key
        place: Any = row if digest else name
        if found is None:
            if table.pop(place, None) is not None:
                left = self.names[name] - 1
                if left:
                    self.names[name] = left
                else:
                    del self.names[name]
            return
        if place not in table:
            self.names[name] = self.names.get(name, 0) + 1
        table[place] = found
        if found.expires is not None:
            heapq.heappush(self.expiring, (found.expires, name, digest))

    def drop_ended(self, now: int) -> set[tuple[str, str]]:
        """Forget the overrides that ended before ``now`` (µs); return their rows."""
        ended = set()
        expiring = self.expiring
        while expiring and expiring[0][0] <= now:
            expires, name, digest = heapq.heappop(expiring)
            held = self.get((name, digest))
            if held is not None and held.expires == expires:  # not replaced since
                self.put((name, digest), None)
                ended.add((name, digest))
        # A key replaced again and again leaves its past expiries behind: rebuilt when
        # they outnumber the overrides held, which keeps the heap within twice them.
        if len(expiring) > 2 * self.size() + 1024:
            self.expiring = [(o.expires, o.name, o.digest) for o in self.overrides() if o.expires is not None]
            heapq.heapify(self.expiring)
        return ended

    def overrides(self) -> Iterable[Override]:
        return itertools.chain(self.keyed.values(), self.every_key.values())


_snapshot = _Snapshot()
#: The monotonic time (s) after which the next decision reads the stamp again.
_due = 0.0
#: Bumped by every invalidation, so that a refresh that began before one does not
#: postpone the next read by MAX_AGE (it may have read the rows before the change).
_generation = 0
_lock = threading.Lock()


@dataclass(eq=False)
class _Change:
    """A change this process made inside a transaction not over yet."""

    #: The writer's connection, whose ``run_on_commit`` holds ``callback`` until it ends.
    writer: Any
    #: The revision it was given, which no read may count as held before it commits: a
    #: rollback frees that revision for the next writer's change.
    revision: int
    #: ``(name, digest)`` of the override it wrote or deleted.
    row: tuple[str, str]
    callback: Callable[[], None] = field(default=lambda: None)


#: Changes this process made inside transactions not over yet. A rollback runs nothing,
#: but removes the callback from the connection's pending ones: the next decision, on
#: any thread, sees it gone and reads the key again, rather than apply a change that
#: never was for up to MAX_AGE (a TestCase's override leaking into the next test).
_pending: list[_Change] = []
#: The keys of changes rolled back, which the next read takes again from the database:
#: what this process read of them inside the transaction is gone.
_undone: set[tuple[str, str]] = set()
#: Keys at most taken again one by one; more are read with the whole table.
_MOST_UNDONE = 1_000
#: Whether the last read found the count behind the snapshot, inside a transaction.
_behind = False
#: How many overrides in force past which a full read logs a warning (docs/settings.md#overrides).
WARN_IN_FORCE = 100_000


def active() -> Settings | None:
    """Return the setting in force (None: overrides are off); raise ImproperlyConfigured if malformed."""
    return tokenbucket_settings.overrides


def lookup(name: str, digest: str) -> Override | None:
    """Return the override in force for key ``digest`` of limit ``name``, or None.

    A key's own override wins over one of every key of its limit. No I/O: the caller's
    driver refreshed the snapshot (``refresh_if_due``).
    """
    return _in_force(_snapshot, name, digest)


def _in_force(snapshot: _Snapshot, name: str, digest: str) -> Override | None:
    """The override of ``name`` for ``digest`` in ``snapshot``; for a plan's bucket of
    ``@ratelimit(rate=callable)`` (``base[plan …]``), its own, else its base's."""
    if name in snapshot.names:
        found = _found(snapshot, name, digest)
        if found is not None:
            return found
    if snapshot.names and name.endswith("]"):
        # An override of the view's name reaches every plan's bucket: a key blocked there
        # stays blocked when its plan changes.
        base = plan_base(name)
        if base is not None and base in snapshot.names:
            return _found(snapshot, base, digest)
    return None


def _found(snapshot: _Snapshot, name: str, digest: str) -> Override | None:
    keyed = snapshot.keyed.get((name, digest))
    every_key = snapshot.every_key.get(name)
    if keyed is None and every_key is None:
        return None  # (other keys of this limit have one: no need for the clock)
    now = clock.app_now()
    if keyed is not None and keyed.in_force(now):
        return keyed
    if every_key is not None and every_key.in_force(now):
        return every_key
    return None


def current(name: str, digest: str) -> Override | None:
    """``refresh_if_due()``, then ``lookup()``: for a blocking decision, in one call."""
    if _pending:
        _settle()
    if time.monotonic() >= _due:
        _refresh()
    return _in_force(_snapshot, name, digest)


def refresh_if_due() -> None:
    """Read the version stamp (and the overrides changed, if it moved) when MAX_AGE has passed."""
    if _pending:
        _settle()
    if time.monotonic() >= _due:
        _refresh()


async def arefresh_if_due() -> None:
    """``refresh_if_due()`` for async code: the queries run in a worker thread."""
    if _pending:
        _settle()
    if time.monotonic() >= _due:
        await sync_to_async(_refresh)()


def _settle() -> None:
    """Read again the keys of changes made here inside a transaction that was rolled back."""
    gone = []
    for change in list(_pending):
        # Another thread's connection: its list is copied, not iterated while it changes.
        if not any(waiting[1] is change.callback for waiting in list(change.writer.run_on_commit)):
            gone.append(change)
    if gone:
        for change in gone:
            _discard(change)
            _undone.add(change.row)
        invalidate()


def _discard(change: _Change) -> None:
    try:
        _pending.remove(change)
    except ValueError:  # another thread discarded it first
        pass


def invalidate() -> None:
    """Read the version stamp again before the next decision (a change made in this process).

    What changed since the snapshot is read, or everything when the snapshot cannot be
    brought up to date (the tables were emptied: ``post_migrate`` calls this after a flush).
    """
    global _due, _generation
    _generation += 1
    _due = 0.0


def _refresh() -> None:
    global _due
    settings = active()
    if settings is None:
        _due = math.inf
        return
    # Another thread is reading: decide with the snapshot held, which is at most a
    # query old, rather than queue every request behind one.
    if not _lock.acquire(blocking=False):
        return
    try:
        started, generation = time.monotonic(), _generation
        try:
            _read()
        except Exception as exc:  # a failed read keeps the snapshot held: see the module
            alias = database_alias()
            if not connections[alias].in_atomic_block:
                # A worker thread (the asyncio paths) has no request cycle to replace a
                # connection the server dropped: without this it would fail for ever.
                connections[alias].close_if_unusable_or_obsolete()
            throttled_logger.warning(
                "overrides",
                "rate-limit overrides could not be read, keeping the %d held: %s",
                _snapshot.size(),
                exc,
            )
        if clock.override() is None:
            # A pinned clock (tests) may be moved back: there every override read is kept
            # and ``lookup`` alone tells which apply.
            ended = _snapshot.drop_ended(clock.app_now())
            _forget({row for row in ended if row[1]}, {name for name, digest in ended if not digest})
        _due = started + settings.max_age if generation == _generation else 0.0
    finally:
        _lock.release()


def _read() -> None:
    """Bring the snapshot up to date: the rows changed since it, or all of them when it
    cannot be (the first read, another epoch, a count gone back, cleanup past it)."""
    global _snapshot, _behind
    overrides, version, tombstones = models()
    alias = database_alias()
    in_transaction = connections[alias].in_atomic_block
    # Inside the caller's transaction a failing query must not break it (PostgreSQL
    # refuses every later statement of a transaction in error): a savepoint contains it.
    scope = transaction.atomic(using=alias) if in_transaction else nullcontext()
    undone = set(_undone)
    with scope:
        found = version.objects.using(alias).filter(pk=1).values_list("epoch", "revision", "stamp", "floor").first()
        epoch, revision, stamp, floor = found or (0, 0, 0, 0)
        # A change of this process not committed yet is read (on its own connection) but
        # not counted as held: rolled back, its revision goes to another change.
        upto = min([revision, *(change.revision - 1 for change in list(_pending))])
        held = _snapshot
        at = (epoch, revision, stamp)
        if held.read_at == at and held.revision == upto and not undone:
            return
        # Every change of this epoch was counted (see OverridesVersion), so those after
        # the snapshot are the rows and tombstones of a later revision.
        continued = held.read_at is not None and held.read_at[0] == epoch and stamp == -revision
        if continued and revision < held.revision and in_transaction and not _behind:
            # Behind the snapshot: either this transaction began before the last changes
            # (REPEATABLE READ), or the database went back (a backup restored, a failover
            # that lost commits). Seen again at the next read, it is the latter.
            _behind = True
            return
        _behind = False
        if continued and floor <= held.revision <= revision and len(undone) <= _MOST_UNDONE:
            changes = _changes_since(overrides, tombstones, alias, held.revision, undone)
            fresh = None
        else:
            fresh = _whole(overrides, alias)
    _undone.difference_update(undone)
    if fresh is None:
        keys, limits = set(), set()
        for row, override in changes.items():
            if held.get(row) == override:
                continue  # read again (a change not committed when it was read): the same
            held.put(row, override)
            if row[1]:
                keys.add(row)
            else:
                limits.add(row[0])
        held.read_at, held.revision = at, upto
        _forget(keys, limits)
        return
    fresh.read_at, fresh.revision = at, upto
    _snapshot = fresh
    if deny_cache.size():  # (a process' first read has nothing to compare with nor forget)
        _forget(*_differences(held, fresh))
    if fresh.size() > WARN_IN_FORCE:
        throttled_logger.warning(
            "overrides-size",
            "%d rate-limit overrides are in force, more than the %d documented: every process reads them all at "
            "its first decision (docs/settings.md#overrides)",
            fresh.size(),
            WARN_IN_FORCE,
        )


def _whole(overrides: type[LimitOverride], alias: str) -> _Snapshot:
    rows = overrides.objects.using(alias).all()
    # Expired rows stay until cleanup deletes them; they need no place in memory. A
    # pinned clock (tests) may be moved back, so there every row is kept and
    # ``lookup`` alone tells which apply.
    if clock.override() is None:
        rows = rows.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))
    snapshot = _Snapshot()
    keyed, every_key, names, expiring = snapshot.keyed, snapshot.every_key, snapshot.names, snapshot.expiring
    # The per-row work of the one read that grows with the table, kept to the bone: one
    # (name, key) per row (unique), so no row replaces another.
    for name, digest, action, rate, period, capacity, max_reserved, expires_at in rows.values_list(*FIELDS):
        expires = None if expires_at is None else (expires_at - EPOCH) // MICROSECOND
        override = Override(name, digest, action, rate, period, capacity, max_reserved, expires)
        if digest:
            keyed[(name, digest)] = override
        else:
            every_key[name] = override
        names[name] = names.get(name, 0) + 1
        if expires is not None:
            expiring.append((expires, name, digest))
    heapq.heapify(expiring)
    return snapshot


def _changes_since(
    overrides: type[LimitOverride],
    tombstones: type[OverrideTombstone],
    alias: str,
    revision: int,
    undone: set[tuple[str, str]],
) -> dict[tuple[str, str], Override | None]:
    """What each key changed after ``revision`` (and each of ``undone``) has now: its override, or None."""
    latest: dict[tuple[str, str], tuple[int, Override | None]] = {}
    # Rolled back here: what the database has now, whatever revision it was given.
    undone_list = list(undone)
    for start in range(0, len(undone_list), 100):
        chunk = undone_list[start : start + 100]
        latest.update(dict.fromkeys(chunk, (-1, None)))
        which = Q()
        for name, digest in chunk:
            which |= Q(name=name, key=digest)
        for row in overrides.objects.using(alias).filter(which).values_list(*FIELDS, "revision"):
            latest[(row[0], row[1])] = (-1, from_row(*row[:-1]))
    deleted = tombstones.objects.using(alias).filter(revision__gt=revision)
    for name, digest, at in deleted.values_list("name", "key", "revision"):
        latest[(name, digest)] = (at, None)
    # A key deleted and written again has both: the later revision is what it has now.
    for row in overrides.objects.using(alias).filter(revision__gt=revision).values_list(*FIELDS, "revision"):
        known = latest.get((row[0], row[1]))
        if known is None or known[0] < row[-1]:
            latest[(row[0], row[1])] = (row[-1], from_row(*row[:-1]))
    now = None if clock.override() is not None else clock.app_now()
    return {
        row: None if override is None or (now is not None and not override.in_force(now)) else override
        for row, (_at, override) in latest.items()
    }


def _differences(old: _Snapshot, new: _Snapshot) -> tuple[set[tuple[str, str]], set[str]]:
    """The keys and the limits (overrides of every key) whose override is not the same in ``new``."""
    keys = {row for row in old.keyed.keys() | new.keyed.keys() if old.keyed.get(row) != new.keyed.get(row)}
    limits = {
        name
        for name in old.every_key.keys() | new.every_key.keys()
        if old.every_key.get(name) != new.every_key.get(name)
    }
    return keys, limits


def _forget(keys: set[tuple[str, str]], limits: set[str]) -> None:
    # A denial remembered under the old numbers would hide a new exemption, a raised
    # rate, or the end of a block: those keys (and limits) are asked of the store again,
    # in one walk of the remembered denials however many changed.
    if keys or limits:
        deny_cache.forget_overridden(keys, limits)


def changed(alias: str, revision: int, row: tuple[str, str]) -> None:
    """Read the version stamp again before the next decision: this process wrote (or deleted)
    the override of ``row`` at ``revision`` on ``alias``, maybe in a transaction not over yet."""
    invalidate()
    writer = connections[alias]
    if not writer.in_atomic_block:
        return
    # Read again when the change commits too: until then a read on another thread's
    # connection would not see it. Watched until then, in case it is rolled back.
    change = _Change(writer, revision, row)

    def committed() -> None:
        _discard(change)
        invalidate()

    change.callback = committed
    _pending.append(change)
    transaction.on_commit(committed, using=alias)


def after_fork_in_child() -> None:
    """Make the snapshot usable in a forked child (``django_tokenbucket.lifecycle``)."""
    global _lock
    # The parent's lock may have been held by another thread at the fork; the child
    # keeps the snapshot but reads the stamp again before its first decision.
    _lock = threading.Lock()
    # Changes of the parent's transactions: the child takes their keys again from the
    # database, whatever became of them.
    _undone.update(change.row for change in _pending)
    _pending.clear()
    invalidate()
    # The asyncio paths read through sync_to_async's one shared worker thread. A parent
    # that used it forks a child whose executor still counts that thread, which did
    # not survive the fork: every call would queue behind it for ever (a hang seen in
    # the test suite's forked workers). A new executor starts a live thread on first use.
    executor = SyncToAsync.single_thread_executor
    threads = getattr(executor, "_threads", ())
    if threads and not any(thread.is_alive() for thread in threads):
        SyncToAsync.single_thread_executor = ThreadPoolExecutor(max_workers=1)


def settings_changed() -> None:
    """Forget the snapshot and what this process wrote (``django_tokenbucket.lifecycle``):
    the next decision reads the overrides under the new settings."""
    global _snapshot
    _snapshot = _Snapshot()
    _pending.clear()
    _undone.clear()
    invalidate()
