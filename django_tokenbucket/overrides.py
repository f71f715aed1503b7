"""Overrides made while the site runs, and this process' snapshot of them.

An operator who gives a tenant ten times its quota, exempts a partner or blocks an
account writes a ``LimitOverride`` row; every process must then apply it to its next
decisions without a deploy, yet a decision must not pay a query for it: most sites have
no override at all, and the decision path is one store round trip. So each process
holds a snapshot, a dict from ``(name, key digest)`` (and from ``name``, for overrides of
every key) to the override in force, and a decision looks it up without I/O. The
snapshot is refreshed once ``OVERRIDES["MAX_AGE"]`` seconds passed on the monotonic
clock, by one query of a one-row version stamp (``OverridesVersion``), and the rows are
read again only when the stamp changed: every write bumps it in its own transaction. A
change made by this process applies to its next decision; one made by another process
within ``MAX_AGE``. An override past its ``expires_at`` stops applying at once, without
waiting for a refresh.

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

import math
import os
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
from django.core.signals import setting_changed
from django.db import IntegrityError, connections, router, transaction
from django.db.models import Q
from django.dispatch import receiver
from django.utils import timezone

from . import clock, deny_cache
from .algorithms import MICRO
from .keys import Redacted, encode_key, is_request_data_key
from .limits import LimitConfig, parse_limit
from .logs import throttled_logger
from .plans import plan_base
from .request_keys import canonical_spec, ip_key_from_text, normalize_identity
from .settings import feature_options, tokenbucket_settings

if TYPE_CHECKING:
    from .models import LimitOverride, OverridesVersion

__all__ = [
    "ACTIONS",
    "BLOCK",
    "DEFAULT_MAX_AGE",
    "EXEMPT",
    "LIMIT",
    "LONGEST",
    "NUMBERS",
    "Override",
    "Settings",
    "active",
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
    "parse",
    "refresh_if_due",
    "save",
    "save_checked",
]

LIMIT = "limit"
EXEMPT = "exempt"
BLOCK = "block"
ACTIONS = (LIMIT, EXEMPT, BLOCK)
DEFAULT_MAX_AGE = 5.0
#: Seconds an expired override is kept (the admin shows it, its reason and author) before
#: cleanup deletes it: 30 days.
DEFAULT_KEEP_EXPIRED = 30 * 24 * 3600
_MOST_KEPT = 100 * 365 * 24 * 3600
#: The fields of a ``limit`` override, as LimitConfig and the model name them.
NUMBERS = ("rate", "period", "capacity", "max_reserved")


@dataclass(frozen=True)
class Settings:
    """``TOKENBUCKET["OVERRIDES"]``, validated."""

    #: Seconds a snapshot is used before the version stamp is read again.
    max_age: float
    #: Seconds after its expiry that cleanup deletes an override; None keeps them all.
    keep_expired: float | None = DEFAULT_KEEP_EXPIRED


def parse(value: object) -> Settings | None:
    """Return the ``OVERRIDES`` setting validated (None: off); ValueError says what is wrong."""
    value = feature_options(
        "OVERRIDES", value, {"MAX_AGE": DEFAULT_MAX_AGE, "KEEP_EXPIRED": DEFAULT_KEEP_EXPIRED}
    )
    if value is None:
        return None
    max_age = value.get("MAX_AGE", DEFAULT_MAX_AGE)
    if isinstance(max_age, bool) or not isinstance(max_age, (int, float)) or not 0 < max_age <= 3600:
        raise ValueError(
            f"TOKENBUCKET['OVERRIDES']['MAX_AGE'] must be a number of seconds above 0 and at most 3600, "
            f"not {max_age!r}"
        )
    keep = value.get("KEEP_EXPIRED", DEFAULT_KEEP_EXPIRED)
    if keep is not None and (
        isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 <= keep <= _MOST_KEPT
    ):
        raise ValueError(
            f"TOKENBUCKET['OVERRIDES']['KEEP_EXPIRED'] must be a number of seconds from 0 to {_MOST_KEPT} (100 "
            f"years), or None to keep expired overrides for good, not {keep!r}"
        )
    return Settings(float(max_age), None if keep is None else float(keep))


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class _Snapshot:
    #: The version stamp the rows were read at; None before the first read.
    stamp: int | None
    keyed: dict[tuple[str, str], Override]
    every_key: dict[str, Override]
    #: The limits with any override: the one test a decision on any other makes.
    names: frozenset[str]


_EMPTY = _Snapshot(None, {}, {}, frozenset())
_snapshot = _EMPTY
#: The monotonic time (s) after which the next decision reads the stamp again.
_due = 0.0
#: Bumped by every invalidation, so that a refresh that began before one does not
#: postpone the next read by MAX_AGE (it may have read the rows before the change).
_generation = 0
_lock = threading.Lock()
_settings: Settings | bool | None = True  # True: not read yet
#: Changes this process made inside transactions not over yet: (the writer's connection,
#: the ``on_commit`` callback that reads the overrides again). A rollback runs nothing,
#: but removes the callback from the connection's pending ones: the next decision, on
#: any thread, sees it gone and reads again, rather than apply a change that never was
#: for up to MAX_AGE (a TestCase's override leaking into the next test).
_pending: list[tuple[Any, Callable[[], None]]] = []


def active() -> Settings | None:
    """Return the setting in force (None: overrides are off); raise ImproperlyConfigured if malformed."""
    global _settings
    if _settings is True:
        try:
            _settings = parse(tokenbucket_settings.user_settings.get("OVERRIDES", {}))
        except ValueError as exc:
            raise ImproperlyConfigured(str(exc)) from None
    return _settings  # type: ignore[return-value]


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
    """Read the version stamp (and the overrides, if it changed) when MAX_AGE has passed."""
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
    """Read again if a change made here inside a transaction was rolled back."""
    gone = []
    for entry in list(_pending):
        writer, callback = entry
        # Another thread's connection: its list is copied, not iterated while it changes.
        if not any(waiting[1] is callback for waiting in list(writer.run_on_commit)):
            gone.append(entry)
    if gone:
        for entry in gone:
            _discard(entry)
        invalidate()


def _discard(entry: tuple[Any, Callable[[], None]]) -> None:
    try:
        _pending.remove(entry)
    except ValueError:  # another thread discarded it first
        pass


def invalidate() -> None:
    """Read the overrides again before the next decision (a change made in this process)."""
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
                len(_snapshot.keyed) + len(_snapshot.every_key),
                exc,
            )
        _due = started + settings.max_age if generation == _generation else 0.0
    finally:
        _lock.release()


def _read() -> None:
    overrides, version = _models()
    alias = database_alias()
    # Inside the caller's transaction a failing query must not break it (PostgreSQL
    # refuses every later statement of a transaction in error): a savepoint contains it.
    scope = transaction.atomic(using=alias) if connections[alias].in_atomic_block else nullcontext()
    with scope:
        stamp = version.objects.using(alias).filter(pk=1).values_list("stamp", flat=True).first() or 0
        if stamp == _snapshot.stamp:
            return
        rows = overrides.objects.using(alias).all()
        # Expired rows stay until someone deletes them; they need no place in memory. A
        # pinned clock (tests) may be moved back, so there every row is kept and
        # ``lookup`` alone tells which apply.
        if clock.override() is None:
            rows = rows.filter(Q(expires_at__isnull=True) | Q(expires_at__gt=timezone.now()))
        found = list(rows.values_list("name", "key", "action", *NUMBERS, "expires_at"))
    _install(stamp, [_from_row(*row) for row in found])


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


def _install(stamp: int, found: list[Override]) -> None:
    """Make ``found`` the snapshot, forgetting the denials a changed override may contradict."""
    global _snapshot
    keyed = {(o.name, o.digest): o for o in found if o.digest}
    every_key = {o.name: o for o in found if not o.digest}
    old = _snapshot
    # A denial remembered under the old numbers would hide a new exemption, a raised
    # rate, or the end of a block: those keys (and limits) are asked of the store again.
    for row in old.keyed.keys() | keyed.keys():
        if old.keyed.get(row) != keyed.get(row):
            deny_cache.forget(*row)
            deny_cache.forget_plans(*row)
    for name in old.every_key.keys() | every_key.keys():
        if old.every_key.get(name) != every_key.get(name):
            deny_cache.forget_limit(name)
            deny_cache.forget_plans(name)
    names = frozenset(name for name, _ in keyed) | frozenset(every_key)
    _snapshot = _Snapshot(stamp, keyed, every_key, names)


def _models() -> tuple[type[LimitOverride], type[OverridesVersion]]:
    # Looked up, not imported: this module is imported (by ``api``) before the app
    # registry is ready, when settings files import ``django_tokenbucket``.
    return apps.get_model("django_tokenbucket", "LimitOverride"), apps.get_model(
        "django_tokenbucket", "OverridesVersion"
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
            f"would never apply; set OVERRIDES to {{'MAX_AGE': {DEFAULT_MAX_AGE}}} to use them"
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

    The row and the version stamp change in one transaction, which joins the caller's.
    """
    overrides, _ = _models()
    alias = database_alias()
    with transaction.atomic(using=alias):
        row, _created = overrides.objects.using(alias).update_or_create(
            name=name, key=digest, defaults={"label": label, "action": action, **numbers, **fields}
        )
        _bump(alias)
    _changed(alias)
    return row


