"""Overrides made while the site runs, and this process' snapshot of them.

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

The rows live in the application's database (the alias the routers give the model for
writes) whatever store decides the limits, a Redis-only project included: the admin
and the command edit them as models, and one query per process per ``MAX_AGE`` costs a
database nothing. The refresh runs in the decision's driver (``api``), never in a plan,
so that the asyncio paths run it through ``sync_to_async`` rather than on the event
loop. A refresh that fails (the database down, the table not migrated) keeps the
snapshot it had, logs, and tries again after ``MAX_AGE``: overrides must not turn a
database outage into a rate-limiter outage for limits on Redis.

Thread-safe (one refresh at a time; readers take the snapshot as one reference),
re-read in a forked child, and forgotten when ``TOKENBUCKET`` changes.
"""

from __future__ import annotations

import heapq
import itertools
import math
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from fractions import Fraction
from typing import TYPE_CHECKING, Any

from asgiref.sync import SyncToAsync, sync_to_async
from django.apps import apps
from django.core.exceptions import ImproperlyConfigured
from django.db import connections, router, transaction
from django.db.models import Case, F, Max, Q, Value, When
from django.utils import timezone

from . import clock, deny_cache
from .algorithms import MICRO
from .keys import Redacted, encode_key, is_request_data_key
from .limits import LimitConfig, parse_limit
from .logs import throttled_logger
from .plans import plan_base
from .request_keys import canonical_spec, ip_key_from_text, normalize_identity
from .settings import OVERRIDES_MAX_AGE, tokenbucket_settings
from .settings import OverridesSettings as Settings

if TYPE_CHECKING:
    from .models import LimitOverride, OverridesVersion, OverrideTombstone

__all__ = [
    "ACTIONS",
    "BLOCK",
    "EXEMPT",
    "LIMIT",
    "LONGEST",
    "NUMBERS",
    "Override",
    "Settings",
    "active",
    "after_fork_in_child",
    "arefresh_if_due",
    "check_admits",
    "current",
    "database_alias",
    "delete",
    "derive",
    "expiry",
    "in_force",
    "invalidate",
    "key_digest",
    "lookup",
    "refresh_if_due",
    "save",
    "save_checked",
    "settings_changed",
]

LIMIT = "limit"
EXEMPT = "exempt"
BLOCK = "block"
ACTIONS = (LIMIT, EXEMPT, BLOCK)
#: The fields of a ``limit`` override, as LimitConfig and the model name them.
NUMBERS = ("rate", "period", "capacity", "max_reserved")


@dataclass(frozen=True, slots=True)  # slots: a process may hold 10^5 of them (docs/settings.md#overrides)
class Override:
    """One override as this process holds it: what a ``LimitOverride`` row says, in the
    units decisions use."""

    name: str
    #: The key's digest; "" for every key of the limit.
    digest: str
    action: str
    rate: int | None = None
    period: int | None = None
    capacity: int | None = None
    max_reserved: int | None = None
    #: µs since the epoch; None: never.
    expires: int | None = None
    #: The last limit this override was applied to, and the result: a decision applies
    #: it to the same LimitConfig object every time.
    _applied: tuple[LimitConfig, LimitConfig] | None = field(default=None, compare=False, repr=False)

    def in_force(self, now: int) -> bool:
        """Whether this override applies at ``now`` (µs since the epoch)."""
        return self.expires is None or now < self.expires

    def wait(self, now: int) -> float | None:
        """Seconds from ``now`` (µs) until this override ends; None when it never does."""
        return None if self.expires is None else max(0, self.expires - now) / MICRO

    def config(self, base: LimitConfig) -> LimitConfig:
        """Return ``base`` with this override's numbers in place (a ``limit`` override)."""
        applied = self._applied
        if applied is not None and applied[0] is base:
            return applied[1]
        derived = derive(base, self.rate, self.period, self.capacity, self.max_reserved)
        object.__setattr__(self, "_applied", (base, derived))
        return derived


def derive(
    base: LimitConfig, rate: int | None, period: int | None, capacity: int | None, max_reserved: int | None
) -> LimitConfig:
    """Return ``base`` with the numbers given (micro-units) replacing its own.

    Validated as a limit in ``LIMITS`` is (ImproperlyConfigured naming the limit). A
    capacity not given follows a new rate when the limit's capacity is its rate (the
    default, as in a limit written with that rate), and stays what it was otherwise.
    """
    spec: dict[str, Any] = {
        "kind": base.kind,
        "rate": Fraction(base.rate if rate is None else rate, MICRO),
        "period": Fraction(base.period if period is None else period, MICRO),
        "shadow": base.shadow,
        "shards": base.shards,
        "backend": base.backend,
        "deny_cache": base.deny_cache,
    }
    if capacity is not None:
        spec["capacity"] = Fraction(capacity, MICRO)
    elif rate is None or base.capacity != base.rate:
        spec["capacity"] = Fraction(base.capacity, MICRO)
    reserved = base.max_reserved if max_reserved is None else max_reserved
    if reserved is not None:
        spec["max_reserved"] = Fraction(reserved, MICRO)
    if base.start is not None:
        spec["start"] = Fraction(base.start, MICRO)
    return parse_limit(base.name, spec)


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
    overrides, version, tombstones = _models()
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


