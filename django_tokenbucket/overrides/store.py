"""Writing overrides: ``make`` (every writer's one way), ``delete``, and cleanup's ``remove_expired``.

Each write changes its row, at the next revision, and the version row in one
transaction (``rows.bump``), then tells this process' snapshot (``snapshot.changed``),
so that this process applies it at its next decision and every other within
``MAX_AGE``. A plain ``Model.save()`` or ``delete()`` would not count the change, and
other processes would apply the old override until the next one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta
from types import EllipsisType
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured
from django.db import transaction
from django.db.models import Max, Q
from django.utils import timezone

from .. import clock
from ..algorithms import MICRO
from ..settings import OVERRIDES_MAX_AGE
from .rows import as_datetime, bump, database_alias, models
from .rules import ACTIONS, LONGEST, LONGEST_TEXT, NUMBERS, key_digest
from .snapshot import active, changed

if TYPE_CHECKING:
    from ..models import LimitOverride

__all__ = ["TOMBSTONES_KEPT", "delete", "expiry", "in_force", "make", "remove_expired", "require_on"]


def expiry(name: str, until: object) -> datetime | None:
    """Return when an override made now with ``until`` ends; ValueError naming limit ``name``
    when ``until`` is not in the future or more than ``LONGEST`` from now."""
    if until is None:
        return None
    now = as_datetime(clock.app_now())
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


def require_on(name: str) -> None:
    """Raise ImproperlyConfigured naming limit ``name`` when overrides are off: a write would never apply."""
    if active() is None:
        raise ImproperlyConfigured(
            f"rate limit {name!r}: overrides are off (TOKENBUCKET['OVERRIDES'] is False), so this one "
            f"would never apply; set OVERRIDES to {{'MAX_AGE': {OVERRIDES_MAX_AGE}}} to use them"
        )


def make(
    name: str,
    key: object,
    action: str,
    numbers: Mapping[str, int | None] | None = None,
    *,
    until: object = None,
    ends: datetime | EllipsisType | None = ...,
    reason: str = "",
    created_by: str = "",
) -> LimitOverride:
    """Create or replace the override of ``key`` (None: every key) of limit ``name``; return its row.

    The one way an override is written: by the API (``limiter.override``/``exempt``/
    ``block``, which the admin's add form and the command call), a bucket page, an
    edit or an expiry in the admin, and a login lockout. ``key`` is built as requests
    build theirs (``rules.key_digest``); a ``rules.Digest`` is a key known by its digest
    only. ``numbers`` (action ``limit``) come from ``rules.numbers``, checked there. The
    checks every writer needs: overrides on (ImproperlyConfigured), ``action`` one of
    ``ACTIONS``, ``reason`` and ``created_by`` text, ``until`` (a datetime or a timedelta
    from now) in the future and within ``LONGEST``; ``ends`` instead is an end already
    decided (a stored row's, kept as it is even if it passed, or now, to expire it).
    ValueError naming the limit otherwise. The row, at the next revision, and the
    version row change in one transaction, which joins the caller's; this process
    applies the change at its next decision.
    """
    require_on(name)
    if action not in ACTIONS:
        raise ValueError(f"rate limit {name!r}: {action!r} is not an override's action ({', '.join(ACTIONS)})")
    for what, text in (("reason", reason), ("created_by", created_by)):
        if not isinstance(text, str):
            raise ValueError(f"rate limit {name!r}: {what} must be a str, not {text!r}")
    if len(created_by) > 150:
        raise ValueError(f"rate limit {name!r}: created_by must be at most 150 characters (a username)")
    if until is not None and ends is not ...:
        raise TypeError("give until (from now) or ends (decided already), not both")
    digest, label = key_digest(name, key)
    expires_at = expiry(name, until) if ends is ... else ends
    fields = {"expires_at": expires_at, "reason": reason, "created_by": created_by}
    return _write(name, digest, label, action, dict.fromkeys(NUMBERS) | dict(numbers or {}), fields)


def _write(
    name: str, digest: str, label: str, action: str, numbers: dict[str, int | None], fields: dict[str, Any]
) -> LimitOverride:
    """Create or replace the override of key ``digest`` ("" every key) of limit ``name``: ``make``, checked.

    The row, at the next revision, and the version row change in one transaction, which
    joins the caller's.
    """
    overrides, _, _ = models()
    alias = database_alias()
    with transaction.atomic(using=alias):
        revision = bump(alias)
        row, _created = overrides.objects.using(alias).update_or_create(
            name=name,
            key=digest,
            defaults={"label": label, "action": action, **numbers, **fields, "revision": revision},
        )
    changed(alias, revision, (name, digest))
    return row


def delete(name: str, digest: str) -> int:
    """Delete the override of key ``digest`` ("" every key) of limit ``name``; return how many.

    A tombstone at the next revision tells the other processes, which read what changed.
    """
    overrides, _, tombstones = models()
    alias = database_alias()
    rows = overrides.objects.using(alias).filter(name=name, key=digest)
    if not rows.exists():  # nothing to tell anyone: no revision for it
        return 0
    with transaction.atomic(using=alias):
        # The version row first, as every writer takes it: two writers never wait for
        # each other's row in the opposite order.
        revision = bump(alias)
        removed, _by_model = rows.delete()
        tombstones.objects.using(alias).update_or_create(
            name=name, key=digest, defaults={"revision": revision, "deleted_at": as_datetime(clock.app_now())}
        )
    # Told even when another writer deleted it meanwhile: a tombstone is never wrong.
    changed(alias, revision, (name, digest))
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
    overrides, version, tombstones = models()
    alias = database_alias()
    now = clock.app_now()
    expired = overrides.objects.using(alias).none()
    if found.keep_expired is not None:
        expired = overrides.objects.using(alias).filter(
            expires_at__lt=as_datetime(now - round(found.keep_expired * MICRO))
        )
    old = tombstones.objects.using(alias).filter(deleted_at__lt=as_datetime(now - TOMBSTONES_KEPT * MICRO))
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
    overrides, _, _ = models()
    rows = overrides.objects.using(database_alias()).filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=as_datetime(clock.app_now()))
    )
    if name is not None:
        rows = rows.filter(name=name)
    return list(rows.order_by("name", "key"))