def delete(name: str, digest: str) -> int:
    """Delete the override of key ``digest`` ("" every key) of limit ``name``; return how many."""
    overrides, _ = _models()
    alias = database_alias()
    with transaction.atomic(using=alias):
        removed, _by_model = overrides.objects.using(alias).filter(name=name, key=digest).delete()
        if removed:
            _bump(alias)
    if removed:
        _changed(alias)
    return int(removed)


def remove_expired(*, names: Iterable[str] | None = None, dry_run: bool = False) -> int:
    """Delete the overrides that expired more than ``KEEP_EXPIRED`` ago (of limits ``names``,
    or all); return how many went (would go, with ``dry_run``). Cleanup calls it.

    An expired override applies nowhere already, so nothing changes for any decision and
    no process has to read the overrides again. Nothing is done while overrides are off
    (the tables may not exist) or ``KEEP_EXPIRED`` is None.
    """
    found = active()
    if found is None or found.keep_expired is None:
        return 0
    overrides, _ = _models()
    before = _as_datetime(clock.app_now() - round(found.keep_expired * MICRO))
    rows = overrides.objects.using(database_alias()).filter(expires_at__lt=before)
    if names is not None:
        rows = rows.filter(name__in=list(names))
    if dry_run:
        return int(rows.count())
    removed, _by_model = rows.delete()
    return int(removed)