_FIELDS = ("name", "key", "action", *NUMBERS, "expires_at")


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
    for name, digest, action, rate, period, capacity, max_reserved, expires_at in rows.values_list(*_FIELDS):
        expires = None if expires_at is None else (expires_at - _EPOCH) // _MICROSECOND
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
        for row in overrides.objects.using(alias).filter(which).values_list(*_FIELDS, "revision"):
            latest[(row[0], row[1])] = (-1, _from_row(*row[:-1]))
    deleted = tombstones.objects.using(alias).filter(revision__gt=revision)
    for name, digest, at in deleted.values_list("name", "key", "revision"):
        latest[(name, digest)] = (at, None)
    # A key deleted and written again has both: the later revision is what it has now.
    for row in overrides.objects.using(alias).filter(revision__gt=revision).values_list(*_FIELDS, "revision"):
        known = latest.get((row[0], row[1]))
        if known is None or known[0] < row[-1]:
            latest[(row[0], row[1])] = (row[-1], _from_row(*row[:-1]))
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


def _from_row(
    name: str,
    digest: str,
    action: str,
    rate: int | None,
    period: int | None,
    capacity: int | None,
    max_reserved: int | None,
    expires_at: datetime | None,
) -> Override:
    expires = None if expires_at is None else _as_micro(expires_at)
    return Override(name, digest, action, rate, period, capacity, max_reserved, expires)


def _models() -> tuple[type[LimitOverride], type[OverridesVersion], type[OverrideTombstone]]:
    # Looked up, not imported: this module is imported (by ``api``) before the app
    # registry is ready, when settings files import ``django_tokenbucket``.
    return (
        apps.get_model("django_tokenbucket", "LimitOverride"),
        apps.get_model("django_tokenbucket", "OverridesVersion"),
        apps.get_model("django_tokenbucket", "OverrideTombstone"),
    )


def database_alias() -> str:
    """Return the database alias that holds the overrides (the routers' choice for writes).

    Reads go there too: a replica that lags would hide a change this process just made.
    """
    return router.db_for_write(_models()[0]) or "default"


#: The furthest an override may end from now (100 years). Further is a slip of the
#: keyboard rather than a plan (None lasts until cleared), and soon past what a datetime
#: holds (year 9999): ``now + until`` would raise OverflowError, and a database would
#: store an end it cannot read back.
LONGEST = timedelta(days=36_525)
LONGEST_TEXT = "100 years"


def expiry(name: str, until: object) -> datetime | None:
    """Return when an override made now with ``until`` ends; ValueError naming limit ``name``
    when ``until`` is not in the future or more than ``LONGEST`` from now."""
    if until is None:
        return None
    now = _as_datetime(clock.app_now())
    if isinstance(until, timedelta):
        # Clamped before the addition, which would overflow past year 9999 (or before 1):
        # the checks below refuse what was clamped.
        ends = now + max(min(until, LONGEST + timedelta(1)), timedelta(0))
    elif isinstance(until, datetime):
        ends = until if timezone.is_aware(until) else timezone.make_aware(until)
    else:
        raise ValueError(f"rate limit {name!r}: until must be a datetime or a timedelta, not {until!r}")
    if ends <= now:
        raise ValueError(f"rate limit {name!r}: until {until!r} is not in the future (now is {now.isoformat()})")
    if ends - now > LONGEST:
        raise ValueError(
            f"rate limit {name!r}: until {until!r} is more than {LONGEST_TEXT} from now (now is {now.isoformat()}); "
            f"leave it out for an override that lasts until cleared"
        )
    return ends


def key_digest(name: str, key: object) -> tuple[str, str]:
    """Return the digest and label an override of ``key`` is stored under ("" for every key).

    A key of request data (``("post:username", "Alice@Example.com ")``,
    ``("header:X-Api-Key", ...)``) is normalised as the decorator normalises what a
    request sends, and an address (``("ip", "2001:db8::7")``, ``("ip", "::ffff:192.0.2.9")``)
    becomes the network or IPv4 address that keys its requests, so that the override
    reaches the bucket that request's decisions use. ValueError naming limit ``name``
    when ``key`` cannot be a key.
    """
    if key is None:
        return "", ""
    if is_request_data_key(key) and isinstance(key, tuple) and len(key) == 2 and isinstance(key[1], str):
        key = (canonical_spec(key[0]), Redacted(normalize_identity(key[1])))
    elif isinstance(key, tuple) and len(key) == 2 and key[0] == "ip" and isinstance(key[1], str):
        key = ip_key_from_text(key[1]) or key
    try:
        encoded = encode_key(key)
    except TypeError as exc:
        raise ValueError(f"rate limit {name!r}: {exc}") from None
    return encoded.digest, encoded.label


def check_admits(limit: LimitConfig, numbers: Mapping[str, int | None]) -> None:
    """Raise ValueError naming the limit unless ``numbers`` (micro-units, None: the limit's
    own) make a valid limit of ``limit`` that can admit a call of one token."""
    try:
        derived = derive(limit, **(dict.fromkeys(NUMBERS) | dict(numbers)))
    except ImproperlyConfigured as exc:
        raise ValueError(f"{exc} (in an override)") from None
    if derived.max_plain_count < MICRO and (derived.max_count or 0) < MICRO:
        raise ValueError(
            f"rate limit {limit.name!r}: this override could never admit a call of one token "
            f"(capacity {derived.capacity_tokens:g}); give a capacity of at least 1, or block the key"
        )


def save_checked(
    name: str,
    digest: str,
    label: str,
    action: str,
    numbers: Mapping[str, int | None],
    *,
    until: object,
    reason: str,
    created_by: str,
) -> LimitOverride:
    """``save`` after the checks every writer makes (the API, the admin, the command):
    overrides on, ``reason`` and ``created_by`` text, ``until`` in the future. ``numbers``
    are checked by the caller (``check_admits``)."""
    if active() is None:
        raise ImproperlyConfigured(
            f"rate limit {name!r}: overrides are off (TOKENBUCKET['OVERRIDES'] is False), so this one "
            f"would never apply; set OVERRIDES to {{'MAX_AGE': {OVERRIDES_MAX_AGE}}} to use them"
        )
    for what, text in (("reason", reason), ("created_by", created_by)):
        if not isinstance(text, str):
            raise ValueError(f"rate limit {name!r}: {what} must be a str, not {text!r}")
    if len(created_by) > 150:
        raise ValueError(f"rate limit {name!r}: created_by must be at most 150 characters (a username)")
    fields = {"expires_at": expiry(name, until), "reason": reason, "created_by": created_by}
    return save(name, digest, label, action, dict.fromkeys(NUMBERS) | dict(numbers), fields)


def save(
    name: str, digest: str, label: str, action: str, numbers: dict[str, int | None], fields: dict[str, Any]
) -> LimitOverride:
    """Create or replace the override of key ``digest`` ("" every key) of limit ``name``.

    The row, at the next revision, and the version row change in one transaction, which
    joins the caller's.
    """
    overrides, _, _ = _models()
    alias = database_alias()
    with transaction.atomic(using=alias):
        revision = _bump(alias)
        row, _created = overrides.objects.using(alias).update_or_create(
            name=name,
            key=digest,
            defaults={"label": label, "action": action, **numbers, **fields, "revision": revision},
        )
    _changed(alias, revision, (name, digest))
    return row


def delete(name: str, digest: str) -> int:
    """Delete the override of key ``digest`` ("" every key) of limit ``name``; return how many.

    A tombstone at the next revision tells the other processes, which read what changed.
    """
    overrides, _, tombstones = _models()
    alias = database_alias()
    rows = overrides.objects.using(alias).filter(name=name, key=digest)
    if not rows.exists():  # nothing to tell anyone: no revision for it
        return 0
    with transaction.atomic(using=alias):
        # The version row first, as every writer takes it: two writers never wait for
        # each other's row in the opposite order.
        revision = _bump(alias)
        removed, _by_model = rows.delete()
        tombstones.objects.using(alias).update_or_create(
            name=name, key=digest, defaults={"revision": revision, "deleted_at": _as_datetime(clock.app_now())}
        )
    # Told even when another writer deleted it meanwhile: a tombstone is never wrong.
    _changed(alias, revision, (name, digest))
    return int(removed)


#: Seconds a tombstone is kept before cleanup deletes it: a process whose snapshot is
#: older than that (idle for a day) reads every override at its next decision.
TOMBSTONES_KEPT = 86_400