def in_force(name: str | None = None) -> list[LimitOverride]:
    """Return the overrides in force (of limit ``name``, or all), by limit and key."""
    overrides, _ = _models()
    rows = overrides.objects.using(database_alias()).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=_as_datetime(clock.app_now()))
    )
    if name is not None:
        rows = rows.filter(name=name)
    return list(rows.order_by("name", "key"))


def _bump(alias: str) -> None:
    """Give the version stamp a new value: every process reads the overrides again."""
    _, version = _models()
    stamp = secrets.randbits(62) + 1  # never 0, what a missing row reads as
    rows = version.objects.using(alias)
    if rows.filter(pk=1).update(stamp=stamp):
        return
    try:
        with transaction.atomic(using=alias):
            rows.create(pk=1, stamp=stamp)
    except IntegrityError:  # another writer created it meanwhile
        rows.filter(pk=1).update(stamp=stamp)


def _changed(alias: str) -> None:
    invalidate()
    writer = connections[alias]
    if not writer.in_atomic_block:
        return
    # Read again when the change commits too: until then a read on another thread's
    # connection would not see it. Watched until then, in case it is rolled back.
    entry: tuple[Any, Callable[[], None]]

    def committed() -> None:
        _discard(entry)
        invalidate()

    entry = (writer, committed)
    _pending.append(entry)
    transaction.on_commit(committed, using=alias)


def _as_datetime(micro: int) -> datetime:
    return datetime.fromtimestamp(micro / MICRO, tz=UTC)


def _as_micro(moment: datetime) -> int:
    delta = moment - datetime(1970, 1, 1, tzinfo=UTC)
    return delta // timedelta(microseconds=1)


def _after_fork_in_child() -> None:
    global _lock
    # The parent's lock may have been held by another thread at the fork; the child
    # keeps the snapshot but reads the stamp again before its first decision.
    _lock = threading.Lock()
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


os.register_at_fork(after_in_child=_after_fork_in_child)


@receiver(setting_changed)
def _settings_changed(*, setting: str, **kwargs: Any) -> None:
    global _settings, _snapshot
    if setting == "TOKENBUCKET":
        _settings = True
        _snapshot = _EMPTY
        _pending.clear()
        invalidate()