def remove_expired(*, names: Iterable[str] | None = None, dry_run: bool = False) -> int:
    """Delete the overrides that expired more than ``KEEP_EXPIRED`` ago (of limits ``names``,
    or all); return how many went (would go, with ``dry_run``). Cleanup calls it.

    An expired override applies nowhere already, so nothing changes for any decision and
    no process has to read the overrides again: ``OverridesVersion.floor`` rises past the
    revisions deleted (and those of tombstones older than ``TOMBSTONES_KEPT``, deleted
    too), so that only a process whose snapshot is older than them reads them all. Nothing
    is done while overrides are off (the tables may not exist); ``KEEP_EXPIRED`` None
    keeps every override, tombstones still go.
    """
    found = active()
    if found is None:
        return 0
    overrides, version, tombstones = _models()
    alias = database_alias()
    now = clock.app_now()
    expired = overrides.objects.using(alias).none()
    if found.keep_expired is not None:
        expired = overrides.objects.using(alias).filter(
            expires_at__lt=_as_datetime(now - round(found.keep_expired * MICRO))
        )
    old = tombstones.objects.using(alias).filter(deleted_at__lt=_as_datetime(now - TOMBSTONES_KEPT * MICRO))
    if names is not None:
        names = list(names)
        expired, old = expired.filter(name__in=names), old.filter(name__in=names)
    if dry_run:
        return int(expired.count())
    with transaction.atomic(using=alias):
        # Locked: no change can take a revision between the floor read here and the deletion.
        list(version.objects.using(alias).select_for_update().filter(pk=1).values_list("pk"))
        floor = max(
            expired.aggregate(most=Max("revision"))["most"] or 0, old.aggregate(most=Max("revision"))["most"] or 0
        )
        removed, _by_model = expired.delete()
        old.delete()
        if floor:
            version.objects.using(alias).filter(pk=1, floor__lt=floor).update(floor=floor)
    return int(removed)


def in_force(name: str | None = None) -> list[LimitOverride]:
    """Return the overrides in force (of limit ``name``, or all), by limit and key."""
    overrides, _, _ = _models()
    rows = overrides.objects.using(database_alias()).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=_as_datetime(clock.app_now()))
    )
    if name is not None:
        rows = rows.filter(name=name)
    return list(rows.order_by("name", "key"))


def _bump(alias: str) -> int:
    """Count one more change in the version row, in the caller's transaction; return its revision.

    The row stays locked until that transaction ends, so changes take their revisions
    in the order they commit: a process that read revision N has read every change up
    to N. A row whose stamp is not ``-revision`` was last changed by a version of this
    app that did not count (see ``OverridesVersion``): a new epoch makes every process
    read the whole table once.
    """
    _, version, _ = _models()
    rows = version.objects.using(alias).filter(pk=1)

    def count() -> int:
        # The assignments in this order: MySQL and MariaDB evaluate them left to right,
        # each seeing the ones before; the others all see the row as it was. Here both
        # read the stamp and the revision as they were.
        return rows.update(
            epoch=Case(When(stamp=-F("revision"), then=F("epoch")), default=Value(_new_epoch())),
            stamp=-(F("revision") + 1),
            revision=F("revision") + 1,
        )

    if not count():  # no row yet (a new or flushed table): made, or found made meanwhile
        _make_version_row(alias, version)
        count()
    return int(rows.values_list("revision", flat=True).get())


def _make_version_row(alias: str, version: type[OverridesVersion]) -> None:
    """Insert the version row at revision 0 unless another writer just did, without an error."""
    writer = connections[alias]
    if writer.vendor != "mysql":
        # ON CONFLICT DO NOTHING (PostgreSQL waits for the other writer's commit first).
        version.objects.using(alias).bulk_create(
            [version(pk=1, epoch=_new_epoch(), revision=0, stamp=0, floor=0)], ignore_conflicts=True
        )
        return
    # Not INSERT IGNORE (Django's ignore_conflicts here): on a duplicate it takes a shared
    # lock, and two writers that both hold one deadlock when the UPDATE wants it
    # exclusive. ON DUPLICATE KEY UPDATE takes the exclusive lock at once.
    quote = writer.ops.quote_name
    columns = ", ".join(quote(column) for column in ("id", "epoch", "revision", "stamp", "floor"))
    with writer.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {quote(version._meta.db_table)} ({columns}) VALUES (1, %s, 0, 0, 0) "
            f"ON DUPLICATE KEY UPDATE {quote('id')} = {quote('id')}",
            [_new_epoch()],
        )


def _new_epoch() -> int:
    return secrets.randbits(62) + 1  # never 0, what a missing row reads as


def _changed(alias: str, revision: int, row: tuple[str, str]) -> None:
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


def _as_datetime(micro: int) -> datetime:
    return datetime.fromtimestamp(micro / MICRO, tz=UTC)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


def _as_micro(moment: datetime) -> int:
    return (moment - _EPOCH) // _MICROSECOND


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
